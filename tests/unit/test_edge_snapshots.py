"""Named snapshots on the edge, over the fake backend: the catalogue in the layer store, starts
from a snapshot, and every refusal naming its problem. (A real container's and a real microVM's
snapshots: tests/integration/test_named_snapshots.py, tests/vm/test_vm_snapshots.py.)"""

from __future__ import annotations

import pydantic
import pytest

from dsec.backends.base import PackedDiff
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.images import snapshots
from dsec.images.store import Image
from libdsec import (
    DSecContainerRunArgs, DSecMicroVMRunArgs, ImageNotFound, InvalidRequest, SandboxStatus, SnapshotConflict,
    SnapshotNotFound,
)
from libdsec.protocol import Snapshot, SnapshotRequest


@pytest.fixture
def packing(store, tmp_path, monkeypatch):
    """The fake backend packs a sandbox's files written since create as a real layer."""

    async def pack_diff(self, handle):
        root = tmp_path / f"upper-{handle.cid}"
        for path, data in self._files(handle).items():
            if path != "/etc/passwd":
                (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                (root / path.lstrip("/")).write_bytes(data)
        root.mkdir(exist_ok=True)
        return PackedDiff(store.add_dir(root), [], 0.0)

    monkeypatch.setattr(FakeBackend, "pack_diff", pack_diff)


def edge_on(tmp_path, store, *backends) -> Edge:
    return Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), list(backends) or FakeBackend(), store)


@pytest.mark.parametrize("name", ["Upper", "-dash", "a/b", "x" * 65, "s0123456789abcdef", ""])
def test_bad_snapshot_names_are_refused_naming_the_rule(name):
    with pytest.raises(pydantic.ValidationError, match="invalid snapshot name"):
        SnapshotRequest(name=name)


def test_run_args_take_an_image_or_a_snapshot():
    with pytest.raises(pydantic.ValidationError, match="container_image is required"):
        DSecContainerRunArgs()
    assert DSecContainerRunArgs(snapshot="ready-1").container_image == ""
    with pytest.raises(pydantic.ValidationError, match="neither a snapshot id"):
        DSecContainerRunArgs(snapshot="../x")


async def test_a_filesystem_snapshot_outlives_its_sandbox_and_the_edge(tmp_path, store, packing):
    edge = edge_on(tmp_path, store)
    await edge.start()
    try:
        source = await edge.create(DSecContainerRunArgs(container_image="tiny"))
        await edge.write_file(source.id, "/work/state.txt", b"step 7", 0o644)
        snap = await edge.snapshot(source.id, name="step-7")  # a container's default: filesystem
        assert (snap.mode, snap.kind, snap.name, snap.sandbox_id, snap.source_image) == (
            "filesystem", "container", "step-7", source.id, "tiny")
        assert snap.image == snapshots.image_name(snap.id) and store.get_image(snap.image).layers[-1] == snap.layer
        await edge.stop(source.id)
    finally:
        await edge.close()

    again = edge_on(tmp_path, store)  # a new edge (a restart) finds it in the store
    await again.start()
    try:
        assert [s.id for s in await again.list_snapshots()] == [snap.id]
        assert (await again.get_snapshot("step-7")).id == snap.id
        child = await again.create(DSecContainerRunArgs(snapshot="step-7"))
        assert child.snapshot == snap.id and child.image == snap.image
        with pytest.raises(SnapshotConflict, match=f"in use by the sandboxes started from it \\({child.id}\\)"):
            await again.remove_snapshot(snap.id, [])
        await again.stop(child.id)
        with pytest.raises(SnapshotConflict, match="n0-elsewhere"):  # one the apiserver found on another node
            await again.remove_snapshot(snap.id, ["n0-elsewhere"])
        with pytest.raises(InvalidRequest, match=f"is snapshot {snap.id}'s: remove the snapshot instead"):
            await again.remove_image(snap.image, frozenset())
        removed = await again.remove_snapshot("step-7", [])
        assert removed.id == snap.id and await again.list_snapshots() == []
        with pytest.raises(ImageNotFound):
            store.get_image(snap.image)
        with pytest.raises(SnapshotNotFound, match="no snapshot 'step-7'"):
            await again.create(DSecContainerRunArgs(snapshot="step-7"))
        with pytest.raises(SnapshotNotFound, match=snap.id):
            await again.get_snapshot(snap.id)
    finally:
        await again.close()


async def test_refusals_name_the_problem(tmp_path, store, packing):
    edge = edge_on(tmp_path, store, FakeBackend(), FakeBackend("fullvm"))
    await edge.start()
    try:
        source = await edge.create(DSecContainerRunArgs(container_image="tiny"))
        with pytest.raises(InvalidRequest, match="a container sandbox takes no full snapshots"):
            await edge.snapshot(source.id, mode="full")
        first = await edge.snapshot(source.id, mode="filesystem", name="taken")
        with pytest.raises(SnapshotConflict, match=f"snapshot name 'taken' is taken by snapshot {first.id}"):
            await edge.snapshot(source.id, name="taken")
        with pytest.raises(InvalidRequest, match="invalid snapshot name 'Bad'"):
            await edge.snapshot(source.id, name="Bad")
        with pytest.raises(InvalidRequest, match=f"{first.id} \\(taken\\) is a filesystem snapshot of a container "
                                                 "sandbox: it starts container sandboxes, not fullvm; its image"):
            await edge.create(DSecContainerRunArgs(snapshot="taken"), kind="fullvm")
        with pytest.raises(InvalidRequest, match="was taken of image 'tiny'; container_image 'other' names another"):
            await edge.create(DSecContainerRunArgs(container_image="other", snapshot="taken"))
        with pytest.raises(SnapshotNotFound, match="no snapshot 'never-taken'"):
            await edge.create(DSecContainerRunArgs(snapshot="never-taken"))
        with pytest.raises(SnapshotNotFound):  # another project's snapshot is not there for it
            await edge.create(DSecContainerRunArgs(snapshot="taken"), project="team-b")
        assert len([s for s in await edge.list() if s.status is SandboxStatus.running]) == 1  # nothing half-made
        await edge.stop(source.id)
        await edge.remove_snapshot(first.id, [])
    finally:
        await edge.close()


async def test_a_full_snapshot_restores_only_on_its_node(tmp_path, store):
    """The memory of a full snapshot lies on the node that took it: another refuses it by name."""
    catalog = snapshots.SnapshotCatalog(store)
    snap_id = catalog.begin("n9", None)
    store.put_image(store.get_image("tiny").on_top(store.get_image("tiny"), snapshots.image_name(snap_id)))
    snap = Snapshot(id=snap_id, mode="full", kind="container", sandbox_id="n9-0123456789abcdef", node="n9",
                    image=snapshots.image_name(snap_id), source_image="tiny", size_bytes=1, save_s=0.1,
                    created_at="2026-01-01T00:00:00Z")
    catalog.commit(snapshots.Kept(snap, "s00000000000000aa"))
    edge = edge_on(tmp_path, store)
    await edge.start()
    try:
        with pytest.raises(InvalidRequest, match="its memory is on node n9, so sandboxes start from it there, not on n0"):
            await edge.create(DSecContainerRunArgs(snapshot=snap_id))
    finally:
        await edge.close()
        catalog.remove(catalog.get(snap_id))


async def test_a_snapshot_cut_short_by_a_crash_is_cleared_at_start(tmp_path, store, monkeypatch):
    dropped = []
    monkeypatch.setattr(FakeBackend, "delete_snapshot", lambda self, memory: dropped.append(memory), raising=False)
    catalog = snapshots.SnapshotCatalog(store)
    snap_id = catalog.begin("n0", "half-made")  # then the edge died: no record was written
    catalog.note_memory(snap_id, "n0", "container", "s00000000000000bb")  # after its memory was saved
    other = catalog.begin("n7", None)  # another node's, being taken: not this node's to clear
    with pytest.raises(SnapshotConflict, match="'half-made' is taken"):
        catalog.begin("n0", "half-made")
    edge = edge_on(tmp_path, store)
    await edge.start()
    try:
        assert catalog.pending_of("n0") == [] and catalog.names_of(snap_id) == []
        assert dropped == ["s00000000000000bb"] and catalog.pending_of("n7") == [other]
        catalog.abandon(other, None)
        with pytest.raises(SnapshotNotFound):
            await edge.get_snapshot("half-made")
        catalog.abandon(catalog.begin("n0", "half-made"), "half-made")  # the name is free again
    finally:
        await edge.close()


def keep_full_snapshot(store, node: str, kind: str = "microvm", project: str = "root") -> str:
    """A full snapshot's record as the node that took it keeps it (its memory is a fake's)."""
    catalog = snapshots.SnapshotCatalog(store)
    snap_id = catalog.begin(node, None)
    tiny = store.get_image("tiny")
    store.put_image(Image(name=snapshots.image_name(snap_id), layers=tiny.layers, env=tiny.env))
    catalog.commit(snapshots.Kept(Snapshot(
        id=snap_id, mode="full", kind=kind, sandbox_id=f"{node}-0123456789abcdef", node=node, project=project,
        image=snapshots.image_name(snap_id), source_image="tiny", size_bytes=1, save_s=0.1,
        created_at="2026-01-01T00:00:00Z"), "s00000000000000aa"))
    return snap_id


async def test_a_create_from_a_full_snapshot_is_placed_on_the_node_holding_its_memory(tmp_path, store):
    import random

    from dsec.apiserver.cluster import Cluster

    edges = [Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0), FakeBackend("microvm"),
                  store) for name in ("n0", "n1", "n2")]
    for edge in edges:
        await edge.start()
    snap_id = keep_full_snapshot(store, "n1")
    try:
        cluster = Cluster(edges, rng=random.Random(0))
        made = [await cluster.create(DSecMicroVMRunArgs(snapshot=snap_id), "root", kind="microvm") for _ in range(6)]
        assert {info.node for info in made} == {"n1"} and {info.snapshot for info in made} == {snap_id}
        for info in made:
            await cluster.stop(info.id)
        away = Cluster([edges[0], edges[2]], rng=random.Random(0))
        with pytest.raises(SnapshotConflict, match="its memory is on node n1, which is not in the cluster now"):
            await away.create(DSecMicroVMRunArgs(snapshot=snap_id), "root", kind="microvm")
        with pytest.raises(SnapshotNotFound, match="no snapshot 'gone-one'"):
            await cluster.create(DSecMicroVMRunArgs(snapshot="gone-one"), "root", kind="microvm")
    finally:
        await edges[1].remove_snapshot(snap_id, [])
        for edge in edges:
            await edge.close()


async def test_the_catalogue_routes_show_a_project_its_own_snapshots(tmp_path, store):
    import httpx

    from dsec.apiserver.app import create_app
    from dsec.apiserver.cluster import Cluster
    from dsec.apiserver.projects import open_project_store
    from libdsec import DSecClient

    edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", pool_min=0, pool_max=0), FakeBackend("microvm"), store)
    await edge.start()
    projects = open_project_store()
    transport = httpx.ASGITransport(app=create_app(Cluster([edge], projects=projects), "root-token"),
                                    raise_app_exceptions=False)
    snap_id = keep_full_snapshot(store, "n0")
    try:
        async with DSecClient("http://api", token="root-token", transport=transport) as root:
            await root.create_project("team")
            token = await root.create_project_token("team")
            assert [s.id for s in await root.list_snapshots()] == [snap_id]
            async with DSecClient("http://api", token=token, transport=transport) as team:
                assert await team.list_snapshots() == []
                with pytest.raises(SnapshotNotFound):
                    await team.get_snapshot(snap_id)
                with pytest.raises(SnapshotNotFound):
                    await team.remove_snapshot(snap_id)
                with pytest.raises(InvalidRequest, match="invalid snapshot reference"):
                    await team.get_snapshot("a/b")
            assert (await root.remove_snapshot(snap_id)).id == snap_id
            with pytest.raises(SnapshotNotFound):
                await root.get_snapshot(snap_id)
    finally:
        await edge.close()
        projects.close()
