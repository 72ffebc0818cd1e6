"""A container sandbox's files, from the node: each path is resolved in the sandbox's own root
(``/proc/<init>/root``) with openat2(RESOLVE_IN_ROOT), so a symlink inside the sandbox can never
point outside it; files and directories the node makes belong to the sandbox's user as the
host sees it (its id range, with a user namespace).

Every call opens the root afresh and closes it before it returns; a sandbox whose init is gone
has no root (``SandboxStateError``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat

from libdsec import InvalidRequest, SandboxFileNotFound, SandboxStateError

from ... import _sys
from ...isolation import userns
from ..base import Handle, numeric_user, user_from_passwd


class Files:
    """``ContainerBackend``'s file calls."""

    id_ranges: userns.IdRanges | None

    def _host_ids(self, handle: Handle, uid: int, gid: int) -> tuple[int, int]:
        """A sandbox's uid/gid as the host sees them (files written from the host)."""
        idmap = self.id_ranges.of(handle.cid) if self.id_ranges else None
        if idmap is None:
            return uid, gid
        return idmap.host(uid), idmap.host(gid)

    def _root_fd(self, handle: Handle) -> int:
        try:
            return os.open(f"/proc/{handle.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxStateError(f"sandbox process of {handle.cid} is gone") from exc

    def open_path(self, handle: Handle, path: str, flags: int, mode: int = 0o644) -> int:
        """A path of the sandbox from the node: resolved in its root, no symlink followed."""
        root = self._root_fd(handle)
        try:
            fd = _sys.openat2(root, path, flags | os.O_NOFOLLOW, mode if flags & os.O_CREAT else 0,
                              _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_SYMLINKS | _sys.RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(root)
        if flags & os.O_CREAT and flags & os.O_EXCL:
            try:
                os.fchown(fd, *self._host_ids(handle, 0, 0))
            except OSError:
                os.close(fd)
                raise
        return fd

    def _check_dir(self, handle: Handle, path: str) -> None:
        root = self._root_fd(handle)
        try:
            fd = _sys.openat2(root, path, os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT)
            os.close(fd)
        except OSError as exc:
            raise InvalidRequest(f"workdir {path!r} is not a directory in the sandbox: {exc.strerror}") from None
        finally:
            os.close(root)

    async def read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        return await asyncio.to_thread(self._read_file, handle, path, max_bytes)

    def _read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        root = self._root_fd(handle)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            fd = _sys.openat2(root, path, os.O_RDONLY | os.O_NONBLOCK, 0,
                              _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_MAGICLINKS)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise SandboxFileNotFound(f"no such file in sandbox: {path}") from None
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
        finally:
            os.close(root)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)  # (os.fdopen refuses a directory)
            kind = "is a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidRequest(f"cannot read {path}: {kind}")
        with os.fdopen(fd, "rb") as f:
            if st.st_size > max_bytes:
                raise InvalidRequest(f"cannot read {path}: {st.st_size} bytes is over the {max_bytes}-byte limit")
            # In pieces: a /proc/sys file's read allocates a kernel buffer the size asked for,
            # so one read of the whole limit fails there (ENOMEM) where small ones do not.
            pieces, left = [], max_bytes
            while left > 0 and (piece := f.read(min(left, 1 << 20))):
                pieces.append(piece)
                left -= len(piece)
            return b"".join(pieces)

    async def write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        uid, gid = self._host_ids(handle, uid, gid)
        await asyncio.to_thread(self._write_file, handle, path, data, mode, uid, gid)

    def _write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        root = self._root_fd(handle)
        try:
            parent, _, name = path.rstrip("/").rpartition("/")
            if not name:
                raise InvalidRequest(f"cannot write {path!r}: not a file path")
            self._makedirs(root, parent or "/", uid, gid)
            resolve = _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_MAGICLINKS
            try:
                # A new file belongs to the sandbox's user; an existing one keeps its owner (as
                # with a shell's `>`). O_NONBLOCK: opening a FIFO must not wait for a reader.
                try:
                    fd = _sys.openat2(root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, mode, resolve)
                    created = True
                except FileExistsError:
                    fd = _sys.openat2(root, path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK, 0, resolve)
                    created = False
            except OSError as exc:
                raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise InvalidRequest(f"cannot write {path}: not a regular file")
            try:
                if created:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
            finally:
                os.close(fd)
        finally:
            os.close(root)

    def _makedirs(self, root: int, directory: str, uid: int, gid: int) -> None:
        parts = [p for p in directory.split("/") if p]
        for i in range(len(parts)):
            sub = "/" + "/".join(parts[: i + 1])
            try:
                os.close(_sys.openat2(root, sub, os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT))
                continue
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise InvalidRequest(f"cannot create directory {sub}: {exc.strerror}") from None
            parent = _sys.openat2(root, "/" + "/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT)
            try:
                os.mkdir(parts[i], 0o755, dir_fd=parent)
                fd = _sys.openat2(parent, parts[i], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, 0)
                os.fchown(fd, uid, gid)
                os.close(fd)
            except FileExistsError:
                pass
            finally:
                os.close(parent)

    async def make_dir(self, handle: Handle, path: str, uid: int, gid: int) -> None:
        uid, gid = self._host_ids(handle, uid, gid)
        root = self._root_fd(handle)
        try:
            self._makedirs(root, path, uid, gid)
        finally:
            os.close(root)

    async def resolve_user(self, handle: Handle, user: str) -> tuple[int, int]:
        """``root``, ``UID``, ``UID:GID`` or a name from the image's /etc/passwd."""
        ids = numeric_user(user)
        if ids is not None:
            return ids
        try:
            passwd = self._read_file(handle, "/etc/passwd", 1 << 20).decode(errors="replace")
        except (SandboxFileNotFound, InvalidRequest):
            passwd = ""
        return user_from_passwd(user, passwd)
