"""A layer applied by GNU tar (``images.untar``) gives the tree, so the layer digest, that the
Python way gives, and a tar that way must not take (escapes, links through links, devices,
whiteouts, names twice) goes the Python way, which refuses it as before; nothing is ever
written outside the layer's directory."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from dsec.images import untar
from dsec.images.sources import _settle_times, apply_layer
from dsec.images.store import LayerBuildError, tree_digest

from test_import_fuzz import layer_tar, members, snapshot

pytestmark = [pytest.mark.root]


def _both_ways(tmp_path: Path, data: bytes, tag: str = "") -> tuple[object, object, bool]:
    """The layer applied each way into an empty directory: (digest or error text) each, and
    whether the GNU tar way took it."""
    results = []
    taken = False
    for way in ("tar", "python"):
        dest = tmp_path / f"{tag}{way}"
        dest.mkdir()
        try:
            with io.BytesIO(data) as f:
                if way == "tar":
                    times = untar.apply(f, str(dest.resolve()))
                    taken = times is not None
                    if taken:
                        _settle_times(str(dest.resolve()), times)  # (as apply_layer does after it)
                    else:
                        assert list(dest.iterdir()) == [], "the GNU tar way left its work behind"
                        assert f.tell() == 0
                if way == "python" or not taken:
                    apply_layer(f, dest, gnu_tar=False)
            results.append((tree_digest(dest), oct(dest.stat().st_mode), dest.stat().st_uid))
        except LayerBuildError as exc:
            results.append(f"refused: {exc}".replace(str(dest.resolve()), "DEST"))
        finally:
            shutil.rmtree(dest)
    return results[0], results[1], taken


def _rich_tree(root: Path) -> None:
    """Files of many modes and owners, links of each kind, long names, empty and deep directories."""
    (root / "etc/sub/deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "big").write_bytes(os.urandom(3 << 20))
    (root / "setuid").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "setuid", 0o4755)
    (root / "owned").write_text("x")
    os.chown(root / "owned", 1234, 5678)
    os.chmod(root / "etc/sub", 0o2750)
    os.chown(root / "etc/sub", 0, 42)
    (root / "etc/sub/deeper/f").write_text("f")
    long_dir = root / ("d" * 120) / ("e" * 120)
    long_dir.mkdir(parents=True)
    (long_dir / ("f" * 150)).write_text("long")
    os.symlink("/etc/passwd", root / "abs-link")
    os.symlink("../etc/passwd", root / "empty/dotdot-link")
    os.symlink("etc/sub", root / "rel-link")
    os.lchown(root / "rel-link", 7, 8)
    os.link(root / "etc/passwd", root / "hard")
    os.link(root / "owned", root / "etc/hard-owned")
    for p in [root / "empty", root / "etc", root]:
        os.utime(p, (1_600_000_000, 1_600_000_000))
    os.utime(root / "big", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
@pytest.mark.parametrize("members_of", [".", "*"])
def test_gnu_tar_way_gives_the_python_ways_tree(tmp_path, fmt, members_of):
    """GNU tar's own archives (gnu and pax, fractional times in pax, a ``./`` member or not):
    taken, and the same digest, root mode and owner as the Python way, gzip or not."""
    src = tmp_path / "src"
    src.mkdir()
    _rich_tree(src)
    names = ["."] if members_of == "." else sorted(os.listdir(src))
    data = subprocess.run(["tar", f"--format={fmt}", "--numeric-owner", "-C", str(src), "-cf", "-", *names],
                          capture_output=True, check=True).stdout
    for label, blob in (("plain", data), ("gzip", gzip.compress(data, 1))):
        fast, python, taken = _both_ways(tmp_path, blob, label)
        assert taken, f"{label}: the GNU tar way did not take a plain archive"
        assert fast == python, label
        assert isinstance(fast, tuple)


@pytest.mark.slow
def test_hard_links_and_odd_headers_as_tarfile_sets_them(tmp_path):
    """A hard link whose header says another owner, mode and time than its file (tarfile applies
    them to the shared inode), a file's fractional pax time, a directory named after its files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        f = tarfile.TarInfo("a/b/file")
        f.size, f.mode, f.uid, f.gid, f.mtime = 3, 0o640, 11, 12, 1_700_000_000.25
        tar.addfile(f, io.BytesIO(b"abc"))
        link = tarfile.TarInfo("a/link")
        link.type, link.linkname, link.mode, link.uid, link.gid, link.mtime = \
            tarfile.LNKTYPE, "a/b/file", 0o600, 21, 22, 1_600_000_000
        tar.addfile(link)
        d = tarfile.TarInfo("a/b")
        d.type, d.mode, d.uid, d.mtime = tarfile.DIRTYPE, 0o711, 5, 1_500_000_000
        tar.addfile(d)
    fast, python, taken = _both_ways(tmp_path, buf.getvalue())
    assert taken and fast == python and isinstance(fast, tuple)


@pytest.mark.parametrize(
    "entries",
    [
        [("file", "../escape", "", 0, b"x")],
        [("file", "/abs", "", 0, b"x")],
        [("symlink", "lnk", "OUT", 0, b""), ("file", "lnk/passwd", "", 0, b"x")],
        [("symlink", "lnk", "../../../../etc", 0, b"")],
        [("hardlink", "h", "OUT/passwd", 0, b"")],
        [("hardlink", "h", "nothing", 0, b"")],
        [("symlink", "lnk", "OUT", 0, b""), ("hardlink", "h", "lnk/passwd", 0, b"")],
        [("symlink", "lnk", "OUT/passwd", 0, b""), ("hardlink", "h", "lnk", 0, b"")],
        [("chr", "dev", "", 1, b"")],
        [("fifo", "fifo", "", 0, b"")],
        [("file", "a", "", 0, b"1"), ("file", "a", "", 0, b"2")],
        [("file", "a", "", 0, b"1"), ("file", "a/b", "", 0, b"2")],
        [("file", "etc/.wh.gone", "", 0, b"")],
        [("dir", "d", "", 0, b""), ("file", "d/.wh..wh..opq", "", 0, b"")],
    ],
    ids=["dotdot", "absolute", "through-symlink", "symlink-out", "hardlink-out", "hardlink-to-nothing",
         "hardlink-through-symlink", "hardlink-to-symlink", "device", "fifo", "twice", "below-a-file", "whiteout", "opaque"],
)
def test_what_the_gnu_tar_way_does_not_take(tmp_path, tmp_path_factory, entries):
    """Each goes the Python way (which applies or refuses it as before), nothing is written
    outside, and both ways end alike. What the links aim at outside (``OUT``) is a decoy
    directory of the test's, never the host's own files: a regression writes there."""
    outside = tmp_path_factory.mktemp("outside")
    decoy = outside / "passwd"
    decoy.write_text("root:x:0:0::/root:/bin/sh\n")
    os.chmod(decoy, 0o644)
    entries = [(kind, name, target.replace("OUT", str(outside)), *rest) for kind, name, target, *rest in entries]
    before = decoy.stat()
    fast, python, taken = _both_ways(tmp_path, layer_tar(entries))
    assert not taken
    assert fast == python
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]
    after = decoy.stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino, after.st_mode, after.st_uid, after.st_nlink) == \
        (before.st_mtime_ns, before.st_size, before.st_ino, before.st_mode, before.st_uid, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("root_mode, taken", [(0o750, True), (0o2775, False)])
def test_a_root_member_owner_and_mode_as_the_python_way_leaves_them(tmp_path, root_mode, taken):
    """A ``./`` member: GNU tar sets the root's owner and mode, put back after it (the Python way
    passes it over); a setgid one goes the Python way (directories made below it would differ)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        root = tarfile.TarInfo("./")
        root.type, root.mode, root.uid, root.gid = tarfile.DIRTYPE, root_mode, 33, 44
        tar.addfile(root)
        f = tarfile.TarInfo("./a/b")
        f.size = 1
        tar.addfile(f, io.BytesIO(b"x"))
    fast, python, was_taken = _both_ways(tmp_path, buf.getvalue())
    assert was_taken == taken and fast == python and isinstance(fast, tuple)


@pytest.mark.slow
def test_both_ways_agree_on_hostile_layers(tmp_path):
    """Hypothesis over layers of escapes, links through links, devices and whiteouts (the import
    fuzz test's members): both ways refuse alike or give the same tree, and nothing outside moves."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not to be touched\n")
    (outside / "dir").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    before = snapshot(outside)
    taken_any = []

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(members(outside))
    def run(entries):
        fast, python, taken = _both_ways(work, layer_tar(entries))
        taken_any.append(taken)
        assert fast == python
        assert snapshot(outside) == before

    run()
    assert any(taken_any) and not all(taken_any), "the examples should go both ways"


def test_headers_read_as_tarfile_reads_them_or_not_at_all():
    """``tarheaders`` reads ustar, GNU and pax headers (long names, xattrs, fractional times)
    as ``tarfile`` does, and leaves what it is not sure of (a NUL in a pax path, a global
    header, a bad checksum) unread."""
    from dsec.images import tarheaders

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        f = tarfile.TarInfo("p/" + "x" * 200)
        f.size, f.mtime, f.uid, f.pax_headers = 2, 1_700_000_000.5, 3_000_000, {"SCHILY.xattr.user.a": "b"}
        tar.addfile(f, io.BytesIO(b"hi"))
        s = tarfile.TarInfo("s")
        s.type, s.linkname = tarfile.SYMTYPE, "/" + "t" * 150
        tar.addfile(s)
    for fmt in (tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT):
        buf.seek(0)
        with tarfile.open(fileobj=buf, mode="a", format=fmt) as tar:
            d = tarfile.TarInfo(f"d{fmt}/")
            d.type, d.mode = tarfile.DIRTYPE, 0o2755
            tar.addfile(d)
    data = buf.getvalue()
    theirs = [(m.name, m.type, m.mode, m.uid, m.gid, m.size, m.mtime, m.linkname)
              for m in tarfile.open(fileobj=io.BytesIO(data))]
    stream = io.BytesIO(data)
    ours = [(m.name, m.type, m.mode, m.uid, m.gid, m.size, m.mtime, m.linkname)
            for m, _ in tarheaders.members(stream.read, stream.seek)]
    assert ours == theirs and len(ours) == 4

    def unread(raw: bytes) -> None:
        s = io.BytesIO(raw)
        with pytest.raises(tarheaders.Unread):
            list(tarheaders.members(s.read, s.seek))

    unread(_with_pax(b"path", b"ab/..\x00x"))
    glob = io.BytesIO()
    with tarfile.open(fileobj=glob, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tar:
        tar.addfile(tarfile.TarInfo("f"))
    unread(glob.getvalue())
    bad = bytearray(layer_tar([("file", "f", "", 0, b"x")]))
    bad[0] ^= 1  # (the name changes, the checksum does not)
    unread(bytes(bad))


def _with_pax(key: bytes, value: bytes) -> bytes:
    """A one-member tar whose pax header sets ``key`` to ``value`` (bytes as they are)."""
    record = b" " + key + b"=" + value + b"\n"
    n = len(record) + 2  # (its own length in two digits)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        x = tarfile.TarInfo("././@PaxHeader")
        x.type, x.size = tarfile.XHDTYPE, n
        tar.addfile(x, io.BytesIO(str(n).encode() + record))
        tar.addfile(tarfile.TarInfo("f"))
    return buf.getvalue()


@pytest.mark.slow
def test_a_busybox_base_both_ways(tmp_path):
    """The busybox base (applets as links, /tmp 1777, a home owned by 1000) as ``dsec bench
    pulls`` serves it: GNU tar's archive of its mounted layer, gzip. Taken, the same tree."""
    from dsec import _sys
    from dsec.images.builders import build_busybox
    from dsec.images.store import LayerStore

    store = LayerStore(tmp_path / "store")
    image = build_busybox(store)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _sys.mount(str(store.layer_path(image.layers[0])), str(mnt), "erofs", _sys.MS_RDONLY)
    try:
        data = subprocess.run(["tar", "--numeric-owner", "--exclude=./dev/*", "-C", str(mnt), "-cf", "-", "."],
                              capture_output=True, check=True).stdout
    finally:
        _sys.umount(str(mnt))
    fast, python, taken = _both_ways(tmp_path, gzip.compress(data, 1))
    assert taken and fast == python and isinstance(fast, tuple)
