"""The system-call wrappers: openat2 keeps every path inside its root, and retries the EAGAIN a
busy host causes (a rename or mount anywhere races a ".." lookup under RESOLVE_IN_ROOT)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dsec import _sys


@pytest.fixture
def root(tmp_path):
    (tmp_path / "root/a").mkdir(parents=True)
    (tmp_path / "root/file").write_text("inside\n")
    (tmp_path / "root/a/up").symlink_to("../../../../../..")
    (tmp_path / "outside").write_text("outside\n")
    fd = os.open(tmp_path / "root", os.O_PATH | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _read(fd: int) -> str:
    with os.fdopen(fd) as f:
        return f.read()


def test_paths_and_symlinks_resolve_inside(root):
    for path in ("/file", "file", "/a/../file", "/../../file", "/a/up/file", "a/up/a/up/file"):
        assert _read(_sys.openat2(root, path, os.O_RDONLY, 0, _sys.RESOLVE_IN_ROOT)) == "inside\n", path
    with pytest.raises(FileNotFoundError):
        _sys.openat2(root, "/a/up/outside", os.O_RDONLY, 0, _sys.RESOLVE_IN_ROOT)


def test_dot_dot_lookups_survive_renames_elsewhere(root, tmp_path):
    spin = tmp_path / "spin"
    spin.mkdir()
    stop = threading.Event()

    def rename_forever():
        while not stop.is_set():
            os.rename(spin, tmp_path / "spun")
            os.rename(tmp_path / "spun", spin)

    thread = threading.Thread(target=rename_forever)
    thread.start()
    try:
        deadline = time.monotonic() + 1.0
        calls = 0
        while time.monotonic() < deadline:
            fd = _sys.openat2(root, "a/../a/../file", os.O_RDONLY, 0, _sys.RESOLVE_IN_ROOT)
            os.close(fd)
            calls += 1
    finally:
        stop.set()
        thread.join()
    assert calls > 1000
