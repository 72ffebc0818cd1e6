"""envd's ``filesystem.Filesystem`` service on DSec's file calls (``sandbox.files``: list, stat,
remove, make_dir, rename — each one command in the sandbox).

A container's directory is watched by its node's inotify (``dsec.edge.watches``): the events
are envd's own (three for a new file written, renames as renames). The sync SDK's watchers
(``CreateWatcher`` / ``GetWatcherEvents``) are then the node's watch, its id ``n<id>``: any
apiserver answers for it, and an edge restart ends it (``NOT_FOUND``). A VM's files the node
cannot watch: there ``WatchDir`` lists the tree every ``POLL_S`` and tells what appeared
(``CREATE``), went (``REMOVE``) or changed size or mtime (``WRITE``), and a watcher compares
against the listing of its previous call (a change undone between two looks is not seen,
renames show as a remove and a create); those watchers live in this apiserver's memory (at
most ``MAX_WATCHERS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import stat as stat_bits
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from e2b.envd.filesystem import filesystem_pb as pb

from libdsec import DSecError, InvalidRequest, SandboxFileNotFound, SessionClosed
from libdsec.protocol import FileEntry, FsEvent, OpenWatchRequest, WatchInfo

from ._errors import rpc_error
from .envd import METADATA_XATTRS, EnvdContext, Target

POLL_S = 0.2
NODE_WAIT_S = 20.0  # one long wait on the node for a watch's next events
_NODE_WATCH = "n"  # the sync SDK's watcher ids that name a node's watch
MAX_WATCHERS = 1024
MAX_WATCHED_DIRS = 256  # directories one recursive look lists at most

_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY, "symlink": pb.FileType.SYMLINK}
_KINDS = {"file": "-", "dir": "d", "symlink": "l", "other": "?"}


Names = tuple[dict[int, str], dict[int, str]]  # the sandbox's users and groups by id
_NO_NAMES: Names = ({0: "root"}, {0: "root"})
MAX_NAMED_SANDBOXES = 1024


def _ids(text: str) -> dict[int, str]:
    """``name:x:ID:…`` lines (/etc/passwd, /etc/group) as {id: name}, the first name an id has."""
    named: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit():
            named.setdefault(int(fields[2]), fields[0])
    return named


def _owner(ids: dict[int, str], number: int) -> str:
    return ids.get(number) or ("root" if number == 0 else str(number))


def entry_info(entry: FileEntry, names: Names = _NO_NAMES, metadata: dict[str, str] | None = None) -> pb.EntryInfo:
    seconds = int(entry.mtime)
    return pb.EntryInfo(metadata=metadata or {},
        name=entry.name, type=_TYPES.get(entry.type, pb.FileType.UNSPECIFIED), path=entry.path, size=entry.size,
        mode=entry.mode, permissions=_KINDS[entry.type] + stat_bits.filemode(entry.mode)[1:],
        owner=_owner(names[0], entry.uid), group=_owner(names[1], entry.gid),
        modified_time=Timestamp(seconds=seconds, nanos=int((entry.mtime - seconds) * 1e9)),
        symlink_target=entry.target, is_symlink=entry.type == "symlink")


_EVENT_TYPES = {"create": pb.EventType.CREATE, "write": pb.EventType.WRITE, "remove": pb.EventType.REMOVE,
                "rename": pb.EventType.RENAME, "chmod": pb.EventType.CHMOD}


def _event(event: FsEvent) -> pb.FilesystemEvent:
    return pb.FilesystemEvent(name=event.name, type=_EVENT_TYPES[event.type])


def _call_errors(exc: DSecError) -> ConnectError:
    return rpc_error(exc)


Snapshot = dict[str, tuple[str, int, float]]  # relative name -> (type, size, mtime)


@dataclass
class _Watcher:
    sandbox_id: str
    path: str
    recursive: bool
    seen: Snapshot


async def _look(target: Target, path: str, recursive: bool) -> Snapshot:
    seen: Snapshot = {}
    dirs, listed = [path], 0
    while dirs and listed < MAX_WATCHED_DIRS:
        here = dirs.pop()
        listed += 1
        try:
            entries = await target.edge.list_dir(target.sandbox_id, here)
        except SandboxFileNotFound:
            if here == path:
                raise
            continue  # gone between two looks
        for e in entries:
            name = posixpath.relpath(e.path, path)
            seen[name] = (e.type, e.size, e.mtime)
            if recursive and e.type == "dir":
                dirs.append(e.path)
    return seen


def _changes(before: Snapshot, after: Snapshot) -> list[pb.FilesystemEvent]:
    events = [pb.FilesystemEvent(name=n, type=pb.EventType.REMOVE) for n in sorted(before.keys() - after.keys())]
    for name in sorted(after):
        if name not in before:
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.CREATE))
            if after[name][0] == "file" and after[name][1] > 0:
                events.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
        elif before[name] != after[name] and after[name][0] != "dir":
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
    return events


class FilesystemService:
    """The ``filesystem.Filesystem`` service (``e2b.envd.filesystem.filesystem_connect``)."""

    def __init__(self, envd: EnvdContext) -> None:
        self.envd = envd
        self.watchers: OrderedDict[str, _Watcher] = OrderedDict()
        self._named: OrderedDict[str, Names] = OrderedDict()
        # (sandbox, watcher id) -> the path of a node watch whose events carry their entries
        self.entries: OrderedDict[tuple[str, str], str] = OrderedDict()  # sandbox id -> its users' and groups' names

    async def _names(self, target: Target) -> Names:
        """The sandbox's user and group names (its /etc/passwd and /etc/group, read once a
        sandbox), as envd names a file's owner and group."""
        names = self._named.get(target.sandbox_id)
        if names is None:
            try:
                users = (await target.edge.read_file(target.sandbox_id, "/etc/passwd")).decode(errors="replace")
                groups = (await target.edge.read_file(target.sandbox_id, "/etc/group")).decode(errors="replace")
                names = (_ids(users), _ids(groups))
            except DSecError:
                names = _NO_NAMES
            self._named[target.sandbox_id] = names
            while len(self._named) > MAX_NAMED_SANDBOXES:
                self._named.popitem(last=False)
        return names

    async def _metadata(self, target: Target, paths: list[str]) -> list[dict[str, str]]:
        """Each path's metadata (envd ≥ 0.6.2: ``user.e2b.*`` attributes); none on a VM."""
        if not paths:
            return []
        try:
            return await target.edge.get_xattrs(target.sandbox_id, paths, METADATA_XATTRS)
        except InvalidRequest:
            return [{} for _ in paths]

    async def _info(self, target: Target, entry: FileEntry) -> pb.EntryInfo:
        """``entry`` as envd tells it: owners by name, its metadata."""
        return entry_info(entry, await self._names(target), (await self._metadata(target, [entry.path]))[0])

    async def _stat(self, target: Target, path: str) -> FileEntry:
        return await target.edge.stat_path(target.sandbox_id, path)

    async def stat(self, request: pb.StatRequest, ctx) -> pb.StatResponse:
        target = self.envd.target(ctx)
        try:
            entry = await self._stat(target, target.path(request.path))
            info = await self._info(target, entry)
            if entry.type == "symlink" and entry.target:  # envd: the type of what it points to
                pointed = posixpath.normpath(posixpath.join(posixpath.dirname(entry.path), entry.target))
                info.symlink_target = pointed
                try:
                    info.type = _TYPES.get((await self._stat(target, pointed)).type, pb.FileType.UNSPECIFIED)
                    info.is_symlink = False  # (the SDK would report SYMLINK over the type; the target says it)
                except SandboxFileNotFound:
                    pass  # dangling: a symlink it stays
            return pb.StatResponse(entry=info)
        except DSecError as exc:
            raise _call_errors(exc) from None

    async def make_dir(self, request: pb.MakeDirRequest, ctx) -> pb.MakeDirResponse:
        target = self.envd.target(ctx)
        try:
            path = target.path(request.path)
            try:
                await self._stat(target, path)
            except SandboxFileNotFound:
                pass
            else:
                raise ConnectError(Code.ALREADY_EXISTS, f"path '{path}' already exists")
            await target.edge.make_dir(target.sandbox_id, path)
            return pb.MakeDirResponse(entry=await self._info(target, await self._stat(target, path)))
        except DSecError as exc:
            raise _call_errors(exc) from None

    async def move(self, request: pb.MoveRequest, ctx) -> pb.MoveResponse:
        target = self.envd.target(ctx)
        try:
            src, dst = target.path(request.source), target.path(request.destination)
            await target.edge.rename_path(target.sandbox_id, src, dst)
            return pb.MoveResponse(entry=await self._info(target, await self._stat(target, dst)))
        except DSecError as exc:
            raise _call_errors(exc) from None

    async def list_dir(self, request: pb.ListDirRequest, ctx) -> pb.ListDirResponse:
        target = self.envd.target(ctx)
        depth = max(1, request.depth or 1)
        try:
            path = target.path(request.path)
            if (await self._stat(target, path)).type != "dir":
                raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
            names = await self._names(target)
            found: list[FileEntry] = []
            level = [path]
            for _ in range(depth):
                below = []
                for here in level:
                    for e in await target.edge.list_dir(target.sandbox_id, here):
                        found.append(e)
                        if e.type == "dir":
                            below.append(e.path)
                level = below
            # envd's walk: each directory followed by what is in it, by name
            found.sort(key=lambda e: e.path.split("/"))
            metadata = await self._metadata(target, [e.path for e in found])
            return pb.ListDirResponse(entries=[entry_info(e, names, m) for e, m in zip(found, metadata)])
        except DSecError as exc:
            raise _call_errors(exc) from None

    async def remove(self, request: pb.RemoveRequest, ctx) -> pb.RemoveResponse:
        target = self.envd.target(ctx)
        try:
            await target.edge.remove_path(target.sandbox_id, target.path(request.path), True)
            return pb.RemoveResponse()
        except SandboxFileNotFound:
            return pb.RemoveResponse()  # envd's remove is rm -rf's: nothing there is no error
        except DSecError as exc:
            raise _call_errors(exc) from None

    async def _watched(self, target: Target, path: str) -> str:
        full = target.path(path)
        if (await self._stat(target, full)).type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{full}' is not a directory")
        return full

    async def _node_watch(self, target: Target, path: str, recursive: bool) -> WatchInfo | None:
        """The node's inotify watch of ``path`` (a container's), or None where the node cannot
        watch (a VM's files): then the listing is polled."""
        if (await target.edge.get(target.sandbox_id)).kind != "container":
            return None
        return await target.edge.open_watch(target.sandbox_id, OpenWatchRequest(path=path, recursive=recursive))

    async def watch_dir(self, request: pb.WatchDirRequest, ctx) -> AsyncIterator[pb.WatchDirResponse]:
        target = self.envd.target(ctx)
        try:
            path = await self._watched(target, request.path)
            watch = await self._node_watch(target, path, request.recursive)
            seen = await _look(target, path, request.recursive) if watch is None else {}
        except DSecError as exc:
            raise _call_errors(exc) from None
        yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
        if watch is not None:
            try:
                while True:
                    try:
                        answer = await target.edge.watch_events(target.sandbox_id, watch.id, NODE_WAIT_S)
                    except DSecError as exc:
                        raise _call_errors(exc) from None
                    for event in answer.events:
                        told = await self._told(target, path, event, request.include_entry)
                        yield pb.WatchDirResponse(event=Oneof("filesystem", told))
                    if answer.ended:
                        return  # the directory itself went: envd ends the watch too
            finally:
                with contextlib.suppress(DSecError):
                    await target.edge.close_watch(target.sandbox_id, watch.id)
        while True:
            await asyncio.sleep(POLL_S)
            try:
                now = await _look(target, path, request.recursive)
            except SandboxFileNotFound:
                return
            except DSecError as exc:
                raise _call_errors(exc) from None
            for event in _changes(seen, now):
                yield pb.WatchDirResponse(event=Oneof("filesystem", event))
            seen = now

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx) -> pb.CreateWatcherResponse:
        target = self.envd.target(ctx)
        try:
            path = await self._watched(target, request.path)
            watch = await self._node_watch(target, path, request.recursive)
            if watch is not None:  # held by the node: any apiserver answers for it
                watcher_id = f"{_NODE_WATCH}{watch.id}"
                if request.include_entry:  # (this apiserver adds the entries: it keeps the path)
                    self.entries[(target.sandbox_id, watcher_id)] = path
                    while len(self.entries) > MAX_WATCHERS:
                        self.entries.popitem(last=False)
                return pb.CreateWatcherResponse(watcher_id=watcher_id)
            seen = await _look(target, path, request.recursive)
        except DSecError as exc:
            raise _call_errors(exc) from None
        watcher_id = secrets.token_hex(8)
        self.watchers[watcher_id] = _Watcher(target.sandbox_id, path, request.recursive, seen)
        while len(self.watchers) > MAX_WATCHERS:
            self.watchers.popitem(last=False)
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, target: Target, watcher_id: str) -> _Watcher:
        watcher = self.watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != target.sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id!r} not found")
        return watcher

    async def _told(self, target: Target, path: str | None, event: FsEvent, include_entry: bool) -> pb.FilesystemEvent:
        """A node's watch event as envd's, with the entry it names where asked and it still is."""
        told = _event(event)
        if include_entry and path is not None and event.type != "remove":
            try:
                told.entry = await self._info(target, await self._stat(target, posixpath.join(path, event.name)))
            except DSecError:
                pass  # gone since: envd's entries are best-effort too
        return told

    @staticmethod
    def _node_watch_id(watcher_id: str) -> int | None:
        number = watcher_id.removeprefix(_NODE_WATCH)
        return int(number) if watcher_id.startswith(_NODE_WATCH) and number.isdigit() and len(number) < 10 else None

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx) -> pb.GetWatcherEventsResponse:
        target = self.envd.target(ctx)
        node_watch = self._node_watch_id(request.watcher_id)
        try:
            if node_watch is not None:
                answer = await target.edge.watch_events(target.sandbox_id, node_watch, 0.0)
                path = self.entries.get((target.sandbox_id, request.watcher_id))
                return pb.GetWatcherEventsResponse(events=[await self._told(target, path, e, path is not None)
                                                           for e in answer.events])
            watcher = self._watcher(target, request.watcher_id)
            now = await _look(target, watcher.path, watcher.recursive)
        except SessionClosed:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found") from None
        except DSecError as exc:
            raise _call_errors(exc) from None
        events, watcher.seen = _changes(watcher.seen, now), now
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx) -> pb.RemoveWatcherResponse:
        target = self.envd.target(ctx)
        node_watch = self._node_watch_id(request.watcher_id)
        if node_watch is not None:
            self.entries.pop((target.sandbox_id, request.watcher_id), None)
            try:
                await target.edge.close_watch(target.sandbox_id, node_watch)
            except SessionClosed:
                raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found") from None
            except DSecError as exc:
                raise _call_errors(exc) from None
            return pb.RemoveWatcherResponse()
        self._watcher(target, request.watcher_id)
        del self.watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()
