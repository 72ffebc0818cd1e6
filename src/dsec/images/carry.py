"""What a clean copy carries, and what tampering looks like, read from a writable layer.

A *clean copy* of a sandbox (``Sandbox.clean_copy(keep=[...])``) is a new sandbox from the
original image's layers with only the source's changes under the kept paths: ``carry`` replays
the entries of the source's overlay upper beneath each kept path (files, directories, links as
links, deletions as deletions, replaced directories as replaced) into the new sandbox's root,
leaving out the residue ``pack_diff`` leaves out (``scrub``). It never follows a link: the
upper is walked with directory fds and ``O_NOFOLLOW``, the target's root is entered with
``RESOLVE_IN_ROOT`` and each directory below it with ``O_NOFOLLOW`` again. The source is
frozen while this runs (the caller's job), the target has not run anything yet.

``tampered`` lists what an upper replaces or adds in the image's system paths: the shells and
every directory on the default ``PATH``, the libraries and the dynamic loader's configuration,
interpreter start-up hooks (``sitecustomize.py``, ``usercustomize.py``, ``.pth`` files) and
shell start-up files. Deletions are not counted: a missing file cannot forge an answer.

Both read the upper as the host sees it (host ids; the overlay is mounted without
``redirect_dir`` or ``metacopy``, so every upper file holds its whole content).
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from libdsec import InvalidRequest

from .. import _sys
from . import scrub

_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_REDIRECT_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# -- system paths (tampering) -------------------------------------------------------------------

# Directories whose every file is the system's: replacing or adding one is tampering.
_SYSTEM_DIRS = re.compile(
    r"(?:usr/(?:local/)?)?(?:s?bin|lib(?:32|64|x32|exec)?)(?:/|\Z)"
)
# Single files (and the files of these directories) that every shell or loader reads.
_SYSTEM_FILES = re.compile(
    r"etc/(?:ld\.so\.[^/]+|ld\.so\.conf\.d/.*|profile|profile\.d/.*|bash\.bashrc|bashrc|environment"
    r"|shells|zsh/.*|zshenv|zprofile|zshrc|python3?[^/]*/.*)\Z"
    r"|(?:root|home/[^/]+)/\.(?:bashrc|bash_profile|bash_login|profile|zshrc|zshenv|zprofile|shrc|ashrc|mkshrc"
    r"|bash_logout|inputrc)\Z"
)
# Python start-up hooks wherever site-packages may be (a user's ~/.local included).
_PYTHON_HOOK = re.compile(r"(?:^|/)(?:sitecustomize\.py|usercustomize\.py|[^/]+\.pth)\Z")


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_system_path(rel: str) -> bool:
    """Whether ``rel`` (relative to the root) is a system file (see the module docstring)."""
    return bool(_SYSTEM_DIRS.match(rel) or _SYSTEM_FILES.match(rel) or _PYTHON_HOOK.search(rel))


def system_files(rels: Iterable[str], limit: int = 1000) -> list[str]:
    """Absolute paths of the system files among ``rels``, the files (no directories, no
    whiteouts) an upper holds, relative to its root: anything in the system trees that
    ``is_system_path``, a home's (``/root``, ``/home/*``) own start-up files, Python's hooks
    in its ``.local`` (the rest of a home is the user's). At most ``limit``, sorted."""
    found = set()
    for rel in rels:
        parts = rel.split("/")
        top = parts[0]
        if top in ("bin", "sbin", "usr", "etc") or top.startswith("lib"):
            hit = is_system_path(rel)
        elif top == "root" or (top == "home" and len(parts) > 2):
            home = 1 if top == "root" else 2
            rest = parts[home:]
            hit = (len(rest) == 1 and bool(_SYSTEM_FILES.match(rel))) or (
                len(rest) > 1 and rest[0] == ".local" and bool(_PYTHON_HOOK.search(rel)))
        else:
            hit = False
        if hit:
            found.add("/" + rel)
    return sorted(found)[:limit]


def tampered(upper: str | os.PathLike, limit: int = 1000) -> list[str]:
    """Absolute paths of the files an upper replaces or adds in system paths (at most
    ``limit``): ``system_files`` of what it holds where they can be. Reads only those
    directories of the upper (an empty upper costs one ``listdir``)."""
    upper = os.fspath(upper)
    rels: list[str] = []
    try:
        top = os.listdir(upper)
    except OSError:
        return rels

    def add(rel: str, full: str) -> None:
        try:
            st = os.lstat(full)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode) and not _is_whiteout(st):
            rels.append(rel)

    def walk(rel_top: str) -> None:
        for dirpath, dirnames, filenames in os.walk(os.path.join(upper, rel_top)):
            rel_dir = os.path.relpath(dirpath, upper)
            for name in filenames:
                add(f"{rel_dir}/{name}", os.path.join(dirpath, name))

    for name in top:
        if name in ("bin", "sbin", "usr", "etc") or name.startswith("lib"):
            if os.path.isdir(os.path.join(upper, name)) and not os.path.islink(os.path.join(upper, name)):
                walk(name)
            else:
                add(name, os.path.join(upper, name))
    homes = ["root"] if "root" in top else []
    if "home" in top:
        try:
            homes += [f"home/{h}" for h in os.listdir(os.path.join(upper, "home"))]
        except OSError:
            pass
    for home in homes:
        try:
            names = os.listdir(os.path.join(upper, home))
        except OSError:
            continue
        for name in names:
            add(f"{home}/{name}", os.path.join(upper, home, name))
        if ".local" in names and not os.path.islink(os.path.join(upper, home, ".local")):
            walk(f"{home}/.local")
    return system_files(rels, limit)


# -- kept paths ----------------------------------------------------------------------------------


def normalize_paths(paths: list[str], what: str) -> list[str]:
    """Absolute, without ``..``, each once, a path inside another dropped; ``InvalidRequest``."""
    out: list[str] = []
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise InvalidRequest(f"{what} {path!r} is not an absolute path")
        if ".." in path.split("/"):
            raise InvalidRequest(f"{what} {path!r} contains '..'")
        norm = posixpath.normpath(path)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        out.append(norm)
    out.sort()
    kept: list[str] = []
    for p in out:
        if not kept or not (p == kept[-1] or p.startswith(kept[-1].rstrip("/") + "/")):
            kept.append(p)
    return kept


def check_in_root(root_fd: int, path: str, what: str, sandbox: str) -> None:
    """``path`` exists under ``root_fd`` and no component of it is a symbolic link."""
    fd = os.dup(root_fd)
    walked = ""
    try:
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            walked += "/" + part
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise InvalidRequest(f"{what} {path!r} does not exist in {sandbox}") from None
            except NotADirectoryError:
                raise InvalidRequest(f"{what} {path!r}: {walked.rsplit('/', 1)[0]} is not a directory") from None
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(part, dir_fd=fd)
                raise InvalidRequest(
                    f"{what} {path!r} passes through the symbolic link {walked} -> {target}: links are carried "
                    f"as links, never followed; name a path without links")
            if i < len(parts) - 1:
                if not stat.S_ISDIR(st.st_mode):
                    raise InvalidRequest(f"{what} {path!r}: {walked} is not a directory")
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
    finally:
        os.close(fd)


# -- carrying ------------------------------------------------------------------------------------


@dataclass
class Carried:
    files: int = 0
    bytes: int = 0
    scrubbed: list[str] = field(default_factory=list)


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def _opaque(fd: int) -> bool:
    return any(_xattr(fd, x) in (b"y", b"x") for x in _OPAQUE_XATTRS)


def _check_plain(fd: int, rel: str) -> None:
    for x in _REDIRECT_XATTRS:
        if _xattr(fd, x) is not None:
            raise OSError(errno.ENOTSUP, f"/{rel} carries an overlay {x.rsplit('.', 1)[1]} (not supported)")


def _remove(dfd: int, name: str) -> None:
    """Remove ``name`` under directory ``dfd``, a directory with all it holds; never following."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    try:
        for entry in os.listdir(sub):
            _remove(sub, entry)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dfd)


def _open_dir(dfd: int, name: str, mode: int = 0o755) -> int:
    """The directory ``name`` under ``dfd`` (made if missing; a non-directory there replaced)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except (NotADirectoryError, OSError) as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(name, dir_fd=dfd)
    os.mkdir(name, mode, dir_fd=dfd)
    return os.open(name, _DIR_FLAGS, dir_fd=dfd)


class _Copier:
    def __init__(self, ids: Callable[[int], int], carried: Carried) -> None:
        self.ids = ids
        self.carried = carried
        # Hard links among the carried files: (dev, ino) of the source → (dir fd, name) copied.
        self.links: dict[tuple[int, int], tuple[int, str]] = {}
        self.fds: list[int] = []

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def meta(self, st: os.stat_result, name: str, dfd: int, fd: int | None = None) -> None:
        uid, gid = self.ids(st.st_uid), self.ids(st.st_gid)
        if fd is not None:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:  # a link: no mode of its own
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)

    def entry(self, sfd: int, dfd: int, name: str, rel: str) -> None:
        """Carry entry ``name`` of source directory ``sfd`` into target directory ``dfd``."""
        if scrub.is_residue(rel):
            self.carried.scrubbed.append("/" + rel)
            return
        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        mode = st.st_mode
        if _is_whiteout(st):  # deleted by the agent: deleted in the copy
            _remove(dfd, name)
            return
        if stat.S_ISDIR(mode):
            src = os.open(name, _DIR_FLAGS, dir_fd=sfd)
            try:
                _check_plain(src, rel)
                if _opaque(src):  # replaced by the agent: what the image had there goes
                    _remove(dfd, name)
                dst = _open_dir(dfd, name, stat.S_IMODE(mode))
                try:
                    self.tree(src, dst, rel)
                    self.meta(st, name, dfd, dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            return
        if stat.S_ISSOCK(mode) or stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
            return  # sockets are runtime state; device nodes do not travel
        _remove(dfd, name)
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
            self.meta(st, name, dfd)
            self.carried.files += 1
            return
        if stat.S_ISFIFO(mode):
            os.mkfifo(name, stat.S_IMODE(mode), dir_fd=dfd)
            os.chown(name, self.ids(st.st_uid), self.ids(st.st_gid), dir_fd=dfd, follow_symlinks=False)
            return
        if st.st_nlink > 1:
            first = self.links.get((st.st_dev, st.st_ino))
            if first is not None:
                os.link(first[1], name, src_dir_fd=first[0], dst_dir_fd=dfd, follow_symlinks=False)
                self.carried.files += 1
                return
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        try:
            _check_plain(src, rel)
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                left, offset = st.st_size, 0
                while left > 0:
                    n = os.sendfile(dst, src, offset, min(left, 1 << 30))
                    if n == 0:
                        break
                    offset += n
                    left -= n
                self.meta(st, name, dfd, dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        self.carried.files += 1
        self.carried.bytes += st.st_size
        if st.st_nlink > 1:
            keep = os.dup(dfd)
            self.fds.append(keep)
            self.links[(st.st_dev, st.st_ino)] = (keep, name)

    def tree(self, sfd: int, dfd: int, rel: str) -> None:
        for name in os.listdir(sfd):
            self.entry(sfd, dfd, name, f"{rel}/{name}" if rel else name)


def carry(upper: str | os.PathLike, target_root: int, keep: list[str], ids: Callable[[int], int]) -> Carried:
    """Replay the entries of ``upper`` beneath each path of ``keep`` (normalized, see
    ``normalize_paths``) into the root ``target_root`` (an fd: a sandbox's root as the host sees
    it); ``ids`` turns a host id of the source into one of the target. Blocks."""
    carried = Carried()
    copier = _Copier(ids, carried)
    try:
        for path in keep:
            parts = [p for p in path.split("/") if p]
            # Down to the kept path's parent in both trees; an opaque directory on the way in the
            # source means the image's content of the kept path is gone there too.
            sfd = os.open(upper, _DIR_FLAGS)
            dfd = _sys.openat2(target_root, "/", _DIR_FLAGS, 0, _sys.RESOLVE_IN_ROOT)
            try:
                replaced = False
                for i, part in enumerate(parts[:-1]):
                    try:
                        nsfd = os.open(part, _DIR_FLAGS, dir_fd=sfd)
                    except FileNotFoundError:
                        nsfd = -1
                    os.close(sfd)
                    sfd = nsfd
                    if sfd < 0:
                        break  # nothing changed beneath it
                    replaced = replaced or _opaque(sfd)
                    st = os.fstat(sfd)
                    ndfd = _open_dir(dfd, part, stat.S_IMODE(st.st_mode))
                    os.close(dfd)
                    dfd = ndfd
                    os.fchown(dfd, ids(st.st_uid), ids(st.st_gid))
                    os.fchmod(dfd, stat.S_IMODE(st.st_mode))
                if sfd < 0:
                    continue
                name = parts[-1]
                try:
                    os.stat(name, dir_fd=sfd, follow_symlinks=False)
                except FileNotFoundError:
                    if replaced:  # the image's copy is hidden in the source: hidden here too
                        _remove(dfd, name)
                    continue
                if replaced:
                    _remove(dfd, name)
                copier.entry(sfd, dfd, name, "/".join(parts))
            finally:
                if sfd >= 0:
                    os.close(sfd)
                os.close(dfd)
    finally:
        copier.close()
    return carried


# -- a layer of the kept paths (VMs: the upper arrives as a tar) ---------------------------------


def kept_layer(upper: str | os.PathLike, dest: str | os.PathLike, keep: list[str]) -> Carried:
    """Copy the entries of ``upper`` (an overlay upper on the host: whiteouts, opaque marks)
    beneath each kept path into the empty directory ``dest``, as a layer to stack on the
    image: whiteouts stay whiteouts, opaque directories stay opaque, and a kept path below an
    opaque directory becomes opaque itself (what the image had there was hidden, its
    neighbours were not kept). Residue is left out (``scrub``). Links are copied as links."""
    carried = Carried()
    upper, dest = os.fspath(upper), os.fspath(dest)

    def copy(src: str, dst: str, rel: str) -> None:
        if scrub.is_residue(rel):
            carried.scrubbed.append("/" + rel)
            return
        st = os.lstat(src)
        mode = st.st_mode
        if _is_whiteout(st):
            os.mknod(dst, stat.S_IFCHR | 0o000, 0)
        elif stat.S_ISDIR(mode):
            os.mkdir(dst, stat.S_IMODE(mode))
            fd = os.open(src, _DIR_FLAGS)
            try:
                if _opaque(fd):
                    os.setxattr(dst, _OPAQUE_XATTRS[0], b"y", follow_symlinks=False)
            finally:
                os.close(fd)
            for name in sorted(os.listdir(src)):
                copy(os.path.join(src, name), os.path.join(dst, name), f"{rel}/{name}")
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
            carried.files += 1
        elif stat.S_ISFIFO(mode):
            os.mkfifo(dst, stat.S_IMODE(mode))
        elif stat.S_ISREG(mode):
            with open(src, "rb") as fin, open(dst, "xb") as fout:
                left, offset = st.st_size, 0
                while left > 0:
                    n = os.sendfile(fout.fileno(), fin.fileno(), offset, min(left, 1 << 30))
                    if n == 0:
                        break
                    offset += n
                    left -= n
            carried.files += 1
            carried.bytes += st.st_size
        else:
            return  # sockets, devices
        os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
        if not stat.S_ISLNK(mode):
            os.chmod(dst, stat.S_IMODE(mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    for path in keep:
        parts = [p for p in path.split("/") if p]
        src, dst, replaced, found = upper, dest, False, True
        for part in parts[:-1]:
            src, dst = os.path.join(src, part), os.path.join(dst, part)
            try:
                st = os.lstat(src)
            except FileNotFoundError:
                found = False
                break
            if not stat.S_ISDIR(st.st_mode):
                found = False  # a link or a file where a directory was: nothing of it is kept
                break
            fd = os.open(src, _DIR_FLAGS)
            try:
                replaced = replaced or _opaque(fd)
            finally:
                os.close(fd)
            if not os.path.isdir(dst):
                os.mkdir(dst, stat.S_IMODE(st.st_mode))
                os.chown(dst, st.st_uid, st.st_gid)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        src, dst = os.path.join(src, parts[-1]), os.path.join(dst, parts[-1])
        if not found or not os.path.lexists(src) or os.path.lexists(dst):
            continue
        copy(src, dst, "/".join(parts))
        if replaced and os.path.isdir(dst) and not os.path.islink(dst):
            os.setxattr(dst, _OPAQUE_XATTRS[0], b"y", follow_symlinks=False)
    return carried
