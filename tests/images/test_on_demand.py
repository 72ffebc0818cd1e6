"""Layers are read where they lie, on demand: a sandbox that reads one file of a large layer
brings only a small part of the layer file into memory from disk."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from dsec.images import loopdev
from dsec.images.store import Image, LayerStore
from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

FILES, FILE_MB = 16, 4


def resident_bytes(path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def layer_bytes_read(layer: Path) -> int:
    """What reading a mounted layer brought in: its file's pages in the page cache, or, with the
    layer on a loop device (DSEC_LAYER_ATTACH=loop; direct I/O passes the file's page cache by),
    the bytes that device has read since it was attached."""
    devices = [n for n, p in loopdev.backed_by(layer.parent).items() if p == str(layer.resolve())]
    if not devices:
        return resident_bytes(layer)
    return sum(int(Path(f"/sys/block/{n}/stat").read_text().split()[2]) * 512 for n in devices)


@pytest.fixture
def big_image(server, tmp_path):
    """A 64 MiB layer of incompressible files, the same bytes every run (stored once)."""
    store = LayerStore(server.state_dir / "store")
    root = tmp_path / "big"
    (root / "big").mkdir(parents=True)
    rng = random.Random(1234)
    for i in range(FILES):
        (root / "big" / f"f{i:02d}").write_bytes(rng.randbytes(FILE_MB << 20))
        os.utime(root / "big" / f"f{i:02d}", (1_700_000_000, 1_700_000_000))
    os.utime(root / "big", (1_700_000_000, 1_700_000_000))
    os.utime(root, (1_700_000_000, 1_700_000_000))
    base = store.get_image("busybox")
    digest = store.add_dir(root)
    image = store.put_image(Image(name="on-demand-test", layers=base.layers + (digest,),
                                  roles=("base", "workspace"), env=base.env))
    yield store.layer_path(digest)
    store.remove_image(image.name)


async def test_reading_one_file_reads_a_small_fraction(client, big_image):
    size = big_image.stat().st_size
    fd = os.open(big_image, os.O_RDONLY)
    try:
        os.fsync(fd)  # a freshly built layer's pages are dirty, and those are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_bytes(big_image) < size // 100
    async with await client.run_container(DSecContainerRunArgs(container_image="on-demand-test")) as sandbox:
        result = await sandbox.run_shell("md5sum /big/f07 | cut -c1-8; ls /big | wc -l")
        assert result.exit_code == 0 and result.stdout.split()[1] == str(FILES)
        read = layer_bytes_read(big_image)
    # One 4 MiB file of 64 MiB, plus metadata and readahead.
    assert read < size // 4, f"{read} of {size} bytes of the layer were read"
    assert read >= (FILE_MB << 20) * 0.9
