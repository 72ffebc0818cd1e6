"""``python -m dsec_bench NAME …``: the benchmarks without the ``dsec`` entry point (a tree on
PYTHONPATH, as the Debian 12 host VM's tests have it); the same as ``dsec bench NAME …``."""

from .cli import app

if __name__ == "__main__":
    app(prog_name="dsec bench")
