"""A sandbox file's extended attributes in one namespace, read and written from the node
(E2B's file metadata: ``user.e2b.<key>``).

The file is reached through the sandbox's own root (``HostPaths.open_path``: no symlink
followed anywhere on the way) as an ``O_PATH`` descriptor, and its attributes through that
descriptor's ``/proc/self/fd`` link, so no name is looked up twice. Only the ``user.``
namespace is offered (the kernel's ``trusted.`` and ``security.`` ones are the host's).
Bounds: ``MAX_KEYS`` attributes a file, names of ``MAX_NAME`` bytes, values of ``MAX_VALUE``.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable

from libdsec import InvalidRequest, SandboxFileNotFound

MAX_KEYS = 64
MAX_NAME = 255
MAX_VALUE = 4096
_PREFIX = re.compile(r"\Auser\.[A-Za-z0-9_.-]{0,64}\Z")

# opens a path of the sandbox as an O_PATH descriptor, no symlink followed
OpenPath = Callable[[str], int]


def check_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise InvalidRequest(f"attribute namespace {prefix!r}: give 'user.' and letters, digits, '_', '-' or '.'")
    return prefix


def _open(open_path: OpenPath, path: str) -> int:
    try:
        return open_path(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise SandboxFileNotFound(f"no such file in sandbox: {path}") from None
        raise InvalidRequest(f"cannot open {path}: {exc.strerror}") from None


def read(open_path: OpenPath, path: str, prefix: str) -> dict[str, str]:
    """The attributes of ``path`` under ``prefix``, the prefix taken off their names."""
    fd = _open(open_path, path)
    try:
        link = f"/proc/self/fd/{fd}"
        try:
            names = [n for n in os.listxattr(link) if n.startswith(prefix)]
            return {n[len(prefix):]: os.getxattr(link, n).decode("utf-8", "replace") for n in names}
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EPERM, errno.ENODATA):
                return {}  # (a symlink or a filesystem without them: none)
            raise InvalidRequest(f"cannot read the attributes of {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def write(open_path: OpenPath, path: str, prefix: str, values: dict[str, str]) -> None:
    """Make ``values`` the attributes of ``path`` under ``prefix``: the ones it had there and
    ``values`` does not name go."""
    if len(values) > MAX_KEYS:
        raise InvalidRequest(f"{len(values)} attributes for {path}: at most {MAX_KEYS}")
    for key, value in values.items():
        if not key or len((prefix + key).encode()) > MAX_NAME or "\0" in key:
            raise InvalidRequest(f"attribute name {key!r} for {path}: 1 to {MAX_NAME - len(prefix)} bytes, no NUL")
        if len(value.encode()) > MAX_VALUE:
            raise InvalidRequest(f"attribute {key!r} of {path}: its value is over {MAX_VALUE} bytes")
    fd = _open(open_path, path)
    try:
        link = f"/proc/self/fd/{fd}"
        try:
            for name in os.listxattr(link):
                if name.startswith(prefix) and name[len(prefix):] not in values:
                    os.removexattr(link, name)
            for key, value in values.items():
                os.setxattr(link, prefix + key, value.encode())
        except OSError as exc:
            if exc.errno == errno.ENOSPC or exc.errno == errno.E2BIG:
                raise InvalidRequest(f"the attributes of {path} do not fit: {exc.strerror}") from None
            raise InvalidRequest(f"cannot set the attributes of {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
