"""``dsec bench images``: the generated layers are what mkfs.erofs writes for their trees, and
the benchmark runs end to end at its quick size, measuring both stores and leaving nothing."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from rich.console import Console

from dsec.images.store import LayerStore, tree_digest
from dsec_bench import images

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")

# The superblock's checksum and build time (seconds, nanoseconds) differ from build to build.
_VARYING = set(range(1028, 1032)) | set(range(1048, 1060))


def test_a_generated_layer_is_what_mkfs_writes(tmp_path: Path) -> None:
    store, real = LayerStore(tmp_path / "gen"), LayerStore(tmp_path / "real")
    maker = images.LayerMaker(store, "workspace", tmp_path / "scratch")
    assert maker.checked  # this mkfs.erofs checksums its superblock, and the patch keeps it right
    for n in (1, 12345, 9_999_999_999_999_999):
        digest = maker.make(n)
        data = store.layer_path(digest).read_bytes()
        assert digest == tree_digest(maker.src)
        made = real.layer_path(real.add_dir(maker.src)).read_bytes()
        assert len(made) == len(data) and real.has_layer(digest)
        assert [i for i in range(len(data)) if data[i] != made[i] and i not in _VARYING] == []
        sb = bytearray(data[1024:4096])
        sb[4:8] = bytes(4)
        assert images.crc32c(bytes(sb)) == struct.unpack_from("<I", data, 1028)[0]
        assert f"{n:016d}".encode() in data
    assert maker.make(12345) == tree_digest(maker.src)  # made once; the second is the first
    assert store.index.stats().stored_layers == 4  # the template and three


@pytest.mark.slow
@pytest.mark.root
def test_images_bench_at_a_small_size(tmp_path: Path) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "bench"
    code = images.main(state, console, bases=200, workspaces=2_000, creates=10, warmup=2, repeat=3)
    res = json.loads((state / images.RESULTS_FILE).read_text())
    assert code == 0 and res["errors"] == [] and res["leftovers"] == [], res
    for label in ("small", "big"):
        c = res["creates"][label]
        assert c["n"] == 10 and 0 < c["p50_ms"] <= c["p99_ms"], c
        for op in ("ls_page", "ls_filtered", "inspect", "gc", "stats", "build"):
            assert res["timings"][label][op]["median_ms"] > 0
        assert res["concurrent_builds"][label]["n"] > 0 and res["concurrent_builds"][label]["median_ms"] > 0
    st = res["timings"]["big"]["store"]
    assert st["images"] == 1 + 200 + 2_000 == st["distinct_layers"] == st["stored_layers"]
    assert st["referenced_bytes"] > 10 * st["stored_bytes"]  # every image refers to busybox's layer
    assert set(res["ratio"]) == {"p50", "p99"} and isinstance(res["goal_met"], bool)
    assert sorted(os.listdir(state)) == [images.RESULTS_FILE]  # the stores and servers' dirs are gone
