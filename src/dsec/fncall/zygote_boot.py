"""Starts the FnCall zygote (``zygote.py``) without compiling it in the zygote's own process.

``python3 -I zygote_boot.py ZYGOTE ARGS…``: a script is compiled from source at every start, and
the compiler leaves a megabyte or two of fragmented heap behind, which every fork of the zygote
would then copy and every call's exit tear down again. So a short-lived child compiles the
zygote and hands the code over marshalled; this process only loads it. Standard library only.
"""

import marshal
import os
import sys


def _compiled(path):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            with open(path, "rb") as f:
                data = memoryview(marshal.dumps(compile(f.read(), path, "exec")))
            while data:
                data = data[os.write(write_end, data):]
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 20):
        chunks.append(chunk)
    os.close(read_end)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"cannot compile {path}")
    return marshal.loads(b"".join(chunks))


def _boot(argv):
    path = argv[1]
    zygote = type(sys)("dsec_zygote")
    zygote.__file__ = path
    sys.modules[zygote.__name__] = zygote
    exec(_compiled(path), zygote.__dict__)  # noqa: S102 - our own code
    zygote.main([argv[0], *argv[2:]])


if __name__ == "__main__":
    _boot(sys.argv)
