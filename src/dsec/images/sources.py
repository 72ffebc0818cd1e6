"""Layer sources beyond a plain directory or tar: OCI image archives (docker-archive and
oci-layout tarballs), git checkouts and directories as workspaces.

OCI layers mark deletions with ``.wh.NAME`` files and opaque directories with ``.wh..wh..opq``;
overlayfs marks them with 0:0 character devices and the ``trusted.overlay.opaque`` xattr. Layers
are converted as they are applied, so an imported image behaves in overlayfs exactly as its
layer stack says. Consecutive small layers are merged into one (deletions inside the merged
group are applied, and kept as markers for the layers below it).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import untar
from .inflate import Inflated, is_gzip
from .store import Image, LayerBuildError, LayerStore, _check_member

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
# Consecutive layers are merged while the group stays under this many (compressed) bytes.
DEFAULT_MERGE_BELOW = 64 << 20

Log = Callable[[str], None]


@dataclass(frozen=True)
class OciImage:
    layer_paths: list[str]  # members of the archive, bottom first
    env: dict[str, str]
    workdir: str
    user: str


def _read_json(tar: tarfile.TarFile, name: str) -> dict | list:
    try:
        member = tar.extractfile(name)
    except KeyError:
        member = None
    if member is None:
        raise LayerBuildError(f"image archive has no {name}")
    try:
        return json.loads(member.read())
    except json.JSONDecodeError as exc:
        raise LayerBuildError(f"image archive: {name} is not valid JSON: {exc}") from None


def _blob(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or not hexpart.isalnum():
        raise LayerBuildError(f"unsupported or malformed blob digest {digest!r}")
    return f"blobs/sha256/{hexpart}"


def read_oci_archive(tar: tarfile.TarFile) -> OciImage:
    """The layer list and config of a docker-archive or oci-layout tarball."""
    names = set(tar.getnames())
    if "manifest.json" in names:  # docker save / skopeo docker-archive
        manifests = _read_json(tar, "manifest.json")
        if not isinstance(manifests, list) or not manifests:
            raise LayerBuildError("image archive: manifest.json lists no image")
        manifest = manifests[0]
        layers = list(manifest.get("Layers", []))
        config = _read_json(tar, manifest["Config"]) if manifest.get("Config") else {}
    elif "index.json" in names:  # OCI image layout
        index = _read_json(tar, "index.json")
        entries = index.get("manifests", []) if isinstance(index, dict) else []
        if not entries:
            raise LayerBuildError("image archive: index.json lists no manifest")
        manifest = _read_json(tar, _blob(entries[0]["digest"]))
        if "manifests" in manifest:  # an index of indexes: take the first platform
            manifest = _read_json(tar, _blob(manifest["manifests"][0]["digest"]))
        layers = [_blob(layer["digest"]) for layer in manifest.get("layers", [])]
        config = _read_json(tar, _blob(manifest["config"]["digest"])) if manifest.get("config") else {}
    else:
        raise LayerBuildError("not an image archive: no manifest.json (docker-archive) or index.json (OCI layout)")
    if not layers:
        raise LayerBuildError("image archive has no layers")
    missing = [layer for layer in layers if layer not in names]
    if missing:
        raise LayerBuildError(f"image archive is missing layer {missing[0]}")
    cfg = config.get("config") or {} if isinstance(config, dict) else {}
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
    return OciImage(layer_paths=layers, env=env, workdir=cfg.get("WorkingDir") or "/", user=cfg.get("User") or "root")


def _no_symlink_on_path(dest: str, rel: str, known_dirs: set[str]) -> None:
    """Refuse to write through a symlink an earlier member (or layer) left in ``dest``.
    ``known_dirs``: directories under ``dest`` already found to be real ones (an ancestor of
    one is one too), so a layer of 10,000 files does not look at each directory again for each
    file; whoever removes or replaces a directory in the set clears it."""
    cur = dest
    for part in rel.split("/")[:-1]:
        cur = f"{cur}/{part}"
        if cur in known_dirs:
            continue
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            return  # nothing deeper exists yet, so no symlink is on the rest of the way
        if stat.S_ISLNK(mode):
            raise LayerBuildError(f"layer member {rel!r} would be written through a symlink")
        if stat.S_ISDIR(mode):
            known_dirs.add(cur)


def _no_symlink_to_link(dest: str, member: tarfile.TarInfo, known_dirs: set[str]) -> None:
    """Refuse a hard link whose target is reached through a symlink, or is one: ``os.link``
    follows both, and ``tarfile`` then sets the link's owner, mode and time on what it reached
    (a host file, through an absolute symlink an earlier member or layer left)."""
    target = os.path.normpath(member.linkname)
    try:
        _no_symlink_on_path(dest, target, known_dirs)
        through = os.path.islink(f"{dest}/{target}")
    except LayerBuildError:
        through = True
    if through:
        raise LayerBuildError(f"hard link {member.name!r} -> {member.linkname!r} goes through a symlink")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _whiteout(path: Path) -> None:
    _remove(path)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def apply_layer(fileobj, dest: Path, *, gnu_tar: bool = True) -> None:
    """Apply one OCI layer tar (plain or gzip) onto ``dest``, converting whiteouts. Into an
    empty directory, GNU tar writes the members (``untar``: the same tree, three times faster)
    unless ``gnu_tar`` is false or a member needs this function's own way."""
    dest = dest.resolve()
    root = str(dest)
    if gnu_tar and untar.usable(root):
        times = untar.apply(fileobj, root)
        if times is not None:
            _settle_times(root, times)
            return
    opaque: list[Path] = []
    known_dirs: set[str] = set()
    # Times that extracting disturbs (a directory's, by what goes into it; a symlink's and a
    # marker's, never set), put back at the end: the same layer gives the same tree, so the
    # same layer digest on any node and in any pull.
    times: dict[str, int] = {}
    try:
        # A gzip layer is inflated by a thread of its own (``dsec.images.inflate``).
        inflated = Inflated(fileobj) if is_gzip(fileobj) else None
        with inflated or contextlib.nullcontext(), \
                tarfile.open(fileobj=inflated or fileobj, mode="r:" if inflated else "r:*") as tar:
            for member in tar:
                name = os.path.normpath(member.name)
                if name in (".", "/"):
                    continue
                _check_member(member, dest)
                _no_symlink_on_path(root, name, known_dirs)
                if member.islnk():
                    _no_symlink_to_link(root, member, known_dirs)
                head, _, base = name.rpartition("/")
                if base == OPAQUE_MARKER or base.startswith(WHITEOUT_PREFIX):
                    known_dirs.clear()  # directories go: look again
                    parent = dest / head
                    if base == OPAQUE_MARKER:
                        parent.mkdir(parents=True, exist_ok=True)
                        for child in parent.iterdir():
                            _remove(child)
                        opaque.append(parent)
                        continue
                    target = base[len(WHITEOUT_PREFIX):]
                    if not target or target in (".", ".."):
                        raise LayerBuildError(f"layer has a malformed whiteout {member.name!r}")
                    parent.mkdir(parents=True, exist_ok=True)
                    _whiteout(parent / target)
                    times[str(parent / target)] = int(member.mtime)
                    continue
                path = f"{root}/{name}"
                try:
                    mode = os.lstat(path).st_mode
                except FileNotFoundError:
                    mode = None
                if mode is not None and not (member.isdir() and stat.S_ISDIR(mode)):
                    if path in known_dirs:
                        known_dirs.clear()
                    _remove(Path(path))
                member.name = name
                if member.isdir() or member.issym():
                    times[path] = int(member.mtime)
                try:
                    if member.type in _PLAIN_FILE and member.sparse is None:
                        _write_file(tar, member, path)
                    else:
                        tar.extract(member, dest, numeric_owner=True)
                except KeyError:  # (tarfile: a hard link whose target is neither written nor in the tar)
                    raise LayerBuildError(f"layer has a hard link {member.name!r} -> {member.linkname!r} to nothing "
                                          "in the layer") from None
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise LayerBuildError(f"cannot apply layer: {exc}") from exc
    for directory in opaque:
        os.setxattr(directory, OPAQUE_XATTR, b"y")
    _settle_times(root, times)


_PLAIN_FILE = (tarfile.REGTYPE, tarfile.AREGTYPE)
_COPY = 1 << 20


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
    """A regular file member written as ``tar.extract(member, numeric_owner=True)`` writes it:
    its parent made if missing, its bytes, then owner (as root), mode and time, a failure of any
    of those three passed over as ``tarfile`` passes it over. Through one descriptor, in 1 MiB
    writes: ``tarfile``'s way (a stat, 16 KiB copies, then three calls by path) was a third of
    applying a base of 10,000 files."""
    src = tar.fileobj
    src.seek(member.offset_data)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o666)
    try:
        left = member.size
        while left > 0:
            data = src.read(min(left, _COPY))
            if not data:
                raise tarfile.ReadError("unexpected end of data")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            left -= len(data)
        untar.set_like_tarfile(fd, member)
    finally:
        os.close(fd)


def _settle_times(root: str, times: dict[str, int]) -> None:
    """Each directory, symlink and marker the layer named gets its time from the layer, and a
    directory it did not name (made on the way to a member) the epoch; deepest first."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            times.setdefault(f"{dirpath}/{name}", 0)
    for path in sorted(times, key=lambda p: p.count("/"), reverse=True):
        ns = times[path] * 1_000_000_000
        try:
            os.utime(path, ns=(ns, ns), follow_symlinks=False)
        except FileNotFoundError:
            pass  # named, then removed by a later member


def import_oci(
    store: LayerStore, archive: Path, name: str, merge_below: int = DEFAULT_MERGE_BELOW, log: Log | None = None
) -> Image:
    """Import a docker-archive or oci-layout tarball as image ``name``."""
    archive = Path(archive)
    if not archive.is_file():
        raise LayerBuildError(f"no image archive at {archive}")
    try:
        tar = tarfile.open(archive)
    except (tarfile.TarError, OSError) as exc:
        raise LayerBuildError(f"cannot read image archive {archive}: {exc}") from exc
    with tar:
        try:
            oci = read_oci_archive(tar)
            groups = _merge_groups(tar, oci.layer_paths, merge_below)
        except (tarfile.TarError, EOFError, OSError, KeyError) as exc:
            raise LayerBuildError(f"cannot read image archive {archive}: {exc}") from exc
        digests: list[str] = []
        for i, group in enumerate(groups):
            if log:
                log(f"layer group {i + 1}/{len(groups)}: {len(group)} layer(s)")
            with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
                root = Path(work, "root")
                root.mkdir()
                for layer in group:
                    blob = tar.extractfile(layer)
                    if blob is None:
                        raise LayerBuildError(f"image archive: layer {layer} is not a file")
                    apply_layer(blob, root)
                if i == 0:
                    # Nothing lies below the bottom layer: its deletion markers would only show
                    # up as stray device files.
                    _drop_markers(root)
                digests.append(store.add_dir(root))
    return store.put_image(Image(name=name, layers=tuple(digests), env=oci.env, workdir=oci.workdir, user=oci.user))


def _drop_markers(root: Path) -> None:
    """Deletion markers (0:0 character devices) and opaque flags removed from the tree: below
    the bottom layer there is nothing for them to hide. By ``os.scandir``'s entry types, so
    only the entries that are neither files, directories nor symlinks are looked at (a base of
    12,000 entries has a handful). A directory a marker leaves keeps its times (the layer's):
    the same layer, the same digest, whenever it is converted."""
    todo = [os.fspath(root)]
    while todo:
        directory = todo.pop()
        times = None
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                    if OPAQUE_XATTR in os.listxattr(entry.path):
                        os.removexattr(entry.path, OPAQUE_XATTR)
                elif not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                        if times is None:
                            dst = os.stat(directory)
                            times = (dst.st_atime_ns, dst.st_mtime_ns)
                        os.unlink(entry.path)
        if times is not None:
            os.utime(directory, ns=times)


def _merge_groups(tar: tarfile.TarFile, layers: list[str], merge_below: int) -> list[list[str]]:
    groups: list[list[str]] = []
    size = 0
    for layer in layers:
        layer_size = tar.getmember(layer).size
        if groups and size + layer_size < merge_below:
            groups[-1].append(layer)
            size += layer_size
        else:
            groups.append([layer])
            size = layer_size
    return groups


def workspace_from_dir(store: LayerStore, source: Path, name: str, prefix: str = "/workspace", role: str = "workspace") -> Image:
    """A one-layer image holding ``source`` at ``prefix``, to stack on a base."""
    source = Path(source)
    if not source.is_dir():
        raise LayerBuildError(f"workspace source {source} is not a directory")
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        root = Path(work, "root")
        target = root / prefix.strip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        digest = store.add_dir(root)
    return store.put_image(Image(name=name, layers=(digest,), roles=(role,), workdir=prefix))


def workspace_from_git(store: LayerStore, repo: Path, name: str, ref: str = "HEAD", prefix: str = "/workspace") -> Image:
    """A one-layer image holding ``git archive REF`` of a local repository at ``prefix``."""
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        tar_path = Path(work, "tree.tar")
        proc = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", f"--prefix={prefix.strip('/')}/", ref, "-o", str(tar_path)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise LayerBuildError(f"git archive {ref} of {repo} failed: {proc.stderr.strip()[:500]}")
        digest = store.add_tar(tar_path)
    return store.put_image(Image(name=name, layers=(digest,), roles=("workspace",), workdir=prefix))
