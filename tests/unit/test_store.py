"""The layer store: content-addressed EROFS layers, safe tar extraction, image manifests."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from libdsec import BackendError, ImageNotFound, InvalidRequest
from dsec.images.store import Image, LayerBuildError, LayerStore, check_name, extract_tar, tree_digest

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


@pytest.fixture
def store(tmp_path) -> LayerStore:
    return LayerStore(tmp_path / "store")


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    for d in sorted({p for p in root.rglob("*") if p.is_dir()} | {root}, reverse=True):
        os.utime(d, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    return root


def _store_contents(store: LayerStore) -> tuple[list[str], list[str]]:
    return sorted(os.listdir(store.layers_dir)), sorted(os.listdir(store.tmp_dir))


def test_add_dir_is_content_addressed_and_idempotent(store, tmp_path):
    files = {"bin/tool": b"#!/bin/sh\necho hi\n", "etc/conf": b"x=1\n"}
    a = store.add_dir(_tree(tmp_path / "a", files))
    assert a.startswith("sha256-") and store.has_layer(a)
    layer = store.layer_path(a)
    first = layer.read_bytes()
    mtime = layer.stat().st_mtime_ns
    assert stat.S_IMODE(layer.stat().st_mode) == 0o444
    # The same content again, from the same or another place: the same digest, stored once.
    assert store.add_dir(tmp_path / "a") == a
    assert store.add_dir(_tree(tmp_path / "b", files)) == a
    assert layer.stat().st_mtime_ns == mtime
    assert store.layer_digests() == [a]
    assert _store_contents(store) == (sorted([layer.name, f"{a}.sums"]), [])  # (its sums: dsec.images.sums)
    # Different content: a different layer. The EROFS bytes are reproducible.
    c = store.add_dir(_tree(tmp_path / "c", {**files, "etc/conf": b"x=2\n"}))
    assert c != a and store.layer_digests() == sorted([a, c])
    # Removed and built again: the same name, and a complete EROFS image.
    store.remove_layer(a)
    again = store.add_dir(tmp_path / "a")
    assert again == a and len(store.layer_path(a).read_bytes()) == len(first)


def test_add_dir_says_when_its_source_is_read_before_the_layer_is_placed(store, tmp_path):
    """``read`` (a packed sandbox thawed there): once mkfs.erofs is done with the source, and
    before the layer and its sums are in the store; the source changed after it is not in it."""
    source = _tree(tmp_path / "a", {"etc/conf": b"x=1\n", "bin/tool": b"tool\n"})
    seen: list[tuple[list[str], list[str]]] = []

    def read() -> None:
        seen.append(_store_contents(store))
        (source / "etc/conf").write_bytes(b"changed after it was read\n")

    digest = store.add_dir(source, read=read)
    assert len(seen) == 1
    placed, building = seen[0]
    assert placed == [] and len(building) == 1 and building[0].endswith(".erofs")  # built, not placed
    assert store.has_layer(digest)
    # The layer holds the tree as it was read: the same digest as the original tree's.
    assert digest == store.add_dir(_tree(tmp_path / "b", {"etc/conf": b"x=1\n", "bin/tool": b"tool\n"}))
    # A layer the store has already: nothing read to the end, ``read`` not called.
    assert store.add_dir(tmp_path / "b", read=read) == digest and len(seen) == 1


def test_tree_digest_sees_content_mode_and_links(tmp_path):
    root = _tree(tmp_path / "t", {"f": b"1"})
    base = tree_digest(root)
    assert tree_digest(root) == base
    (root / "f").chmod(0o755)
    assert tree_digest(root) != base
    (root / "f").chmod(0o644)
    (root / "l").symlink_to("f")
    with_link = tree_digest(root)
    (root / "l").unlink()
    (root / "l").symlink_to("g")
    assert tree_digest(root) != with_link


@pytest.mark.root
def test_tree_digest_names_a_tree_as_layers_have_always_been_named(tmp_path):
    """A layer is found again by the digest of its tree: one tree of every kind of entry (a
    file read in more than one chunk, an empty one, a link, a whiteout, an opaque directory, a
    FIFO) names the digest the store gave it before its files were read through bare
    descriptors."""
    root = tmp_path / "t"
    (root / "d" / "o").mkdir(parents=True)
    (root / "d" / "big").write_bytes(bytes(range(256)) * 5000)  # 1.2 MiB: two reads of 1 MiB at most
    (root / "d" / "empty").write_bytes(b"")
    (root / "f").write_bytes(b"one\n")
    (root / "d" / "link").symlink_to("../f")
    os.mknod(root / "d" / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    os.mkfifo(root / "d" / "fifo", 0o600)
    os.setxattr(root / "d" / "o", "trusted.overlay.opaque", b"y")
    for path in sorted([*root.rglob("*"), root], reverse=True):
        os.lchown(path, 0, 0)
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000), follow_symlinks=False)
    assert tree_digest(root) == "sha256-fff67fc3a4cf274715063669fdbae18cbb9ba0c2ca890fb2c0c8fc61964c3888"


def test_add_dir_rejects_a_non_directory(store, tmp_path):
    (tmp_path / "file").write_text("x")
    for source in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(LayerBuildError, match="not a directory"):
            store.add_dir(source)
    assert _store_contents(store) == ([], [])


def test_failed_mkfs_leaves_no_half_written_layer(store, tmp_path, monkeypatch):
    """A mkfs.erofs that writes part of its output and dies: nothing may reach the store."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake = fake_bin / "mkfs.erofs"
    # Arguments are: --quiet -U<uuid> --preserve-mtime OUTPUT SOURCE
    fake.write_text('#!/bin/sh\nprintf "half a layer" > "$4"\necho "mkfs.erofs: disk full" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    with pytest.raises(LayerBuildError, match="disk full"):
        store.add_dir(_tree(tmp_path / "src", {"a": b"a"}))
    assert _store_contents(store) == ([], [])


# -- tar archives ---------------------------------------------------------------------------


def _member(name: str, kind: str = "file", data: bytes = b"", link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.mtime = 1_700_000_000
    if kind == "file":
        info.size = len(data)
        return info, data
    info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                 "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
    info.linkname = link
    if kind == "dir":
        info.mode = 0o755
    if kind in ("chr", "blk"):
        info.devmajor, info.devminor = (1, 3) if link == "" else map(int, link.split(":"))
        info.linkname = ""
    return info, None


def _tar(path: Path, members: list, compress: str = "") -> Path:
    with tarfile.open(path, f"w:{compress}") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.fixture
def victim(tmp_path) -> Path:
    """A host file outside every extraction root; no archive may touch it."""
    path = tmp_path / "host" / "victim"
    path.parent.mkdir(mode=0o700)
    path.write_text("original\n")
    return path


def _escaping_archives(victim: Path) -> dict[str, list]:
    outside = str(victim)
    return {
        "absolute path": [_member("/etc/dsec-test-escape", data=b"x")],
        "dot-dot": [_member("../escape", data=b"x")],
        "dot-dot inside": [_member("a/", "dir"), _member("a/../../escape", data=b"x")],
        "relative symlink out": [_member("link", "sym", link="../../../../../../etc")],
        "nested relative symlink out": [_member("d", "dir"), _member("d/link", "sym", link="../../x")],
        "absolute hard link": [_member("h", "hard", link=outside)],
        "dot-dot hard link": [_member("h", "hard", link="../host/victim")],
        "write through a symlink": [_member("sub", "dir"), _member("link", "sym", link="sub"),
                                    _member("link/f", data=b"x")],
        "write through an absolute symlink": [_member("etc", "sym", link=str(victim.parent)),
                                              _member("etc/victim", data=b"pwned\n")],
        "file over an absolute symlink": [_member("evil", "sym", link=outside), _member("evil", data=b"pwned\n")],
        "hard link to a symlink, then a file over it": [
            _member("s", "sym", link=outside), _member("h", "hard", link="s"), _member("h", data=b"pwned\n")],
        "hard link through a symlinked directory": [
            _member("l", "sym", link=str(victim.parent)), _member("h", "hard", link="l/victim")],
        "directory over a symlink": [_member("d", "sym", link=str(victim.parent)), _member("d", "dir")],
        "device node": [_member("dev/mem", "chr", link="1:1")],
        "block device": [_member("dev/sda", "blk", link="8:0")],
    }


@pytest.mark.parametrize("case", list(_escaping_archives(Path("/x"))))
def test_extract_tar_refuses_escapes(tmp_path, victim, case):
    archive = _tar(tmp_path / "a.tar", _escaping_archives(victim)[case])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(LayerBuildError):
        extract_tar(archive, dest)
    assert victim.read_text() == "original\n" and victim.stat().st_nlink == 1
    assert sorted(os.listdir(victim.parent)) == ["victim"]
    assert stat.S_IMODE(victim.parent.stat().st_mode) == 0o700
    assert not Path("/etc/dsec-test-escape").exists() and not (tmp_path / "escape").exists()


def test_extract_tar_keeps_whiteouts_and_fifos(tmp_path):
    archive = _tar(tmp_path / "a.tar", [_member("gone", "chr", link="0:0"), _member("pipe", "fifo")])
    dest = tmp_path / "dest"
    dest.mkdir()
    extract_tar(archive, dest)
    assert stat.S_ISCHR((dest / "gone").lstat().st_mode) and (dest / "gone").lstat().st_rdev == 0
    assert stat.S_ISFIFO((dest / "pipe").lstat().st_mode)


def test_add_tar_refuses_escapes_and_leaves_nothing(store, tmp_path, victim):
    for case, members in _escaping_archives(victim).items():
        archive = _tar(tmp_path / "a.tar", members)
        with pytest.raises(LayerBuildError):
            store.add_tar(archive)
        assert _store_contents(store) == ([], []), case
        assert victim.read_text() == "original\n", case


def test_extract_tar_accepts_a_normal_rootfs(store, tmp_path):
    members = [
        _member("bin", "dir"), _member("bin/busybox", data=b"\x7fELF..."),
        _member("bin/sh", "sym", link="/bin/busybox"),       # absolute: resolves inside the sandbox
        _member("usr/bin/env", "sym", link="../../bin/busybox"),
        _member("bin/ls", "hard", link="bin/busybox"),
        _member("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\n"),
        _member("etc/.wh.removed", "chr", link="0:0"),        # an overlay whiteout
    ]
    archive = _tar(tmp_path / "root.tar.gz", members, compress="gz")
    dest = tmp_path / "dest"
    dest.mkdir()
    extract_tar(archive, dest)
    assert os.readlink(dest / "bin/sh") == "/bin/busybox"
    assert (dest / "bin/ls").read_bytes() == b"\x7fELF..."
    digest = store.add_tar(archive)
    assert store.has_layer(digest) and store.add_tar(archive) == digest
    assert _store_contents(store)[1] == []


@pytest.mark.parametrize("corruption", ["garbage", "truncated", "truncated gzip", "empty"])
def test_corrupt_tar_is_a_layer_build_error_and_leaves_nothing(store, tmp_path, corruption):
    big = os.urandom(300_000)
    good = _tar(tmp_path / "good.tar", [_member("a", data=big), _member("b", data=b"b" * 10_000)])
    bad = tmp_path / "bad.tar"
    if corruption == "garbage":
        bad.write_bytes(os.urandom(4096))
    elif corruption == "truncated":
        bad.write_bytes(good.read_bytes()[:150_000])
    elif corruption == "truncated gzip":
        bad.write_bytes(gzip.compress(good.read_bytes())[:100_000])
    else:
        bad.write_bytes(b"")
    before = _store_contents(store)
    with pytest.raises(LayerBuildError, match="bad.tar"):
        store.add_tar(bad)
    assert _store_contents(store) == before == ([], [])
    with pytest.raises(LayerBuildError):
        store.add_tar(tmp_path / "missing.tar")


# -- images ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["busybox", "python", "a", "my-image_2.0", "x" * 128, "0day"])
def test_valid_image_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "Busybox", "-x", ".hidden", "_x", "a/b", "../etc", "a b", "x" * 129,
                                  "name\n", "a:latest", "ünï"])
def test_invalid_image_names(store, tmp_path, name):
    with pytest.raises(InvalidRequest, match="invalid image name"):
        check_name(name)
    digest = store.add_dir(_tree(tmp_path / "src", {"f": b"1"}))
    with pytest.raises(InvalidRequest, match="invalid image name"):
        store.put_image(Image(name=name, layers=(digest,)))
    with pytest.raises(ImageNotFound):
        store.get_image(name)
    assert not store.has_image(name)
    assert store.image_names() == []


def test_images_round_trip(store, tmp_path):
    digest = store.add_dir(_tree(tmp_path / "src", {"f": b"1"}))
    image = Image(name="tool", layers=(digest,), env={"PATH": "/bin"}, workdir="/w", user="agent")
    store.put_image(image)
    assert store.get_image("tool") == image
    assert store.image_names() == ["tool"] and store.has_image("tool")
    assert store.image_size(image) == store.layer_size(digest)
    assert store.unreferenced_layers() == []
    with pytest.raises(ImageNotFound, match="unknown image 'toll'; known: tool"):
        store.get_image("toll")
    with pytest.raises(InvalidRequest, match="missing layer"):
        store.put_image(Image(name="broken", layers=("sha256-" + "0" * 64,)))
    with pytest.raises(InvalidRequest, match="no layers"):
        store.put_image(Image(name="empty", layers=()))
    store.remove_image("tool")
    assert store.image_names() == [] and store.unreferenced_layers() == [digest]
    with pytest.raises(ImageNotFound):
        store.remove_image("tool")
    assert _store_contents(store)[1] == []


def test_a_store_behind_a_link_to_nothing_yet_is_made(tmp_path):
    """A node's ``store`` link to a shared store not made yet (a first start; ``dsec reset``
    of such a node): the store is made where the link points."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "store").symlink_to(tmp_path / "shared" / "store")
    store = LayerStore(tmp_path / "state" / "store")
    assert (tmp_path / "shared" / "store" / "layers").is_dir() and store.image_names() == []


def test_link_store_makes_the_store_and_points_an_old_link_at_the_new_one(tmp_path):
    from dsec.node import link_store

    state = tmp_path / "node"
    state.mkdir()
    link_store(state, tmp_path / "first")  # missing: made, then linked
    assert (tmp_path / "first").is_dir() and (state / "store").resolve() == (tmp_path / "first").resolve()
    link_store(state, tmp_path / "second")  # an earlier start's link is pointed at this store
    assert (state / "store").resolve() == (tmp_path / "second").resolve()
    link_store(state, tmp_path / "second")  # and left alone when it is right
    own = tmp_path / "own"
    (own / "store").mkdir(parents=True)  # a state dir whose store is a directory of its own
    link_store(own, own / "store")
    with pytest.raises(BackendError, match="is a directory of its own"):
        link_store(own, tmp_path / "elsewhere")
