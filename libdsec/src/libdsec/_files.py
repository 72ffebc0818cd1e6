"""File trees in a sandbox (``sandbox.files``), as the SDK sees them."""

from __future__ import annotations

import asyncio
import os
import shutil
import tarfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from .api_ops import api_route
from ._tarcheck import TarChecker

from .protocol import FileEntry, FileList, FileRemoveRequest, FileRenameRequest, MakeDirRequest

if TYPE_CHECKING:
    from ._client import Sandbox

_TREE_TIMEOUT_S = 3600.0


class SandboxFiles:
    """The sandbox's files, as its user sees them. Paths are absolute, without ``..``; a
    symlink is reported and copied as a link, never followed out of the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _route(self, name: str) -> tuple[str, str]:
        return api_route(name, sandbox_id=self._sandbox.id)

    async def list(self, path: str) -> list[FileEntry]:
        body = await self._sandbox._client._request(*self._route("list_dir"), params={"path": path})
        return FileList.model_validate(body).entries

    async def stat(self, path: str) -> FileEntry:
        body = await self._sandbox._client._request(*self._route("stat_path"), params={"path": path})
        return FileEntry.model_validate(body)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._sandbox._client._request(*self._route("remove_path"),
                                             model=FileRemoveRequest(path=path, recursive=recursive), timeout=600)

    async def make_dir(self, path: str) -> None:
        """Make ``path`` and the directories above it that are missing."""
        await self._sandbox._client._request(*self._route("make_dir"), model=MakeDirRequest(path=path))

    async def rename(self, src: str, dst: str) -> None:
        await self._sandbox._client._request(*self._route("rename_path"), model=FileRenameRequest(src=src, dst=dst))

    async def upload_dir(self, local_dir: str | os.PathLike, path: str) -> None:
        """Copy the local tree ``local_dir`` to ``path`` in the sandbox (made if missing): as
        a tar, links as links, modes kept, owned by the sandbox's user. The tar is streamed
        (chunked) as it is made, and unpacked in the sandbox as it arrives: nothing holds it
        whole on the way."""
        local = Path(local_dir)
        if not local.is_dir():
            raise NotADirectoryError(f"not a local directory: {local}")
        from ._client import _error_of, _unavailable  # (the client imports this module)

        client = self._sandbox._client
        client._guard(*self._route("upload_tree"))
        http = client._streaming_http()
        try:
            response = await http.request(*self._route("upload_tree"), params={"path": path}, content=_tar_of(local),
                                          headers={"content-type": "application/x-tar"}, timeout=_TREE_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise _unavailable([], client.endpoint, exc) from exc
        if response.status_code >= 400:
            raise _error_of(response)

    async def download_dir(self, path: str, local_dir: str | os.PathLike) -> None:
        """Copy the tree at ``path`` in the sandbox to ``local_dir`` (made if missing): a tar
        streamed as the sandbox's ``tar c`` writes it, unpacked here as it arrives with
        Python's ``data`` filter (nothing lands outside ``local_dir``)."""
        local = Path(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        from ._client import _error_of, _unavailable  # (the client imports this module)

        client = self._sandbox._client
        client._guard(*self._route("download_tree_tar"))
        http = client._streaming_http()
        try:
            async with http.stream(*self._route("download_tree_tar"), params={"path": path}, timeout=_TREE_TIMEOUT_S) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_of(response)
                await _untar_into(local, response.aiter_bytes(_CHUNK))
        except httpx.TransportError as exc:
            raise _unavailable([], client.endpoint, exc) from exc

    async def upload_file(self, local_file: str | os.PathLike, path: str, *, mode: int = 0o644) -> None:
        """Copy the local file to ``path`` in the sandbox, streamed (of any size: nothing holds
        it whole on the way into a container); a new file belongs to the sandbox's user."""
        from ._client import _error_of, _unavailable  # (the client imports this module)

        local = Path(local_file)
        if not local.is_file():
            raise FileNotFoundError(f"not a local file: {local}")
        client = self._sandbox._client
        client._guard(*self._route("write_file_stream"))
        try:
            response = await client._streaming_http().request(
                *self._route("write_file_stream"), params={"path": path, "mode": oct(mode)},
                content=_file_chunks(local), headers={"content-type": "application/octet-stream"},
                timeout=_TREE_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise _unavailable([], client.endpoint, exc) from exc
        if response.status_code >= 400:
            raise _error_of(response)

    async def download_file(self, path: str, local_file: str | os.PathLike) -> None:
        """Copy the sandbox's file at ``path`` to ``local_file``, streamed (of any size)."""
        from ._client import _error_of, _unavailable  # (the client imports this module)

        local = Path(local_file)
        client = self._sandbox._client
        client._guard(*self._route("read_file_stream"))
        partial = local.with_name(local.name + ".part")
        try:
            async with client._streaming_http().stream(*self._route("read_file_stream"),
                                               params={"path": path}, timeout=_TREE_TIMEOUT_S) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_of(response)
                with open(partial, "wb") as out:
                    async for chunk in response.aiter_bytes(_CHUNK):
                        out.write(chunk)
            os.replace(partial, local)
        except httpx.TransportError as exc:
            raise _unavailable([], client.endpoint, exc) from exc
        finally:
            partial.unlink(missing_ok=True)


_CHUNK = 1 << 20


# The local tar, when there is one: Python's tarfile takes ~10x as long for a tree of small
# files, both ways (docs/BENCHMARKS.md, "Inside a sandbox").
_TAR = shutil.which("tar")
_UNLIMITED = 1 << 62


async def _file_chunks(local: Path) -> AsyncIterator[bytes]:
    with open(local, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            yield chunk


async def _tar_of(local: Path) -> AsyncIterator[bytes]:
    """A tar of the tree (``./`` and all below it, links as links), read as it is made."""
    if _TAR is None:
        async for chunk in _tar_of_in_python(local):
            yield chunk
        return
    proc = await asyncio.create_subprocess_exec(_TAR, "-c", "-f", "-", "-C", str(local), ".",
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    errors = asyncio.ensure_future(proc.stderr.read())
    try:
        while chunk := await proc.stdout.read(_CHUNK):
            yield chunk
        rc = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if rc != 0:
        raise OSError(f"tar of {local} failed (exit code {rc}): {(await errors).decode(errors='replace')[-300:]}")


async def _tar_of_in_python(local: Path) -> AsyncIterator[bytes]:
    """A PAX tar of the tree's children, made in a thread as it is read (a pipe between)."""
    r, w = os.pipe()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with os.fdopen(w, "wb", buffering=_CHUNK) as out, \
                    tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for child in sorted(local.iterdir()):
                    tar.add(child, arcname=child.name)  # (links are stored as links)
        except BaseException as exc:  # noqa: BLE001 - raised on the reading side
            failure.append(exc)

    thread = threading.Thread(target=produce, name="dsec-upload-tar", daemon=True)
    thread.start()
    try:
        while chunk := await asyncio.to_thread(os.read, r, _CHUNK):
            yield chunk
    finally:
        os.close(r)  # (a writer still writing gets EPIPE and ends)
        await asyncio.to_thread(thread.join)
    if failure and not isinstance(failure[0], BrokenPipeError):
        raise failure[0]


async def _untar_into(local: Path, chunks: AsyncIterator[bytes]) -> None:
    """Unpack a tar arriving as ``chunks`` into ``local``: every member checked as it passes
    (``TarChecker``: what the ``data`` filter refuses never reaches the unpacking), then the
    local ``tar x`` (no owners, modes under the umask, as the filter would), or Python's
    tarfile with the ``data`` filter without one. A stream that breaks off fails it."""
    if _TAR is None:
        await _untar_in_python(local, chunks)
        return
    proc = await asyncio.create_subprocess_exec(_TAR, "-x", "-f", "-", "-C", str(local), "--no-same-owner",
                                                "--no-same-permissions", stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    errors = asyncio.ensure_future(proc.stderr.read())
    try:
        async for chunk in TarChecker(_UNLIMITED).checked(chunks):
            proc.stdin.write(chunk)
            await proc.stdin.drain()
        proc.stdin.close()
        rc = await proc.wait()
    except (BrokenPipeError, ConnectionResetError):
        rc = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if rc != 0:
        raise OSError(f"tar x into {local} failed (exit code {rc}): {(await errors).decode(errors='replace')[-300:]}")


async def _untar_in_python(local: Path, chunks: AsyncIterator[bytes]) -> None:
    r, w = os.pipe()
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            with os.fdopen(r, "rb", buffering=_CHUNK) as source, tarfile.open(fileobj=source, mode="r|") as tar:
                tar.extractall(local, filter="data")
                while source.read(_CHUNK):
                    pass  # (the padding after the end: read, so the writer never blocks on it)
        except BaseException as exc:  # noqa: BLE001 - raised on the feeding side
            failure.append(exc)

    thread = threading.Thread(target=consume, name="dsec-download-tar", daemon=True)
    thread.start()
    writer = os.fdopen(w, "wb", buffering=0)
    try:
        async for chunk in chunks:
            try:
                await asyncio.to_thread(writer.write, chunk)
            except BrokenPipeError:
                break  # the unpacking failed: its error is raised below
    finally:
        writer.close()
        await asyncio.to_thread(thread.join)
    if failure:
        raise failure[0]
