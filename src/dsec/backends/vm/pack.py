"""``pack_diff`` for VMs: the guest's writable layer, streamed out by its agent, becomes a layer.

Both VM kinds root the guest in an overlay whose upper holds everything the VM changed: a
microVM's upper is a tmpfs in guest memory (over its pmem layers), a full VM's is its own ext4
disk (over the image's disk, see ``fullvm``). The host cannot read guest memory, and reading the
full VM's disk from the host would need the guest's filesystem quiesced and a loop device to
mount it; so the guest agent packs the upper itself (op ``pack``, see ``native/agent.c`` and
``guest/pack.sh``):

1. it freezes every command's cgroup, so nothing changes the upper while it is read (the VM's
   own init and the agent keep running);
2. it finds the opaque directories (a directory removed and made again: its lower contents stay
   hidden). That mark is an xattr, which neither busybox's tar carries nor anything in busybox
   reads; instead the agent mounts a throw-away overlay of the upper over a tree that has a probe
   file (a random name) in each of the upper's directories: the probe shows under a directory
   unless that directory or one above it is opaque;
3. it streams ``tar -c`` of the upper over the virtio-serial channel in 1 MiB "part" frames
   (whiteouts are 0/0 character devices, which tar carries as they are), then the probe list,
   and thaws the commands.

The host extracts the tar into the store's scratch space with the checks every untrusted tar
gets (``extract_tar``: no member outside the root, none written through a symlink, no device
node but whiteouts; FIFOs are fine), marks the opaque directories ``trusted.overlay.opaque=y``
as the kernel would have, and from there it is a container's upper: residue scrubbed
(``scrub.residue``), an EROFS layer built (``LayerStore.add_dir``).

What busybox's tar does not carry is lost: xattrs other than the opaque mark (file
capabilities, ACLs) and sub-second mtimes; sockets are skipped; a device node, or a relative
symlink that climbs above the root, makes the pack fail with the member named.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from pathlib import Path

from libdsec import InvalidRequest

from ...images import carry, scrub
from ...images.store import LayerStore, extract_tar
from ..base import PackedDiff
from .agent import AgentChannel

PACK_TIMEOUT_S = 600.0
OPAQUE_XATTR = "trusted.overlay.opaque"


def opaque_dirs(root: Path, probe: str, visible: bytes) -> list[str]:
    """The directories of the extracted upper ``root`` that are opaque, given the paths at which
    the agent saw the probe file: those where it was hidden while it showed in the parent (below
    an opaque directory nothing is seen, and nothing needs to be: the mark above hides it all)."""
    seen = set()
    for path in visible.split(b"\0"):
        rel = os.fsdecode(path)
        if rel.endswith("/" + probe):
            seen.add(os.path.normpath(rel[: -len(probe) - 1]))
    opaque = []
    for dirpath, dirnames, _ in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir not in seen:
            dirnames.clear()  # hidden under an opaque directory
            continue
        for name in dirnames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel not in seen and not os.path.islink(os.path.join(dirpath, name)):
                opaque.append(rel)
    return sorted(opaque)


def layer_from_tar(store: LayerStore, tar_path: Path, probe: str, visible: bytes,
                   once: bool = False) -> tuple[str, list[str]]:
    """Extract the agent's tar, mark its opaque directories, scrub it and add it to the store;
    returns the layer's digest and the scrubbed paths."""
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        root = Path(work, "upper")
        root.mkdir()
        extract_tar(tar_path, root)
        for rel in opaque_dirs(root, probe, visible):
            os.setxattr(root / rel, OPAQUE_XATTR, b"y", follow_symlinks=False)
        skip = scrub.residue(root)
        digest = store.add_dir(root, skip, once=once)
    return digest, sorted("/" + p for p in skip)


def kept_from_tar(store: LayerStore, tar_path: Path, probe: str, visible: bytes,
                  keep: list[str]) -> tuple[str, carry.Carried, list[str]]:
    """The agent's tar as an upper, then a layer of only its entries beneath ``keep`` (for a
    clean copy, ``carry.kept_layer``); returns the layer's digest, what was carried, and the
    system files the whole upper replaced or added (``carry.tampered``)."""
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        root, kept = Path(work, "upper"), Path(work, "kept")
        root.mkdir()
        kept.mkdir()
        extract_tar(tar_path, root)
        for rel in opaque_dirs(root, probe, visible):
            os.setxattr(root / rel, OPAQUE_XATTR, b"y", follow_symlinks=False)
        tampered = carry.tampered(root)
        for path in keep:  # a link on the way, in what the agent changed, is refused as in a container
            walked = root
            for part in [p for p in path.split("/") if p]:
                walked = walked / part
                if walked.is_symlink():
                    raise InvalidRequest(f"keep path {path!r} passes through the symbolic link "
                                         f"/{walked.relative_to(root)} -> {os.readlink(walked)}: links are carried "
                                         f"as links, never followed; name a path without links")
        carried = carry.kept_layer(root, kept, keep)
        digest = store.add_dir(kept)
    return digest, carried, tampered


async def pack_upper(agent: AgentChannel, store: LayerStore, once: bool = False,
                     timeout: float = PACK_TIMEOUT_S) -> PackedDiff:
    """Have the agent stream the upper (see the module docstring) and make a layer of it; the
    answer's ``frozen_s`` is how long the agent held the commands frozen (its ``pack`` request:
    they are thawed once the tar is streamed, before the host extracts it). Raises
    ``AgentFailure`` when the agent could not pack and ``AgentGone`` when it went away."""
    async with _streamed(agent, store, timeout) as (tar_path, probe, visible, frozen_s):
        digest, scrubbed = await asyncio.to_thread(layer_from_tar, store, tar_path, probe, visible, once)
    return PackedDiff(digest, scrubbed, frozen_s)


async def kept_upper(agent: AgentChannel, store: LayerStore, keep: list[str],
                     timeout: float = PACK_TIMEOUT_S) -> tuple[str, carry.Carried, list[str]]:
    """``pack_upper`` of only the paths in ``keep`` (``kept_from_tar``'s answer), for a clean copy."""
    async with _streamed(agent, store, timeout) as (tar_path, probe, visible, _):
        return await asyncio.to_thread(kept_from_tar, store, tar_path, probe, visible, keep)


@contextlib.asynccontextmanager
async def _streamed(agent: AgentChannel, store: LayerStore, timeout: float):
    """The agent's tar of the upper in the store's scratch space (removed after), with the paths
    its probe showed at and how long the request took (the commands' frozen time)."""
    probe = f".dsec-probe-{secrets.token_hex(8)}"
    fd, tar_name = tempfile.mkstemp(dir=store.tmp_dir, suffix=".tar")
    tar_path = Path(tar_name)
    try:
        with os.fdopen(fd, "wb") as sink:
            asked = time.perf_counter()
            visible = await agent.request(f"pack {probe}", timeout=timeout, sink=sink.write)
            frozen_s = time.perf_counter() - asked
        assert isinstance(visible, bytes)
        yield tar_path, probe, visible, frozen_s
    finally:
        tar_path.unlink(missing_ok=True)
