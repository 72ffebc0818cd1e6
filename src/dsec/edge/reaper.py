"""The TTL reaper: every ``reaper_interval_s`` it stops the sandboxes whose time is up.

A running sandbox with no call in flight and none for ``ttl_running_stop`` seconds (its own run
arg) is stopped, or paused if its ``on_ttl`` says so; a paused one is exempt from that until it
has been paused for the node's ``paused_ttl_s``. The sandboxes of a batch not committed by the time its node gives it up
(``batches``: batch id -> that time, or None while it is being made) are stopped too. A stop that fails, with any error, is logged (the stop marks the sandbox
failed) and the reaper goes on. Each round also calls ``sweep()``, if given (the edge's look for
sandboxes that died with no call to find it out: VMs whose QEMU or guest agent is gone).
``start()`` runs it, ``close()`` ends it (a second call does nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from libdsec.protocol import PauseMode, SandboxStatus

from .lifecycle import Record

if TYPE_CHECKING:
    from .config import EdgeConfig

log = logging.getLogger("dsec.edge")


def expired(records: Iterable[Record], now: float, paused_ttl_s: float,
            batches: Mapping[str, float | None] | None = None) -> list[tuple[Record, str]]:
    """The sandboxes to stop at ``now``, each with the reason it is stopped for."""
    records = list(records)
    given_up = {b for b, at in (batches or {}).items() if at is not None and now > at}
    if given_up:
        return [(r, f"its batch {r.batch} was not committed in time (the apiserver that asked for it went away)")
                for r in records if r.batch in given_up] + expired(records, now, paused_ttl_s)
    due = [
        (r, f"idle for over ttl_running_stop={r.args.ttl_running_stop:g}s") for r in idle(records, now)
        if r.args.on_ttl == "stop"
    ]
    due += [
        (r, f"paused for over paused_ttl_s={paused_ttl_s:g}s") for r in records
        if r.status is SandboxStatus.paused and r.paused_at is not None
        and now - r.paused_at > paused_ttl_s
    ]
    return due


def idle(records: Iterable[Record], now: float) -> list[Record]:
    """The running sandboxes with no call in flight and none for their ``ttl_running_stop``."""
    return [r for r in records if r.status is SandboxStatus.running and r.calls == 0
            and now - r.last_active > r.args.ttl_running_stop]


def to_pause(records: Iterable[Record], now: float) -> list[Record]:
    """The sandboxes whose idle TTL passed and that pause then (``on_ttl="pause"``, or
    ``"pause_filesystem"``)."""
    return [r for r in idle(records, now) if r.args.on_ttl in ("pause", "pause_filesystem")]


class TTLReaper:
    """Stops, through ``stop(sandbox_id, reason)``, what ``expired`` finds in ``records``, and
    pauses, through ``pause(sandbox_id, mode)``, what ``to_pause`` finds (without ``pause``, nothing is)."""

    def __init__(self, config: EdgeConfig, records: Mapping[str, Record],
                 stop: Callable[[str, str], Awaitable[object]], batches: dict[str, float | None] | None = None,
                 sweep: Callable[[], Awaitable[object]] | None = None,
                 pause: Callable[[str, PauseMode], Awaitable[object]] | None = None) -> None:
        self.config = config
        self.records = records
        self.stop = stop
        self.pause = pause
        self.batches = batches if batches is not None else {}
        self.sweep = sweep
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dsec-ttl-reaper")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
            if self.sweep is not None:
                try:
                    await self.sweep()
                except Exception as exc:  # noqa: BLE001 - as for a stop
                    log.warning("the sweep for dead sandboxes failed: %s", exc)
            now = time.time()
            due = expired(self.records.values(), now, self.config.paused_ttl_s, self.batches)
            for batch in [b for b, at in self.batches.items() if at is not None and now > at]:
                del self.batches[batch]  # given up: a commit from now on finds it gone
            for rec, reason in due:
                try:
                    await self.stop(rec.id, reason)
                except Exception as exc:  # noqa: BLE001 - a backend's own error must not end the reaper
                    log.warning("TTL stop of %s failed: %s", rec.id, exc)
            if self.pause is not None:
                for rec in to_pause(self.records.values(), now):
                    try:
                        await self.pause(rec.id, "filesystem" if rec.args.on_ttl == "pause_filesystem" else "full")
                    except Exception as exc:  # noqa: BLE001 - e.g. a call arrived meanwhile: tried next round
                        log.info("TTL pause of %s not made: %s", rec.id, exc)
