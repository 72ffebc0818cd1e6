"""``dsec.edge.watches`` on a directory of the host's own (the node's side of a watch, with no
sandbox): events as envd tells them, shared kernel watches, bounds, and nothing left open."""

from __future__ import annotations

import os

import pytest

from dsec.edge import watches as watches_module
from dsec.edge.watches import Watches
from libdsec import CapacityExceeded, InvalidRequest, SandboxFileNotFound, SessionClosed


@pytest.fixture
def root(tmp_path):
    (tmp_path / "w").mkdir()
    return tmp_path


def opener(root):
    return lambda path: os.open(str(root) + path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def told(answer):
    return [(e.type, e.name) for e in answer.events]


async def test_events_shared_watches_and_nothing_left(root):
    watches = Watches()
    first = watches.open("s1", "/w", False, opener(root))
    second = watches.open("s1", "/w", True, opener(root))  # the same directory: one kernel watch
    assert len(watches._users) == 1
    (root / "w" / "f").write_bytes(b"x")
    os.rename(root / "w" / "f", root / "w" / "g")
    (root / "w" / "g").unlink()
    expected = [("create", "f"), ("write", "f"), ("rename", "f"), ("create", "g"), ("remove", "g")]
    assert told(await watches.events("s1", first.id)) == expected
    assert told(await watches.events("s1", second.id)) == expected
    watches.close("s1", first.id)
    with pytest.raises(SessionClosed):
        await watches.events("s1", first.id)
    assert watches.count() == 1 and watches._inotify is not None
    watches.close_sandbox("s1")
    assert watches.count() == 0 and watches._inotify is None and not watches._users


async def test_bounds_and_bad_paths(root, monkeypatch):
    watches = Watches()
    with pytest.raises(SandboxFileNotFound):
        watches.open("s", "/nowhere", False, opener(root))
    (root / "file").write_bytes(b"")
    with pytest.raises(InvalidRequest, match="not a directory"):
        watches.open("s", "/file", False, opener(root))
    monkeypatch.setattr(watches_module, "MAX_PER_SANDBOX", 3)
    monkeypatch.setattr(watches_module, "MAX_QUEUED", 2)
    ids = [watches.open("s", "/w", False, opener(root)).id for _ in range(3)]
    with pytest.raises(CapacityExceeded):
        watches.open("s", "/w", False, opener(root))
    watches.open("other", "/w", False, opener(root))  # another sandbox's count is its own
    for name in "abc":
        (root / "w" / name).mkdir()
    answer = await watches.events("s", ids[0])
    assert told(answer) == [("create", "b"), ("create", "c")] and answer.dropped == 1
    monkeypatch.setattr(watches_module, "MAX_DIRS", 2)
    with pytest.raises(CapacityExceeded, match="more than 2 directories"):
        watches.open("t", "/w", True, opener(root))
    assert watches.count() == 4 and not any(sid == "t" for sid, _ in watches._open)  # (refused: nothing kept)
    watches.close_all()
    assert watches.count() == 0 and watches._inotify is None


async def test_a_watch_ends_with_its_directory(root):
    watches = Watches()
    info = watches.open("s", "/w", True, opener(root))
    (root / "w" / "sub").mkdir()
    (root / "w" / "sub" / "f").write_bytes(b"1")
    os.unlink(root / "w" / "sub" / "f")
    os.rmdir(root / "w" / "sub")
    os.rmdir(root / "w")
    answer = await watches.events("s", info.id, wait=1)
    assert answer.ended and ("remove", "sub") in told(answer)
    with pytest.raises(SessionClosed):
        await watches.events("s", info.id)
    assert watches.count() == 0 and watches._inotify is None
