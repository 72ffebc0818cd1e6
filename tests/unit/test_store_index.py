"""The store's index: pages of image names, layer references for GC and the store's totals,
kept by the store's writes, found out of date by the directories' mtimes and rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from libdsec import ImageNotFound
from dsec.images.store import Image, LayerStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _layer(store: LayerStore, tmp: Path, text: str) -> str:
    root = tmp / f"src-{text}"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text(text)
    return store.add_dir(root)


def _summed(store: LayerStore) -> tuple[int, ...]:
    """The totals summed over the index's rows, as ``stats()`` answered before its triggers."""
    db = sqlite3.connect(store.index.path)
    try:
        return (*db.execute("SELECT count(*), coalesce(sum(size), 0) FROM images").fetchone(),
                db.execute("SELECT count(*) FROM layers WHERE refs > 0").fetchone()[0],
                *db.execute("SELECT count(*), coalesce(sum(size), 0) FROM layers WHERE size > 0").fetchone())
    finally:
        db.close()


def _totals_hold(store: LayerStore) -> None:
    st = store.index.stats()
    assert (st.images, st.referenced_bytes, st.distinct_layers, st.stored_layers, st.stored_bytes) == _summed(store)
    assert store.index.count() == st.images


@pytest.fixture
def store(tmp_path) -> LayerStore:
    return LayerStore(tmp_path / "store")


def test_pages_filter_by_prefix_and_top_role(store, tmp_path):
    base = _layer(store, tmp_path, "base")
    store.put_image(Image(name="base-a", layers=(base,)))
    for i in range(5):
        ws = _layer(store, tmp_path, f"ws{i}")
        store.put_image(Image(name=f"ws-{i}", layers=(base, ws), roles=("base", "workspace")))
    idx = store.index
    assert idx.names() == ["base-a", "ws-0", "ws-1", "ws-2", "ws-3", "ws-4"]
    assert idx.names(limit=2) == ["base-a", "ws-0"]
    assert idx.names(limit=2, after="ws-0") == ["ws-1", "ws-2"]
    assert idx.names(after="ws-4") == []
    assert idx.names(prefix="ws-") == [f"ws-{i}" for i in range(5)]
    assert idx.names(prefix="base") == ["base-a"]
    assert idx.names(role="workspace", limit=3, after="ws-2") == ["ws-3", "ws-4"]
    assert idx.names(role="base") == ["base-a"]
    assert store.image_names() == idx.names()


def test_references_gc_and_dedup_stats(store, tmp_path):
    base, a, b = (_layer(store, tmp_path, t) for t in ("base", "a", "b"))
    store.put_image(Image(name="one", layers=(base, a)))
    store.put_image(Image(name="two", layers=(base, b)))
    size = {d: store.layer_size(d) for d in (base, a, b)}
    st = store.index.stats()
    assert (st.images, st.distinct_layers, st.stored_layers) == (2, 3, 3)
    assert st.stored_bytes == sum(size.values())
    assert st.referenced_bytes == 2 * size[base] + size[a] + size[b] > st.stored_bytes
    assert store.unreferenced_layers() == []
    _totals_hold(store)
    # Replacing an image drops its old references; removing one drops its own.
    store.put_image(Image(name="two", layers=(base,)))
    assert store.unreferenced_layers() == [b]
    _totals_hold(store)
    store.remove_image("one")
    assert store.unreferenced_layers() == sorted([a, b])
    _totals_hold(store)
    assert sorted(store.gc(in_use=frozenset({a}))) == [b]
    assert not store.has_layer(b) and store.has_layer(a)
    assert store.gc() == [a]
    st = store.index.stats()
    assert (st.images, st.distinct_layers, st.stored_layers, st.stored_bytes) == (1, 1, 1, size[base])
    _totals_hold(store)


def test_changes_made_behind_its_back_are_found(store, tmp_path):
    base, extra = _layer(store, tmp_path, "base"), _layer(store, tmp_path, "extra")
    store.put_image(Image(name="mine", layers=(base,)))
    other = LayerStore(store.root)  # another process sharing the store
    assert other.image_names() == ["mine"]
    # A manifest renamed into place and a layer file dropped in without the index (a tick of
    # the kernel's clock later: a directory's mtime is what tells).
    time.sleep(0.02)
    manifest = Image(name="foreign", layers=(base, extra)).to_json()
    (store.tmp_dir / "m.json").write_text(manifest)
    os.rename(store.tmp_dir / "m.json", store.images_dir / "foreign.json")
    shutil.copy(store.layer_path(extra), store.layers_dir / ("sha256-" + "f" * 64 + ".erofs"))
    assert other.image_names() == ["foreign", "mine"]
    assert other.unreferenced_layers() == ["sha256-" + "f" * 64]
    # Edited in place (a new inode, the same name): its new layers are read.
    time.sleep(0.02)
    os.rename(store.images_dir / "foreign.json", store.tmp_dir / "old.json")
    (store.tmp_dir / "m.json").write_text(Image(name="foreign", layers=(base,)).to_json())
    os.rename(store.tmp_dir / "m.json", store.images_dir / "foreign.json")
    assert sorted(store.unreferenced_layers()) == sorted([extra, "sha256-" + "f" * 64])
    time.sleep(0.02)
    (store.images_dir / "foreign.json").unlink()
    assert store.image_names() == ["mine"] == other.image_names()
    # A layer file removed by hand is no longer counted as stored.
    time.sleep(0.02)
    store.layer_path(extra).unlink()
    assert extra not in store.unreferenced_layers()
    # The totals follow what reconciling found (a referenced layer whose file went: size 0).
    _totals_hold(store)
    _totals_hold(other)


def test_a_missing_or_damaged_index_is_rebuilt(store, tmp_path):
    base = _layer(store, tmp_path, "base")
    for i in range(3):
        store.put_image(Image(name=f"img-{i}", layers=(base,)))
    orphan = _layer(store, tmp_path, "orphan")
    store.index.close()
    store.index.path.unlink()
    fresh = LayerStore(store.root)
    assert fresh.image_names() == ["img-0", "img-1", "img-2"]
    assert fresh.unreferenced_layers() == [orphan]
    fresh.index.close()
    fresh.index.path.write_bytes(b"this is not a database" * 100)
    again = LayerStore(store.root)
    assert again.image_names() == ["img-0", "img-1", "img-2"]
    assert again.index.stats().distinct_layers == 1
    again.index.rebuild()
    assert again.image_names() == ["img-0", "img-1", "img-2"] and again.unreferenced_layers() == [orphan]
    _totals_hold(again)
    # An index an older DSec wrote (version 1, no totals) is rebuilt with them.
    again.index.close()
    db = sqlite3.connect(again.index.path)
    db.executescript("DROP TRIGGER images_in; DROP TABLE totals; UPDATE meta SET v='1' WHERE k='version';")
    db.commit()
    db.close()
    older = LayerStore(store.root)
    assert older.index.stats().images == 3
    _totals_hold(older)


def test_an_unknown_name_lists_some_images_not_all(store, tmp_path):
    base = _layer(store, tmp_path, "base")
    for i in range(60):
        store.put_image(Image(name=f"task-{i:03d}", layers=(base,)))
    with pytest.raises(ImageNotFound) as err:
        store.get_image("tas")
    msg = str(err.value)
    assert "task-000" in msg and "task-019" in msg and "task-020" not in msg and "60 images" in msg
    with pytest.raises(ImageNotFound, match="known: task-000"):
        store.get_image("zzz")


def test_manifests_stay_the_truth(store, tmp_path):
    """The index adds nothing the manifests do not say: a manifest reads back the same."""
    base = _layer(store, tmp_path, "base")
    store.put_image(Image(name="x", layers=(base,), env={"A": "1"}))
    data = json.loads((store.images_dir / "x.json").read_text())
    assert data["layers"] == [base] and data["env"] == {"A": "1"}
    assert sorted(os.listdir(store.root / "index")) == ["store.sqlite"]


def test_image_ls_pages_filters_and_stats(store, tmp_path):
    from typer.testing import CliRunner

    from dsec.cli import app

    base = _layer(store, tmp_path, "base")
    store.put_image(Image(name="base", layers=(base,)))
    for i in range(5):
        store.put_image(Image(name=f"ws-{i}", layers=(base, _layer(store, tmp_path, f"w{i}")),
                              roles=("base", "workspace")))
    state = ["--state-dir", str(tmp_path)]  # the store is STATE_DIR/store

    def ls(*args: str) -> str:
        result = CliRunner().invoke(app, ["image", "ls", *args, *state], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return result.output

    out = ls("--limit", "2")
    assert "base" in out and "ws-0" in out and "ws-1" not in out and "dsec image ls --after ws-0" in out
    out = ls("--limit", "2", "--after", "ws-0", "--filter", "role=workspace")
    assert "ws-1" in out and "ws-2" in out and "ws-3" not in out and "base,base" not in out
    out = ls("--filter", "name=ws-3")
    assert "ws-3" in out and "ws-4" not in out and "more:" not in out
    out = ls("--stats", "--reindex")
    row = next(line for line in out.splitlines() if line.strip().startswith("│ 6"))
    assert [c.strip() for c in row.split("│")[1:4]] == ["6", "6", "6"]  # images, distinct layers, files
    bad = CliRunner().invoke(app, ["image", "ls", "--filter", "role=nope", *state])
    assert bad.exit_code != 0 and "a role is one of" in bad.output


def test_a_store_whose_index_cannot_be_opened_still_works(store, tmp_path, caplog):
    """An index the filesystem will not hold (here a directory where the file goes): every
    call answers as before, from the manifests, and the trouble is logged once."""
    store.index.path.parent.mkdir(exist_ok=True)
    store.index.path.mkdir()
    base, other = _layer(store, tmp_path, "base"), _layer(store, tmp_path, "other")
    store.put_image(Image(name="b", layers=(base,)))
    store.put_image(Image(name="w", layers=(base, other), roles=("base", "workspace")))
    assert store.image_names() == ["b", "w"]
    assert store.index.names(role="workspace") == ["w"] and store.index.names(limit=1, after="a") == ["b"]
    assert store.index.count() == 2
    st = store.index.stats()
    assert (st.images, st.distinct_layers, st.stored_layers) == (2, 2, 2)
    assert st.referenced_bytes == 2 * store.layer_size(base) + store.layer_size(other)
    store.remove_image("w")
    assert store.gc() == [other] and not store.has_layer(other)
    with pytest.raises(ImageNotFound, match="known: b"):
        store.get_image("nope")
    assert sum("cannot be used" in r.message for r in caplog.records) == 1


_WRITER = """
import sys
from pathlib import Path
from dsec.images.store import Image, LayerStore
store, who = LayerStore(Path(sys.argv[1])), sys.argv[2]
layers = sys.argv[3:]
for i in range(40):
    store.put_image(Image(name=f"{who}-{i:02d}", layers=(layers[i % len(layers)],)))
    if i % 4 == 3:
        store.remove_image(f"{who}-{i - 1:02d}")
"""


def test_processes_writing_at_once_keep_it_whole(store, tmp_path):
    import subprocess
    import sys

    layers = [_layer(store, tmp_path, f"l{i}") for i in range(3)]
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(store.root), who, *layers],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}) for who in ("a", "b", "c")]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    expected = sorted(f"{who}-{i:02d}" for who in "abc" for i in range(40) if i % 4 != 2)
    assert store.image_names() == expected == sorted(p.stem for p in store.images_dir.glob("*.json"))
    before = store.index.stats()
    store.index.rebuild()
    assert store.index.stats() == before and before.images == len(expected) and before.distinct_layers == 3
    assert store.unreferenced_layers() == []
