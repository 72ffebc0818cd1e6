"""File trees in a sandbox, the same for every kind: each call is one command run in the
sandbox, as the sandbox's user, with only the usual tools (stat, readlink, rm, mkdir, mv, tar,
base64: busybox has them all).

Running inside is what keeps every path in the sandbox: ``/`` is the sandbox's root there, and
a symlink, wherever it points, points into the sandbox. Paths are still checked here first, so
that a mistake gets a clear error rather than a surprise: absolute, no NUL or newline, no
``..`` component.

Trees go as tar: ``download_tree`` streams ``tar c | base64`` out of the sandbox (links stay
links: tar does not follow them); ``upload_tree`` takes a tar, checks every member as Python's
``data`` extraction filter does (no absolute names, no ``..``, no device nodes or FIFOs, no link
pointing out of the tree: each refused naming the member), writes it into the sandbox in
base64 pieces and unpacks it there with the user's ownership (``tar -o``), modes kept.
"""

from __future__ import annotations

import io
import posixpath
import shlex
import stat as _stat
import tarfile

from libdsec import InvalidRequest, SandboxFileNotFound
from libdsec._tarcheck import TarChecker, check_member  # noqa: F401 - (TarChecker: the node's too)
from libdsec.protocol import ExecResult, FileEntry

_NOT_FOUND, _NOT_DIR, _NOT_EMPTY, _IS_DIR = 91, 92, 93, 94
UPLOAD_PIECE = 3 << 20  # raw bytes a command (4 MiB of base64)


def file_mode(text: str) -> int:
    """A file route's ``mode`` (``0o644``, or any base ``int(text, 0)`` reads), or
    ``InvalidRequest`` naming it."""
    try:
        return int(text, 0)
    except ValueError:
        raise InvalidRequest(f"invalid file mode {text!r}: use octal like 0o644") from None


def check_path(path: str, what: str = "path") -> str:
    """``path`` as the sandbox will see it, or ``InvalidRequest`` naming what is wrong."""
    if not path.startswith("/"):
        raise InvalidRequest(f"{what} must be absolute: {path!r}")
    if "\0" in path or "\n" in path:
        raise InvalidRequest(f"{what} {path!r} has a NUL byte or a newline")
    if ".." in path.split("/"):
        raise InvalidRequest(f"{what} {path!r} has a '..' component: give the path it means")
    return posixpath.normpath(path).replace("//", "/")


def _q(path: str) -> str:
    return shlex.quote(path)


# One entry: "HEXMODE SIZE MTIME UID GID" NUL name NUL link-target NUL.
_ENTRY = r'''s=$(stat -c '%f %s %Y %u %g' -- "$f") || continue
t=; [ -L "$f" ] && t=$(readlink -- "$f")
printf '%s\000%s\000%s\000' "$s" "$f" "$t"'''


def list_script(path: str) -> str:
    p = _q(path)
    return (f"[ -e {p} ] || exit {_NOT_FOUND}\n[ -d {p} ] || exit {_NOT_DIR}\ncd -- {p} || exit {_NOT_FOUND}\n"
            "for f in * .[!.]* ..?*; do\n[ -e \"$f\" ] || [ -L \"$f\" ] || continue\n" + _ENTRY + "\ndone\n")


def stat_script(path: str) -> str:
    p = _q(path)
    return f"f={p}\n[ -e \"$f\" ] || [ -L \"$f\" ] || exit {_NOT_FOUND}\n" + _ENTRY.replace("|| continue", "|| exit 1") + "\n"


def remove_script(path: str, recursive: bool) -> str:
    p = _q(path)
    body = (f"rm -rf -- {p}" if recursive else
            f"if [ -d {p} ] && [ ! -L {p} ]; then rmdir -- {p} 2>/dev/null || exit {_NOT_EMPTY}; else rm -f -- {p}; fi")
    return f"[ -e {p} ] || [ -L {p} ] || exit {_NOT_FOUND}\n{body}\n"


def make_dir_script(path: str) -> str:
    return f"mkdir -p -- {_q(path)} || exit {_NOT_DIR}\n"


def rename_script(src: str, dst: str) -> str:
    s, d = _q(src), _q(dst)
    return (f"[ -e {s} ] || [ -L {s} ] || exit {_NOT_FOUND}\n"
            f"[ -d {d} ] && [ ! -L {d} ] && exit {_IS_DIR}\nmv -f -- {s} {d}\n")


def download_script(path: str) -> str:
    p = _q(path)
    return f"[ -e {p} ] || exit {_NOT_FOUND}\n[ -d {p} ] || exit {_NOT_DIR}\ncd -- {p} && tar cf - . | base64\n"


def upload_piece_script(tmp: str, first: bool) -> str:
    return f"base64 -d {'>' if first else '>>'} {_q(tmp)}\n"


def unpack_script(tmp: str, path: str) -> str:
    t, p = _q(tmp), _q(path)
    return (f"mkdir -p -- {p} || {{ rm -f {t}; exit {_NOT_DIR}; }}\n"
            f"tar -x -o -f {t} -C {p}; rc=$?\nrm -f {t}\nexit $rc\n")


def check(result: ExecResult, what: str, path: str) -> ExecResult:
    problem = {_NOT_FOUND: "no such file or directory", _NOT_DIR: "not a directory (or cannot be made one)",
               _NOT_EMPTY: "a directory that is not empty (remove it with recursive=True)",
               _IS_DIR: "is a directory"}.get(result.exit_code)
    if result.exit_code == _NOT_FOUND:
        raise SandboxFileNotFound(f"cannot {what} {path}: {problem}")
    if problem is not None:
        detail = result.stderr.strip()[-300:]
        raise InvalidRequest(f"cannot {what} {path}: {problem}" + (f" ({detail})" if detail else ""))
    if result.exit_code != 0:
        detail = (result.stderr.strip() or result.stdout.strip())[-300:]
        raise InvalidRequest(f"cannot {what} {path}: {detail or f'exit code {result.exit_code}'}")
    return result


def parse_entries(text: str, parent: str | None) -> list[FileEntry]:
    fields = text.split("\0")
    entries = []
    for i in range(0, len(fields) - 2, 3):
        head, name, target = fields[i], fields[i + 1], fields[i + 2]
        try:
            mode_hex, size, mtime, uid, gid = head.split()
            mode = int(mode_hex, 16)
        except ValueError:
            continue
        kind = ("dir" if _stat.S_ISDIR(mode) else "file" if _stat.S_ISREG(mode)
                else "symlink" if _stat.S_ISLNK(mode) else "other")
        path = posixpath.join(parent, name) if parent is not None else name
        entries.append(FileEntry(name=posixpath.basename(path) or "/", path=path, type=kind, size=int(size),
                                 mode=_stat.S_IMODE(mode), mtime=float(mtime), uid=int(uid), gid=int(gid),
                                 target=target if kind == "symlink" else None))
    return sorted(entries, key=lambda e: e.name)


def checked_tar(data: bytes) -> None:
    """Refuse a tar with a member ``check_member`` refuses (``InvalidRequest``)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                check_member(member)
    except tarfile.TarError as exc:
        raise InvalidRequest(f"not a tar archive (uncompressed): {exc}") from None


def unpack_stdin_script(path: str) -> str:
    p = _q(path)
    return f"mkdir -p -- {p} || exit {_NOT_DIR}\ntar -x -o -f - -C {p}\n"


def download_tar_script(path: str) -> str:
    p = _q(path)
    return f"[ -e {p} ] || exit {_NOT_FOUND}\n[ -d {p} ] || exit {_NOT_DIR}\ncd -- {p} && tar cf - .\n"


def read_script(path: str) -> str:
    p = _q(path)
    return (f"[ -e {p} ] || exit {_NOT_FOUND}\n[ -d {p} ] && exit {_IS_DIR}\n"
            f"[ -f {p} ] || {{ echo 'not a regular file' >&2; exit 1; }}\nexec cat -- {p}\n")


def write_script(path: str, mode: int, uid: int, gid: int) -> str:
    """``cat`` from stdin into the file: made with the parents it lacks (owned by the user, as
    ``write_file`` does), a new file owned by the user, its mode set."""
    p, parent = _q(path), _q(posixpath.dirname(path) or "/")
    return (f"[ -d {p} ] && exit {_IS_DIR}\n"
            f"if [ ! -d {parent} ]; then mkdir -p -- {parent} || exit {_NOT_DIR}; chown {uid}:{gid} {parent}; fi\n"
            f"new=; [ -e {p} ] || new=1\n"
            f"cat > {p} || exit 1\nchmod {mode:o} {p} || exit 1\n"
            f"[ -z \"$new\" ] || chown {uid}:{gid} {p}\n")
