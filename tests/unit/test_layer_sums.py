"""A layer's chunk sums, taken by the store as it places the layer (dsec.images.sums): a file
changed or cut short on the store, or a damaged sums file, is named by ``verify`` and by
``dsec image verify``; GC takes the sums with the layer. (Refused at mount and by the layer
cache: tests/images/test_layer_cache.py.)"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import pytest
from damage import flip
from typer.testing import CliRunner

from libdsec import BackendError, InvalidRequest
from dsec.images import sums
from dsec.images.store import Image, LayerStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


@pytest.fixture
def store(tmp_path) -> LayerStore:
    return LayerStore(tmp_path / "store")


def _layer(store: LayerStore, tmp: Path, seed: int, files: int = 4) -> str:
    root = tmp / f"src-{seed}"
    root.mkdir()
    rng = random.Random(seed)
    for i in range(files):
        (root / f"f{i}").write_bytes(rng.randbytes(200_000))
    return store.add_dir(root)


def test_sums_are_taken_as_a_layer_is_placed(store, tmp_path):
    digest = _layer(store, tmp_path, 1)
    path = store.layer_path(digest)
    found = sums.load(path)
    size = path.stat().st_size
    assert found is not None and found.size == size and found.chunk == sums.CHUNK
    assert len(found.shas) == -(-size // sums.CHUNK)
    data = path.read_bytes()
    assert all(found.chunk_ok(i, data[i * sums.CHUNK:(i + 1) * sums.CHUNK]) for i in range(len(found.shas)))
    assert not found.chunk_ok(len(found.shas), b"")
    assert store.verify_layer(digest) == []
    assert sorted(p.name for p in store.layers_dir.iterdir()) == sorted([path.name, f"{digest}.sums"])
    assert not list(store.tmp_dir.iterdir())  # nothing left behind
    assert store.add_dir(tmp_path / "src-1") == digest  # (placed once)


def test_a_layer_made_once_is_named_by_its_file_and_placed_with_its_sums(store, tmp_path):
    """A fork's layer (``once``): named by its file's sums, not its tree; nothing left behind."""
    tree = _layer(store, tmp_path, 7)
    digest = store.add_dir(tmp_path / "src-7", once=True)
    path = store.layer_path(digest)
    taken = sums.take(path)
    assert digest == sums.file_digest(taken) != tree
    assert re.fullmatch(r"sha256-[0-9a-f]{64}", digest)  # a store's name (the layer cache's too)
    assert sums.path_of(path).read_bytes() == taken and store.verify_layer(digest) == []
    assert not list(store.tmp_dir.iterdir())
    # Made again from the same tree: a layer of its own (mkfs.erofs stamps its build time),
    # each placed whole.
    again = store.add_dir(tmp_path / "src-7", once=True)
    assert store.verify_layer(again) == [] and store.layer_size(again) == store.layer_size(digest)


def test_damage_on_the_store_is_named(store, tmp_path):
    digest = _layer(store, tmp_path, 2)
    path = store.layer_path(digest)
    flip(path, 3 * sums.CHUNK + 17)
    [problem] = store.verify_layer(digest)
    assert problem.startswith(f"layer {digest}: 1 chunk(s) do not match their sums: 3 (bytes {3 * sums.CHUNK}-")
    flip(path, 3 * sums.CHUNK + 17)  # put back
    assert store.verify_layer(digest) == []
    size = path.stat().st_size
    os.truncate(path, size - 5000)
    problems = store.verify_layer(digest)
    assert problems[0] == f"layer {digest}: its file has {size - 5000} bytes, its sums were taken over {size} (cut short)"
    assert "do not match" in problems[1]  # (the last chunk, now short)
    # What a VM's layers go through (their files given to QEMU, or made into DAX variants).
    with pytest.raises(BackendError, match=f"layer {digest}: its file has .* \\(cut short\\): refused, not mounted"):
        store.check_layer(digest)
    with pytest.raises(BackendError, match="cut short"):
        store.dax_layer(digest)
    with pytest.raises(InvalidRequest, match="no layer sha256-0"):
        store.check_layer("sha256-" + "0" * 64)
    # The sums file itself damaged: named as such.
    other = _layer(store, tmp_path, 3)
    flip(sums.path_of(store.layer_path(other)), 40)
    assert store.verify_layer(other) == [f"layer {other}: its sums file {other}.sums is damaged: "
                                         "its own sha256 does not match (cut short or altered)"]
    with pytest.raises(sums.SumsDamaged):
        sums.parse(b"DSECSUM1" + bytes(40))


def test_a_layer_without_sums_is_taken_as_it_is_and_gc_takes_the_sums(store, tmp_path):
    old, kept = _layer(store, tmp_path, 4), _layer(store, tmp_path, 5)
    sums.path_of(store.layer_path(old)).unlink()  # placed before the store kept sums
    assert store.verify_layer(old) == [] and sums.load(store.layer_path(old)) is None
    store.put_image(Image(name="kept", layers=(kept,)))
    assert store.gc() == [old]
    assert sorted(p.name for p in store.layers_dir.iterdir()) == sorted([f"{kept}.erofs", f"{kept}.sums"])
    store.remove_image("kept")
    assert store.gc() == [kept] and not list(store.layers_dir.iterdir())
    assert store.index.stats().stored_layers == 0  # (the sums are no layer to the index)


@pytest.mark.root
def test_a_dax_variant_has_sums_of_its_own_checked_before_a_vm_maps_it(store, tmp_path):
    """The layer cache serves a layer's DAX variant to microVMs and checks its chunks against
    these; one cut short on the store is refused before QEMU maps it; GC takes them along."""
    digest = _layer(store, tmp_path, 6)
    dax = store.dax_layer(digest)
    found = sums.load(dax)
    assert sums.path_of(dax).name == f"{digest}.dax.sums" and found.size == dax.stat().st_size
    assert sums.load(store.layer_path(digest)).size == store.layer_size(digest)  # (the layer's own, apart)
    assert store.dax_layer(digest) == dax
    os.chmod(dax, 0o644)
    os.truncate(dax, dax.stat().st_size - sums.CHUNK)
    with pytest.raises(BackendError, match=f"{digest}.dax: its file has .* \\(cut short\\).*next microVM"):
        store.dax_layer(digest)
    assert store.gc() == [digest] and not list(store.layers_dir.iterdir())


def test_dsec_image_verify(store, tmp_path):
    from dsec.cli import app

    a, b = _layer(store, tmp_path, 6), _layer(store, tmp_path, 7)
    store.put_image(Image(name="one", layers=(a,)))
    store.put_image(Image(name="two", layers=(a, b)))
    state = ["--state-dir", str(tmp_path)]  # the store is STATE_DIR/store

    def verify(*args: str):
        return CliRunner().invoke(app, ["image", "verify", *args, *state], env={"COLUMNS": "300"})

    result = verify()
    assert result.exit_code == 0 and "2 layer(s) intact" in result.output, result.output
    flip(store.layer_path(b), 100)
    assert verify("one").exit_code == 0  # (only a's layer)
    result = verify("two")
    assert result.exit_code == 1, result.output
    assert f"layer {b}: 1 chunk(s) do not match their sums: 0 (bytes 0-" in result.output
    assert "1 problem(s) in 2 layer(s)" in result.output
    sums.path_of(store.layer_path(a)).unlink()
    flip(store.layer_path(b), 100)
    result = verify()
    assert result.exit_code == 0 and "1 layer(s) intact; 1 without sums" in result.output, result.output
    result = verify("nosuch")
    assert result.exit_code == 1 and "nosuch" in result.output
