"""Hypothesis over image import: docker and OCI archives whose layers hold ``..``, absolute
paths, symlinks and hard links out of the root or through links, device nodes, whiteouts, and
archives whose bytes are cut or overwritten (malformed or huge headers). Each import either
makes an image or is refused with ``LayerBuildError``; nothing else is raised, and nothing is
written outside the store (a sentinel tree beside it and the files links point at stay as they
were)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec.images.sources import import_oci
from dsec.images.store import LayerBuildError, LayerStore

from test_sources import docker_archive, oci_layout

pytestmark = [pytest.mark.slow, pytest.mark.root]

SEGMENTS = st.sampled_from(["a", "b", "etc", "..", ".", "", "x" * 120, ".wh.a", ".wh..wh..opq", ".wh..", "lnk"])
NAMES = st.builds(lambda lead, parts: lead + "/".join(parts), st.sampled_from(["", "/", "./", "../"]),
                  st.lists(SEGMENTS, min_size=1, max_size=4))


def targets(outside: Path) -> st.SearchStrategy[str]:
    # (What the links aim at outside is the test's decoy, never the host's own files; ``lnk/secret``
    # is the decoy's file reached through a symlink ``lnk`` to it, as a hard link's target.)
    return st.one_of(NAMES, st.sampled_from([str(outside / "secret"), str(outside), "../" * 6 + "outside/secret",
                                            "lnk", "lnk/x", "lnk/secret", "a/../../..", "."]))


def members(outside: Path) -> st.SearchStrategy[list[tuple]]:
    kind = st.sampled_from(["file", "dir", "symlink", "hardlink", "chr", "blk", "fifo"])
    return st.lists(st.tuples(kind, NAMES, targets(outside), st.integers(0, 3), st.binary(max_size=64)),
                    min_size=1, max_size=8)


def layer_tar(entries: list[tuple]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for kind, name, target, dev, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "file":
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                         "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            info.mode = 0o755 if kind == "dir" else 0o644
            info.linkname = target if kind in ("symlink", "hardlink") else ""
            info.devmajor, info.devminor = (dev, dev) if kind in ("chr", "blk") else (0, 0)
            tar.addfile(info)
    return buf.getvalue()


def snapshot(root: Path) -> dict[str, tuple]:
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st_ = p.lstat()
            found[str(p)] = (st_.st_mode, st_.st_size, st_.st_nlink,
                             hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else "")
    return found


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    base = tmp_path_factory.mktemp("import-fuzz")
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not to be touched\n")
    (outside / "dir").mkdir()
    return base, outside


def check_import(base: Path, outside: Path, archive_bytes: bytes, n: list[int]) -> None:
    n[0] += 1
    work = base / f"case{n[0]}"
    work.mkdir()
    store = LayerStore(work / "store")
    archive = work / "img.tar"
    archive.write_bytes(archive_bytes)
    before = snapshot(outside)
    etc_passwd = Path("/etc/passwd").stat()
    try:
        image = import_oci(store, archive, "fuzzed")
    except LayerBuildError as exc:
        assert str(exc), "a refusal says why"
        assert store.image_names() == []
    else:
        assert image.layers and store.image_names() == ["fuzzed"]
    assert snapshot(outside) == before, "something was written outside the store"
    assert Path("/etc/passwd").stat().st_mtime == etc_passwd.st_mtime
    assert {p.name for p in work.iterdir()} <= {"store", "img.tar"}, list(work.iterdir())
    assert list(store.tmp_dir.iterdir()) == [], "a half-made layer was left"
    # The import's own working files: nothing outside base but what the store holds.
    import shutil

    shutil.rmtree(work)


_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_layers_with_escapes_links_and_devices(place):
    base, outside = place
    n = [0]

    @_SETTINGS
    @given(st.lists(members(outside), min_size=1, max_size=3), st.sampled_from([docker_archive, oci_layout]))
    def run(layers, maker):
        path = base / "build.tar"
        maker(path, [layer_tar(entries) for entries in layers])
        check_import(base, outside, path.read_bytes(), n)

    run()


def test_malformed_archives_are_refused_cleanly(place):
    base, outside = place
    good_path = base / "good.tar"
    docker_archive(good_path, [layer_tar([("file", "etc/a", "", 0, b"hello"), ("dir", "bin", "", 0, b"")])])
    good = good_path.read_bytes()
    n = [0]

    @_SETTINGS
    @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.binary(min_size=1, max_size=16)), max_size=6),
           st.integers(0, len(good)))
    def run(patches, cut):
        data = bytearray(good[:max(cut, 1)])
        for at, chunk in patches:
            data[at:at + len(chunk)] = chunk
        check_import(base, outside, bytes(data[:max(cut, 1)]), n)

    run()


def test_huge_header_fields_are_refused_cleanly(place):
    base, outside = place
    n = [0]
    for size in (10**12, 2**63 - 1):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("etc/huge")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"abcd"))
        raw = bytearray(buf.getvalue())
        # The header's size field (octal, 12 bytes at 124) says far more than follows.
        raw[124:136] = f"{size:011o}".encode()[-11:].rjust(11, b"0") + b"\0"
        raw[148:156] = b"        "
        raw[148:156] = f"{sum(raw[:512]):06o}\0 ".encode()
        path = base / "huge.tar"
        docker_archive(path, [bytes(raw)])
        check_import(base, outside, path.read_bytes(), n)
    long_name = layer_tar([("file", "d/" * 2000 + "f", "", 0, b"x")])
    path = base / "long.tar"
    docker_archive(path, [long_name])
    check_import(base, outside, path.read_bytes(), n)
