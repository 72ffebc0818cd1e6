"""A watched directory of a sandbox (``Sandbox.watch_dir``), as the SDK sees it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .api_ops import api_route
from ._errors import SessionClosed
from .protocol import MAX_WATCH_WAIT_S, FsEvent, WatchEvents, WatchEventsRequest, WatchInfo

if TYPE_CHECKING:
    from ._client import Sandbox

_HTTP_SLACK_S = 30.0
_LONG_POLL_S = 20.0


class DirWatch:
    """What changes in a directory of the sandbox (and, if ``recursive``, in its tree), told
    by the node's inotify as ``FsEvent``s: ``create``, ``write``, ``remove``, ``rename`` (a
    name moved away; its new name comes as a ``create``), ``chmod``; names relative to the
    directory.

    ``await watch.events()`` answers what happened since the last call (``wait`` seconds for a
    first one, when none is held); ``async for event in watch`` yields each as it comes, until
    the watch ends. It ends (``ended``) when the directory is removed or moved, or its sandbox
    stops. ``dropped`` counts events lost because nobody read them in time. ``close()`` stops
    watching; a second ``close()`` does nothing, and ``events()`` after it raises
    ``SessionClosed``. ``async with`` closes it. The watch lives on the sandbox's node: a
    restart of that node's edge ends it (its calls then raise ``SessionClosed``)."""

    def __init__(self, sandbox: Sandbox, info: WatchInfo) -> None:
        self._sandbox = sandbox
        self.info = info
        self.ended = False
        self.closed = False
        self.dropped = 0

    @property
    def id(self) -> int:
        return self.info.id

    def __repr__(self) -> str:
        state = "closed" if self.closed else "ended" if self.ended else "watching"
        return f"<DirWatch {self.id} of {self.info.path} in {self._sandbox.id} {state}>"

    def _route(self, name: str) -> tuple[str, str]:
        return api_route(name, sandbox_id=self._sandbox.id, watch=self.id)

    async def events(self, *, wait: float = 0.0) -> list[FsEvent]:
        """The events since the last call, waiting up to ``wait`` seconds (at most 60) for a
        first one when none is held. Once the watch ended its last events come, then ``[]``."""
        if self.closed:
            raise SessionClosed(f"watch {self.id} is closed")
        if self.ended:
            return []
        request = WatchEventsRequest(wait=wait)
        body = await self._sandbox._client._request(*self._route("watch_events"), model=request,
                                                    timeout=request.wait + _HTTP_SLACK_S)
        answer = WatchEvents.model_validate(body)
        self.dropped += answer.dropped
        self.ended = answer.ended
        return answer.events

    def __aiter__(self) -> AsyncIterator[FsEvent]:
        return self._follow()

    async def _follow(self) -> AsyncIterator[FsEvent]:
        """Each event as it comes; the loop ends with the watch."""
        while not (self.ended or self.closed):
            for event in await self.events(wait=min(_LONG_POLL_S, MAX_WATCH_WAIT_S)):
                yield event

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ended:
            try:
                await self._sandbox._client._request(*self._route("close_watch"))
            except SessionClosed:
                pass  # it ended on the node meanwhile

    async def __aenter__(self) -> DirWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
