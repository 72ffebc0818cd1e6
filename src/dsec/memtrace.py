"""Where a server's memory goes: ``DSEC_TRACEMALLOC=1 dsec serve`` traces every Python allocation
from boot (``tracemalloc``, ``DSEC_TRACEMALLOC_FRAMES`` frames each, default 8), and each SIGUSR2
writes a report to ``<state dir>/tracemalloc.txt`` (written whole, then renamed into place).

The first report sets the baseline and lists the biggest holders; every later one lists what grew
since that baseline, by line and by allocating stack. ``dsec bench soak --tracemalloc`` asks for one
after each sample, so the baseline is the server after the first thousand lifecycles and the last
report is what the rest added. Tracing slows the server several-fold: a diagnosis, not a default.

The report's first line is ``report <n> traced <bytes> peak <bytes>``: a reader waits for the
``n`` it asked for.
"""

from __future__ import annotations

import collections
import gc
import linecache
import os
import signal
import tracemalloc
from pathlib import Path

from . import settings

REPORT = "tracemalloc.txt"
TOP = 25

# The tracer's own frames and the import machinery are not the server's memory.
_FILTERS = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, linecache.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)


class MemoryTracer:
    """Writes the reports of one traced process (``install`` hooks SIGUSR2 to ``report``)."""

    def __init__(self, state_dir: Path, frames: int = 8) -> None:
        self.path = Path(state_dir) / REPORT
        self.frames = frames
        self._baseline: tracemalloc.Snapshot | None = None
        self._baseline_objects: collections.Counter[str] = collections.Counter()
        self._reports = 0

    def install(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        signal.signal(signal.SIGUSR2, lambda _signum, _frame: self.report())

    def report(self) -> str:
        snapshot = tracemalloc.take_snapshot().filter_traces(_FILTERS)
        traced, peak = tracemalloc.get_traced_memory()
        self._reports += 1
        lines = [f"report {self._reports} traced {traced} peak {peak}"]
        objects = _live_objects()
        if self._baseline is None:
            self._baseline, self._baseline_objects = snapshot, objects
            lines.append(f"baseline: the {TOP} biggest holders, by line")
            lines += [_stat_line(s.size, s.count, s.traceback) for s in snapshot.statistics("lineno")[:TOP]]
        else:
            by_line = [s for s in snapshot.compare_to(self._baseline, "lineno") if s.size_diff > 0][:TOP]
            lines.append(f"grown since the baseline (report 1), by line: {sum(s.size_diff for s in by_line)} bytes "
                         f"in the top {len(by_line)}")
            lines += [_stat_line(s.size_diff, s.count_diff, s.traceback, s.size) for s in by_line]
            lines.append("grown since the baseline, by allocating stack (innermost frame first)")
            for s in [s for s in snapshot.compare_to(self._baseline, "traceback") if s.size_diff > 0][:20]:
                lines.append(_stat_line(s.size_diff, s.count_diff, s.traceback, s.size))
                lines += [f"      {frame.filename}:{frame.lineno}" for frame in reversed(s.traceback)]
            grown = [(k, n - self._baseline_objects.get(k, 0)) for k, n in objects.items()]
            grown = sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:TOP]
            lines.append("live objects grown since the baseline, by type (coroutines and tasks by function)")
            lines += [f"  {n:+8d}  {k}" for k, n in grown]
        text = "\n".join(lines) + "\n"
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        return text


def _live_objects() -> collections.Counter[str]:
    """Objects the collector tracks, by type; coroutines, frames and tasks by their function."""
    counts: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind == "coroutine":
            kind = f"coroutine {obj.cr_code.co_qualname}"
        elif kind == "frame":
            kind = f"frame {obj.f_code.co_qualname}"
        elif kind == "Task":
            coro = obj.get_coro()
            kind = f"Task {getattr(getattr(coro, 'cr_code', None), 'co_qualname', '?')}"
        counts[kind] += 1
    return counts


def _stat_line(size: int, count: int, traceback: tracemalloc.Traceback, now: int | None = None) -> str:
    frame = traceback[-1]  # the allocating line (a traceback runs from the oldest frame)
    held = f" (now {now / 1024:.1f} KiB)" if now is not None else ""
    return f"  {size / 1024:+10.1f} KiB {count:+8d} blocks  {frame.filename}:{frame.lineno}{held}"


def install_from_env(state_dir: Path) -> MemoryTracer | None:
    """Trace from here on if ``DSEC_TRACEMALLOC`` is set (not ``0``)."""
    config = settings.current()
    if not config.tracemalloc:
        return None
    tracer = MemoryTracer(state_dir, frames=config.tracemalloc_frames)
    tracer.install()
    return tracer
