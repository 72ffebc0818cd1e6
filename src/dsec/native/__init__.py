"""The few small C programs DSec puts inside sandboxes (static, so they run in any image).

They are built from the sources beside this file by the host's C compiler the first time they
are needed, into a cache named by the source's digest (a changed source builds anew; two
processes building at once both end with the same file, written whole by rename)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).parent
CACHE = Path(os.environ.get("DSEC_NATIVE_CACHE", "/var/cache/dsec/bin"))
CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra", "-Werror")


class NativeBuildError(RuntimeError):
    """A helper program could not be built (no C compiler or static libc, or a compile error)."""


def binary(name: str) -> Path:
    """The path of the built program ``name`` (from ``name.c``), building it if needed."""
    source = SOURCES / f"{name}.c"
    text = source.read_bytes()
    digest = hashlib.sha256(text + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = CACHE / f"dsec-{name}-{digest}"
    if target.exists():
        return target
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise NativeBuildError(f"cannot build dsec-{name}: no C compiler (install gcc and libc6-dev)")
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".dsec-{name}-", dir=CACHE)
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(f"cannot build dsec-{name}: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
