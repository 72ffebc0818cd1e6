"""E2B's snapshot API (e2b's own SDK, in this process) on DSec's named snapshots: create (full
refused on a container, filesystem by default), list by sandbox and name, a sandbox created
from a snapshot's id, delete (twice: False the second time), and the conflicts and bad names
as E2B's error answers."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b")

from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402

from libdsec import SyncDSecClient  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def e2b_options(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        key = client.create_project_token("root", e2b=True)
    return {"api_key": key, "api_url": f"{server.endpoint}/e2b", "sandbox_url": f"{server.endpoint}/e2b/envd"}


def test_e2b_snapshots_map_onto_dsec_snapshots(e2b_options, server):
    source = Sandbox.create("busybox", **e2b_options)
    try:
        source.files.write("/root/kept.txt", "from the source")
        with pytest.raises(SandboxException, match="a container sandbox takes no full snapshots"):
            source.create_snapshot(mode="full")
        snap = source.create_snapshot(name=f"e2b-{source.sandbox_id[-8:]}")
        assert snap.names == [f"e2b-{source.sandbox_id[-8:]}"]
        with pytest.raises(SandboxException, match="is taken by snapshot"):
            source.create_snapshot(name=snap.names[0])
        with pytest.raises(SandboxException, match="invalid snapshot name"):
            source.create_snapshot(name="Not A Name")
        listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **e2b_options).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name="no-such-name", **e2b_options).next_items() == []
    finally:
        source.kill()
    child = Sandbox.create(snap.snapshot_id, **e2b_options)
    try:
        assert child.files.read("/root/kept.txt") == "from the source"
        with pytest.raises(SandboxException, match=f"in use by the sandboxes started from it \\({child.sandbox_id}\\)"):
            Sandbox.delete_snapshot(snap.snapshot_id, **e2b_options)
    finally:
        child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, **e2b_options) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id, **e2b_options) is False
