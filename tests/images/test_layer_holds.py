"""A node holds a shared lock on each layer file it has mounted, and GC removes only the layers it
can lock alone: a layer mounted by a node is kept whoever runs GC on the store (another
machine's ``dsec image gc`` sees none of this node's sandboxes), and goes once let go. (Across
two GlusterFS clients: tests/cluster/test_gluster_store.py.)"""

from __future__ import annotations

import os

import pytest

from dsec.images.compose import LayerMount
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_gc_anywhere_keeps_a_layer_a_node_has_mounted(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("held\n")
    store = LayerStore(tmp_path / "store")
    digest = store.add_dir(src)
    mounts = LayerMounts(tmp_path / "node" / "layers", layers_dir=store.layers_dir)
    layer = LayerMount(digest=digest, source=store.layer_path(digest), target=mounts.mount_dir / digest)
    mounts.acquire((layer,))
    try:
        assert (layer.target / "f").read_text() == "held\n"
        elsewhere = LayerStore(tmp_path / "store")  # no image names it, and no sandbox is known
        assert elsewhere.gc() == []
        assert store.has_layer(digest)
    finally:
        mounts.release((layer,))
    assert not os.path.ismount(layer.target)
    assert LayerStore(tmp_path / "store").gc() == [digest]
    assert not store.has_layer(digest)
