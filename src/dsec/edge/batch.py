"""The edge's all-or-none rule for a batch of creates (the apiserver has its own for now; the
rule is here alone so that it can be lifted out into one shared place).

``all_or_none`` makes ``count`` sandboxes, ``concurrency`` at a time, and yields (index, info) as
each comes up. On the first failure, or if the consumer goes away, the creates under way finish
(a create cancelled inside the backend could leave a sandbox behind), the others do not start,
and every sandbox made is stopped; then the failure is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from libdsec.protocol import SandboxInfo


async def all_or_none(
    count: int,
    create: Callable[[], Awaitable[SandboxInfo]],
    stop: Callable[[str], Awaitable[object]],
    *,
    concurrency: int,
    check: Callable[[], object],
    undoing: set[asyncio.Task],
) -> AsyncIterator[tuple[int, SandboxInfo]]:
    """``check()`` first (it raises for a request none of the batch can take), as the first item is
    asked for; an undo runs as a task referenced in ``undoing`` until it is done (its owner's
    ``close()`` waits for it)."""
    check()
    sem = asyncio.Semaphore(concurrency)
    queue: asyncio.Queue[tuple[int, SandboxInfo | BaseException]] = asyncio.Queue()

    abandoned = False

    async def one(i: int) -> None:
        async with sem:
            if abandoned:
                return
            try:
                await queue.put((i, await create()))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, exc))

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    made: list[str] | None = []
    try:
        for _ in range(count):
            i, result = await queue.get()
            if isinstance(result, BaseException):
                raise result
            made.append(result.id)
            yield i, result
        made = None
    finally:
        # Also when the failure came first (nothing made yet), creates are under way. They
        # finish, the others do not start, and whatever was made is stopped.
        if made is not None:
            abandoned = True
            # In a task of its own: a consumer that went away may be under a cancel scope
            # that cancels every await made here (anyio's, in Starlette's streaming).
            undo = asyncio.create_task(_undo(tasks, queue, made, stop))
            undoing.add(undo)
            undo.add_done_callback(undoing.discard)
            await asyncio.shield(undo)


async def _undo(tasks: list[asyncio.Task], queue: asyncio.Queue, made: list[str],
                stop: Callable[[str], Awaitable[object]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    while not queue.empty():
        _, result = queue.get_nowait()
        if isinstance(result, SandboxInfo):
            made.append(result.id)
    await asyncio.gather(*(stop(sid) for sid in made), return_exceptions=True)
