"""File trees in a sandbox (``sandbox.files``), as the SDK sees them."""

from __future__ import annotations

import base64
import os
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ._process import events_of
from .protocol import ExecEvent, FileEntry, FileList, FileRemoveRequest, FileRenameRequest, MakeDirRequest
from .protocol import TreeDownloadRequest

if TYPE_CHECKING:
    from ._client import Sandbox

_TREE_TIMEOUT_S = 3600.0


class SandboxFiles:
    """The sandbox's files, as its user sees them. Paths are absolute, without ``..``; a
    symlink is reported and copied as a link, never followed out of the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _path(self, tail: str) -> str:
        return f"/v1/sandboxes/{self._sandbox.id}/fs/{tail}"

    async def list(self, path: str) -> list[FileEntry]:
        body = await self._sandbox._client._request("GET", self._path("list"), params={"path": path})
        return FileList.model_validate(body).entries

    async def stat(self, path: str) -> FileEntry:
        body = await self._sandbox._client._request("GET", self._path("stat"), params={"path": path})
        return FileEntry.model_validate(body)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._sandbox._client._request("POST", self._path("remove"),
                                             model=FileRemoveRequest(path=path, recursive=recursive), timeout=600)

    async def make_dir(self, path: str) -> None:
        """Make ``path`` and the directories above it that are missing."""
        await self._sandbox._client._request("POST", self._path("mkdir"), model=MakeDirRequest(path=path))

    async def rename(self, src: str, dst: str) -> None:
        await self._sandbox._client._request("POST", self._path("rename"), model=FileRenameRequest(src=src, dst=dst))

    async def upload_dir(self, local_dir: str | os.PathLike, path: str) -> None:
        """Copy the local tree ``local_dir`` to ``path`` in the sandbox (made if missing): as
        a tar, links as links, modes kept, owned by the sandbox's user."""
        local = Path(local_dir)
        if not local.is_dir():
            raise NotADirectoryError(f"not a local directory: {local}")
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for child in sorted(local.iterdir()):
                    tar.add(child, arcname=child.name)  # (links are stored as links)
            spool.seek(0)
            data = spool.read()
        await self._sandbox._client._request("PUT", self._path("tree"), params={"path": path}, content=data,
                                             timeout=_TREE_TIMEOUT_S)

    async def download_dir(self, path: str, local_dir: str | os.PathLike) -> None:
        """Copy the tree at ``path`` in the sandbox to ``local_dir`` (made if missing). It is
        unpacked with Python's ``data`` filter: nothing lands outside ``local_dir``."""
        local = Path(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        client = self._sandbox._client
        client._guard("POST", self._path("tree:download"))
        stream = events_of(client._stream("POST", self._path("tree:download"), TreeDownloadRequest(path=path),
                                          _TREE_TIMEOUT_S, ExecEvent))
        with tempfile.TemporaryFile() as spool:
            rest = ""
            async for event in stream:
                if event.event != "stdout":
                    continue
                text = rest + "".join(event.data.split())
                whole = len(text) - len(text) % 4
                spool.write(base64.b64decode(text[:whole]))
                rest = text[whole:]
            spool.write(base64.b64decode(rest))
            spool.seek(0)
            with tarfile.open(fileobj=spool, mode="r:") as tar:
                tar.extractall(local, filter="data")
