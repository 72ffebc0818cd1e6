"""The small C programs DSec runs inside sandboxes: ``init`` (a container's pid 1, which starts
its commands) and ``jail`` (confines a command: Landlock, a pid namespace, capabilities,
no_new_privs, seccomp). Static, so one file runs in any image and inside a VM's guest. And one
shared library, ``zygote`` (the FnCall zygote's per-call loop, which the image's python3 loads
with ctypes: dynamically linked, to the image's glibc; see ``dsec.fncall.zygote``).

They are built from the sources beside this file by the host's C compiler the first time they
are needed, into a cache named by the source's digest (a changed source builds anew; two
processes building at once both end with the same file, written whole and renamed). Versions
unused for a day are removed (other checkouts may share the cache)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from libdsec import BackendError

from .. import settings

SOURCES = Path(__file__).parent
CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra", "-Werror")
LIBRARY_CFLAGS = ("-shared", "-fPIC", "-O2", "-s", "-Wall", "-Wextra", "-Werror")


class NativeBuildError(BackendError):
    """A helper program could not be built (no C compiler or static libc, or a compile error)."""


def digest(name: str, flags: tuple[str, ...] = CFLAGS) -> str:
    """The version of program ``name``: its source and the flags it is built with."""
    text = (SOURCES / f"{name}.c").read_bytes()
    return hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]


def binary(name: str, cache: Path | None = None) -> Path:
    """The path of the built program ``name`` (from ``name.c``), building it if needed."""
    return _build(name, CFLAGS, "", cache)


def library(name: str, cache: Path | None = None) -> Path:
    """The path of the built shared library ``name`` (from ``name.c``), building it if needed."""
    return _build(name, LIBRARY_CFLAGS, ".so", cache)


def _build(name: str, flags: tuple[str, ...], suffix: str, cache: Path | None) -> Path:
    cache = Path(cache) if cache is not None else settings.current().native_cache
    target = cache / f"dsec-{name}-{digest(name, flags)}{suffix}"
    if target.exists():
        with contextlib.suppress(OSError):
            if time.time() - target.stat().st_mtime > 3600:
                os.utime(target)  # in use: not pruned below
        return target
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise NativeBuildError(f"cannot build dsec-{name}{suffix}: no C compiler (install gcc and libc6-dev)")
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".dsec-{name}-", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCES / f"{name}.c")], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(f"cannot build dsec-{name}{suffix} (needs libc6-dev): {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in cache.glob(f"dsec-{name}-*{suffix}"):
        with contextlib.suppress(OSError):
            if old != target and time.time() - old.stat().st_mtime > 86400:
                old.unlink()
    return target
