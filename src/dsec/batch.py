"""The all-or-none rule of a batch of creates, in one place: the node's batch (one sandbox a
part) and the apiserver's (one node's share a part) are both this.

A batch is made of parts; part ``p`` makes ``p.count`` sandboxes whose indices in the batch
start at ``p.offset`` (``p.make()`` yields ``(index within the part, info)`` as each comes up).
``all_or_none`` runs the parts, at most ``concurrency`` at a time, and yields ``(index, info)``
as sandboxes come up, in any order. Then:

- a part that fails before it made anything may be **replaced**: ``replace(part, error)``
  returns the parts that make its sandboxes instead (another node's, when one refused), or
  ``None``, and the batch fails with that error;
- on any other failure, and when the consumer goes away before the end, the batch is
  **undone**: the parts not started never start; the ones under way are cancelled when
  ``interruptible`` (a part that is itself a batch undoes itself) or else finish (a create
  cancelled inside a backend could leave a sandbox behind); then ``undo(made)`` stops every
  sandbox made, ``made`` being ``(part, sandbox id)`` pairs, and the failure is raised.

The undo runs in a task of its own, shielded and referenced in ``undoing`` until it is done
(its owner's ``close()`` waits for them): a consumer that went away may be under a cancel scope
that cancels every await made on its behalf (anyio's, in Starlette's streaming).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from libdsec.protocol import SandboxInfo


@dataclass(eq=False)
class Part:
    offset: int
    count: int
    make: Callable[[], AsyncIterator[tuple[int, SandboxInfo]]]
    tag: Any = field(default=None)  # the maker's own (the node of a share)


def single(offset: int, create: Callable[[], Awaitable[SandboxInfo]]) -> Part:
    """A part of one sandbox, made by ``create()``."""

    async def make() -> AsyncIterator[tuple[int, SandboxInfo]]:
        yield 0, await create()

    return Part(offset, 1, make)


async def all_or_none(
    parts: Iterable[Part],
    undo: Callable[[list[tuple[Part, str]]], Awaitable[object]],
    *,
    undoing: set[asyncio.Task],
    concurrency: int | None = None,
    interruptible: bool = False,
    replace: Callable[[Part, BaseException], Awaitable[list[Part] | None]] | None = None,
) -> AsyncIterator[tuple[int, SandboxInfo]]:
    parts = list(parts)
    total = sum(p.count for p in parts)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    # ("made", part, (index, info)) | ("failed", part, error, made anything)
    queue: asyncio.Queue[tuple] = asyncio.Queue()
    tasks: set[asyncio.Task] = set()
    state = {"abandoned": False}

    async def run(part: Part) -> None:
        made_any = False
        try:
            if sem is not None:
                await sem.acquire()
            try:
                if state["abandoned"]:
                    return
                async with _closing(part.make()) as events:
                    async for index, info in events:
                        made_any = True
                        queue.put_nowait(("made", part, (part.offset + index, info)))
            finally:
                if sem is not None:
                    sem.release()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(("failed", part, exc, made_any))

    def launch(part: Part) -> None:
        task = asyncio.create_task(run(part))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for part in parts:
        launch(part)
    made: list[tuple[Part, str]] = []
    complete = False
    try:
        delivered = 0
        while delivered < total:
            item = await queue.get()
            if item[0] == "made":
                _, part, (index, info) = item
                made.append((part, info.id))
                delivered += 1
                yield index, info
                continue
            _, part, exc, made_any = item
            again = None if made_any or replace is None else await replace(part, exc)
            if again is None:
                raise exc
            for new in again:
                launch(new)
        complete = True
    finally:
        if not complete:
            state["abandoned"] = True
            task = asyncio.create_task(_undo(tasks, queue, made, undo, interruptible))
            undoing.add(task)
            task.add_done_callback(undoing.discard)
            await asyncio.shield(task)


async def _undo(tasks: set[asyncio.Task], queue: asyncio.Queue, made: list[tuple[Part, str]],
                undo: Callable[[list[tuple[Part, str]]], Awaitable[object]], interruptible: bool) -> None:
    running = list(tasks)
    if interruptible:
        for task in running:
            task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    while not queue.empty():
        item = queue.get_nowait()
        if item[0] == "made":
            made.append((item[1], item[2][1].id))
    if made:
        await undo(made)


class _closing:
    """``async with _closing(gen) as gen``: the generator closed at the end (contextlib's
    ``aclosing``, also for an iterator without ``aclose``)."""

    def __init__(self, gen) -> None:
        self.gen = gen

    async def __aenter__(self):
        return self.gen

    async def __aexit__(self, *exc: object) -> None:
        aclose = getattr(self.gen, "aclose", None)
        if aclose is not None:
            await aclose()
