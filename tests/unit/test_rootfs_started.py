"""The host's overlays of started sandboxes, unmounted by whichever thread mounts next.

Creates mount roots in threads at once, so two threads may detach the started list together:
neither may fail for the other having taken the last entry (a burst of creates met an
``IndexError: pop from empty list`` there, a 500 to its caller); a root mounted again for a
restart leaves the list before it is looked at.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from dsec.backends.container.rootfs import RootFilesystems


def _roots(tmp_path: Path) -> RootFilesystems:
    return RootFilesystems(store=None, layer_mounts=None, sandboxes_dir=tmp_path, id_ranges=None)  # type: ignore[arg-type]


def test_threads_detach_together(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    failures: list[BaseException] = []
    stop = threading.Event()

    def detach() -> None:
        while not stop.is_set():
            try:
                roots.detach_started()
            except BaseException as e:  # noqa: BLE001 - what the test looks for
                failures.append(e)
                return

    threads = [threading.Thread(target=detach) for _ in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switched between any two steps, as a loaded host does
    for t in threads:
        t.start()
    try:
        # Not mount points: each unmount fails with EINVAL (passed over, as a root torn down
        # meanwhile is), but each is a real system call, in which the thread lets the others run.
        for i in range(5_000):
            roots.started(SimpleNamespace(target=tmp_path / f"c{i}" / "rootfs"))  # type: ignore[arg-type]
            if failures:
                break
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        for t in threads:
            t.join()
    roots.detach_started()
    assert not failures, f"a thread's detach failed: {failures[0]!r}"
    assert roots._started == []


def test_mount_again_takes_its_root_off_the_list_and_mounts_it(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    target = tmp_path / "c1" / "rootfs"
    target.mkdir(parents=True)
    plan = SimpleNamespace(target=target)
    roots.started(plan)  # type: ignore[arg-type]
    mounted: list[Path] = []
    roots._mount_overlay = lambda p: mounted.append(p.target)  # type: ignore[method-assign]
    roots.mount_again(plan)  # type: ignore[arg-type]
    assert mounted == [target]  # not a mount point: mounted again
    assert target not in roots._started
