"""Pulling many images at once from a registry: each blob fetched once, each layer converted once.

A training job's task images share their bases: 32 images may be one 400 MB base and 32 small
layers of their own. ``pull_many`` takes them as one batch:

1. **Fetch.** ``skopeo copy`` of each image into an OCI layout of its own, its blobs in one
   directory shared by the batch (``--dest-shared-blob-dir``: a blob already there is not fetched
   again). The first image goes alone, so the base it brings is there for the others, which then
   run ``concurrency`` at a time.
2. **Group.** Each image's layers (bottom first) are cut into groups, each group one EROFS layer
   in the store. Consecutive small layers are merged while a group stays under ``merge_below``
   compressed bytes, as an import merges them, but never across a point where the images of the
   batch part ways (a base's last layer and the first layer of one image's own), and never past
   the start of a group an earlier pull already converted: those are taken as they are. A
   converted group is remembered in the store (``pulled/<first layer>/<key>.json``: the group's
   layers, whether it is an image's bottom, and the store layer it became), so later pulls share
   it too; an entry whose layer GC has removed is dropped.
3. **Convert.** Each distinct group of the batch once, ``concurrency`` at a time (from the CLI
   in forked processes, one a core: ``_workers``): its layers applied in order into a directory
   (whiteouts converted; in RAM when it fits: ``_scratch``; the first into the empty directory by
   GNU tar, each member checked first: ``untar``), then ``store.add_dir``. The first
   image's bottom layer (a batch's shared base, most of the work) is applied already while the
   other images are fetched (``_apply_head``), and its group goes on from there.
4. **Record.** Each image with its groups' layers, env, working directory and user.

One image's failure (a reference the registry does not have, a corrupt layer) is that image's
result; the others are pulled. ``on_event(name, stage, done, total)`` tells the caller where each
image is (``fetching``, ``converting`` with groups done of its total, ``done``, ``failed``), for a
progress bar per image.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .sources import DEFAULT_MERGE_BELOW, _drop_markers, apply_layer
from .store import Image, InvalidRequest, LayerBuildError, LayerStore, check_name

Event = Callable[[str, str, int, int], None]
LAYER_MEDIA_SUFFIXES = ("tar", "tar+gzip", "tar.gzip", "tar+zstd")


@dataclass
class Layout:
    """One fetched image: its layers (digest, compressed size), bottom first, and its config."""

    layers: list[tuple[str, int]]
    env: dict[str, str]
    workdir: str
    user: str


@dataclass(frozen=True)
class Group:
    layers: tuple[str, ...]   # blob digests, bottom first
    bottom: bool              # the image's lowest group: its deletion markers are dropped

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.bottom, list(self.layers)]).encode()).hexdigest()[:32]


@dataclass
class _Pull:
    name: str
    ref: str
    layout: Layout | None = None
    groups: list[Group] = field(default_factory=list)
    error: LayerBuildError | None = None


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise LayerBuildError(f"unsupported or malformed blob digest {digest!r}")
    return hexpart


class Converted:
    """The groups earlier pulls converted, kept in the store under ``pulled/``."""

    def __init__(self, store: LayerStore) -> None:
        self.store = store
        self.root = store.root / "pulled"

    def starting_with(self, digest: str, bottom: bool) -> list[tuple[Group, str]]:
        """Known groups whose first layer is ``digest`` (and whose store layer is still there)."""
        d = self.root / _hex(digest)
        found = []
        try:
            entries = list(d.iterdir())
        except FileNotFoundError:
            return []
        for path in entries:
            try:
                entry = json.loads(path.read_text())
                group, layer = Group(tuple(entry["layers"]), bool(entry["bottom"])), str(entry["layer"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if group.bottom != bottom:
                continue
            if not self.store.has_layer(layer):
                path.unlink(missing_ok=True)  # GC took it: convert again when asked
                continue
            found.append((group, layer))
        return found

    def remember(self, group: Group, layer: str) -> None:
        d = self.root / _hex(group.layers[0])
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{group.key}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(json.dumps({"layers": list(group.layers), "bottom": group.bottom, "layer": layer}))
        os.replace(tmp, d / f"{group.key}.json")


def read_layout(layout: Path) -> Layout:
    """The layers and config of the one image in an OCI layout whose blobs are in ``blobs``."""
    try:
        index = json.loads((layout / "index.json").read_text())
        entries = index.get("manifests") or []
        if not entries:
            raise LayerBuildError("the pulled image's index lists no manifest")
        blobs = _blobs_dir(layout)
        manifest = json.loads((blobs / _hex(entries[0]["digest"])).read_text())
        config = json.loads((blobs / _hex(manifest["config"]["digest"])).read_text()) if manifest.get("config") else {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LayerBuildError(f"cannot read the pulled image: {exc}") from exc
    layers = []
    for layer in manifest.get("layers") or []:
        media = str(layer.get("mediaType", ""))
        if not media.endswith(LAYER_MEDIA_SUFFIXES) and "tar" not in media:
            raise LayerBuildError(f"layer {layer.get('digest')} is {media!r}, not a tar layer")
        layers.append((str(layer["digest"]), int(layer.get("size") or 0)))
    if not layers:
        raise LayerBuildError("the pulled image has no layers")
    cfg = (config.get("config") or {}) if isinstance(config, dict) else {}
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
    return Layout(layers=layers, env=env, workdir=cfg.get("WorkingDir") or "/", user=cfg.get("User") or "root")


def _blobs_dir(layout: Path) -> Path:
    shared = layout.parent.parent / "blobs" / "sha256"
    return shared if shared.is_dir() else layout / "blobs" / "sha256"


def plan_groups(pulls: list[_Pull], converted: Converted, merge_below: int) -> None:
    """Cut each fetched image's layers into groups (module docstring, step 2). The groups
    earlier pulls converted are read once per first layer for the whole plan (the images of a
    batch ask about the same base layers again and again)."""
    known: dict[tuple[str, bool], list[tuple[Group, str]]] = {}

    def starting_with(digest: str, bottom: bool) -> list[tuple[Group, str]]:
        if (digest, bottom) not in known:
            known[digest, bottom] = converted.starting_with(digest, bottom)
        return known[digest, bottom]

    # How many images of the batch begin with each prefix: where that count changes, they part ways.
    sharing: dict[tuple[str, ...], int] = {}
    for p in pulls:
        if p.layout is not None:
            digests = tuple(d for d, _ in p.layout.layers)
            for i in range(1, len(digests) + 1):
                sharing[digests[:i]] = sharing.get(digests[:i], 0) + 1
    for p in pulls:
        if p.layout is None:
            continue
        digests = [d for d, _ in p.layout.layers]
        sizes = dict(p.layout.layers)
        i = 0
        while i < len(digests):
            bottom = i == 0
            done = _known_at(starting_with(digests[i], bottom), digests, i, sizes, merge_below)
            if done is not None:
                p.groups.append(done)
                i += len(done.layers)
                continue
            j, size = i + 1, sizes[digests[i]]
            stop = _partial_end(starting_with(digests[i], bottom), digests, i)
            while j < len(digests) and j != stop:
                if sharing[tuple(digests[:j])] != sharing[tuple(digests[:j + 1])]:
                    break  # the batch's images part ways after layer j - 1
                if size + sizes[digests[j]] >= merge_below:
                    break
                if starting_with(digests[j], False):
                    break  # a group an earlier pull converted starts here: keep it reusable
                size += sizes[digests[j]]
                j += 1
            p.groups.append(Group(tuple(digests[i:j]), bottom))
            i = j


def _known_at(candidates: list[tuple[Group, str]], digests: list[str], i: int, sizes: dict[str, int],
              merge_below: int) -> Group | None:
    """The longest group converted before that these layers begin with at ``i`` and that the
    merge policy allows (one layer, or under ``merge_below`` together)."""
    best = None
    for group, _ in candidates:
        n = len(group.layers)
        if tuple(digests[i:i + n]) != group.layers:
            continue
        if n > 1 and sum(sizes[d] for d in group.layers) >= merge_below:
            continue
        if best is None or n > len(best.layers):
            best = group
    return best


def _partial_end(candidates: list[tuple[Group, str]], digests: list[str], i: int) -> int:
    """Where a known group that these layers only partly match stops matching (a base an
    earlier pull merged with that image's own layer): a boundary there makes the shared part a
    group of its own, which later pulls then reuse. -1 when there is none."""
    end = -1
    for group, _ in candidates:
        n = 0
        while n < len(group.layers) and i + n < len(digests) and group.layers[n] == digests[i + n]:
            n += 1
        if 0 < n < len(group.layers):
            end = max(end, i + n)
    return end


# Unpacked, a gzip layer is about this many times its size: the scratch space a conversion takes.
UNPACKED_RATIO = 4
SHM = Path("/dev/shm")


def _scratch(store: LayerStore, compressed: int, at_once: int) -> Path:
    """Where a group is unpacked before it becomes a layer: RAM (/dev/shm) when it fits with room
    to spare (a quarter of available memory and half of /dev/shm's free space, for ``at_once``
    conversions at a time), else the store's own scratch space. Unpacking into RAM takes half the
    time of unpacking to a busy disk, and the tree is thrown away once ``mkfs.erofs`` has read it."""
    need = compressed * UNPACKED_RATIO * at_once
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        st = os.statvfs(SHM)
        free = st.f_bavail * st.f_frsize
    except (OSError, StopIteration, ValueError):
        return store.tmp_dir
    return SHM if need <= available // 4 and need <= free // 2 else store.tmp_dir


def _convert(store: LayerStore, blobs: Path, group: Group, scratch: Path, start: Path | None = None) -> str:
    """The group's layers applied in order into a directory, made a store layer. ``start``: a
    directory of its own (removed here) whose ``root`` holds the group's first layer applied
    already (``_apply_head``)."""
    work = start if start is not None else Path(tempfile.mkdtemp(dir=scratch, prefix="dsec-pull-"))
    try:
        root = work / "root"
        if start is None:
            root.mkdir()
        for digest in group.layers[1 if start is not None else 0:]:
            _apply(blobs, digest, root)
        if group.bottom:
            _drop_markers(root)
        return store.add_dir(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _apply(blobs: Path, digest: str, root: Path) -> None:
    try:
        with open(blobs / _hex(digest), "rb") as blob:
            apply_layer(blob, root)
    except FileNotFoundError:
        raise LayerBuildError(f"layer {digest} was not fetched") from None
    except LayerBuildError as exc:
        raise LayerBuildError(f"layer {digest}: {exc}") from None


def _apply_head(blobs: Path, digest: str, scratch: Path) -> Path:
    """The first image's bottom layer applied into a directory of its own under ``scratch``
    (as ``_convert`` lays one out), while the batch's other images are still being fetched:
    the group it starts is known only once all are, and ``_convert`` goes on from it."""
    work = Path(tempfile.mkdtemp(dir=scratch, prefix="dsec-pull-"))
    try:
        (work / "root").mkdir()
        _apply(blobs, digest, work / "root")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return work


_stores: dict[str, LayerStore] = {}


def _convert_in_worker(root: str, blobs: str, group: Group, scratch: str, start: str | None) -> str:
    """``_convert`` in a conversion process (``pull_many(processes=True)``): the store opened
    there once (its index connection is that process's own)."""
    store = _stores.get(root)
    if store is None:
        store = _stores[root] = LayerStore(Path(root))
    return _convert(store, Path(blobs), group, Path(scratch), Path(start) if start else None)


def _skopeo_argv(authfile: Path | None, insecure: bool) -> list[str]:
    if shutil.which("skopeo") is None:
        raise LayerBuildError("skopeo not found: install it (scripts/setup-host.sh does)")
    argv = ["skopeo", "copy", "--quiet", "--override-os", "linux", "--override-arch", "amd64"]
    if authfile is not None:
        if not Path(authfile).is_file():
            raise LayerBuildError(f"no auth file at {authfile}")
        argv += ["--src-authfile", str(authfile)]
    if insecure:
        argv.append("--src-tls-verify=false")
    return argv


@contextmanager
def _workers(n: int) -> Iterator[ProcessPoolExecutor | None]:
    """``n`` conversion processes (forked at once), or None under two. Applying a layer
    is Python's work in good part (reading its headers; ``tarfile`` writing the members of a
    layer above another) and holds the GIL: threads of one process convert one layer at a
    time, so on a 2-core machine a base's conversion and 32 small layers' took turns."""
    if n < 2:
        yield None
        return
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        # Forked now, all of them (a fork pool starts every worker at its first task), while this
        # thread is the only one: forked later, from a thread while another was starting
        # mkfs.erofs or skopeo, a worker kept that Popen's exec-error pipe open, and the Popen
        # waited for its end for ever (a pull --many that hung).
        pool.submit(int).result()
        yield pool


def pull_many(store: LayerStore, wanted: list[tuple[str, str]], *, authfile: Path | None = None,
              insecure: bool = False, merge_below: int = DEFAULT_MERGE_BELOW, concurrency: int = 4,
              on_event: Event | None = None, processes: bool = False) -> list[Image | LayerBuildError]:
    """Pull ``(name, reference)`` pairs; for each, its image or the error that stopped it.
    ``processes``: convert in up to ``concurrency`` forked processes (one a core) rather than
    threads; for a process whose other threads take no locks a forked child needs (the CLI),
    not a server's."""
    from .registry import PULL_TIMEOUT_S, _reference, _run

    def event(name: str, stage: str, done: int = 0, total: int = 0) -> None:
        if on_event is not None:
            on_event(name, stage, done, total)

    names = [n for n, _ in wanted]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise LayerBuildError(f"image name {dup!r} is asked for twice in one pull")
    argv = _skopeo_argv(authfile, insecure)
    pulls = []
    for name, ref in wanted:
        p = _Pull(name, ref)
        try:
            check_name(name)
            p.ref = _reference(ref)
        except InvalidRequest as exc:
            p.error = exc if isinstance(exc, LayerBuildError) else LayerBuildError(str(exc))
        pulls.append(p)
    concurrency = max(1, concurrency)
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    converted = Converted(store)
    todo = [(i, p) for i, p in enumerate(pulls) if p.error is None]
    workers = min(concurrency, os.cpu_count() or 1) if processes and len(todo) > 1 else 0
    # The first image's bottom layer, applied while the others are fetched: (its digest, the
    # directory it is applied in), taken by the one group that starts with it.
    head: list[tuple[str, Future]] = []
    with tempfile.TemporaryDirectory(dir=store.tmp_dir, prefix="pull-") as work, \
            ThreadPoolExecutor(1) as ahead, _workers(workers) as procs:
        blobs = Path(work, "blobs")
        (blobs / "sha256").mkdir(parents=True)

        def fetch(index: int, p: _Pull) -> None:
            if p.error is not None:
                return
            event(p.name, "fetching")
            layout = Path(work, "layouts", str(index))
            layout.parent.mkdir(parents=True, exist_ok=True)
            try:
                _run([*argv, "--dest-shared-blob-dir", str(blobs), f"docker://{p.ref}", f"oci:{layout}:image"],
                     f"pulling {p.ref}", PULL_TIMEOUT_S)
                p.layout = read_layout(layout)
            except LayerBuildError as exc:
                p.error = exc

        try:
            if todo:
                fetch(*todo[0])  # alone: the base it brings is then there for the rest
                first = todo[0][1].layout
                if first is not None and len(todo) > 1 and not converted.starting_with(first.layers[0][0], True):
                    digest, size = first.layers[0]
                    head.append((digest, ahead.submit(_apply_head, blobs / "sha256", digest,
                                                      _scratch(store, size, concurrency))))
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda ip: fetch(*ip), todo[1:]))
            for p in pulls:
                if p.error is not None:
                    event(p.name, "failed")
            return _convert_all(store, pulls, blobs / "sha256", converted, merge_below, concurrency, head, procs,
                                event)
        finally:
            for _, tree in head:  # not taken: no group started with it after all
                with contextlib.suppress(Exception):
                    shutil.rmtree(tree.result(), ignore_errors=True)


def _convert_all(store: LayerStore, pulls: list[_Pull], blobs: Path, converted: Converted, merge_below: int,
                 concurrency: int, head: list[tuple[str, Future]], procs: ProcessPoolExecutor | None,
                 event: Callable[..., None]) -> list[Image | LayerBuildError]:
    """Steps 2 to 4 of the module docstring, once every image is fetched (or has failed)."""
    plan_groups(pulls, converted, merge_below)
    made: dict[str, Future] = {}
    lock = threading.Lock()
    remaining = {p.name: len(p.groups) for p in pulls if p.layout is not None}

    def convert(group: Group) -> str:
        known = [layer for g, layer in converted.starting_with(group.layers[0], group.bottom) if g == group]
        if known:
            return known[0]
        sizes = sum((blobs / _hex(d)).stat().st_size for d in group.layers)
        scratch = _scratch(store, sizes, concurrency)
        start = None
        with lock:
            if head and group.bottom and head[0][0] == group.layers[0]:
                start = head.pop()[1]
        start_dir = start.result() if start is not None else None  # (raises the layer's error)
        try:
            if procs is None or start_dir is not None:  # (the head's group goes on where it began, unqueued)
                layer = _convert(store, blobs, group, scratch, start_dir)
            else:
                layer = procs.submit(_convert_in_worker, str(store.root), str(blobs), group, str(scratch),
                                     str(start_dir) if start_dir else None).result()
        except BrokenExecutor as exc:
            raise LayerBuildError(f"the process converting layer {group.layers[0]} died: {exc}") from None
        finally:
            if start_dir is not None:  # (``_convert`` removes it; not if it never ran)
                shutil.rmtree(start_dir, ignore_errors=True)
        converted.remember(group, layer)
        return layer

    with ThreadPoolExecutor(concurrency) as pool:
        for p in pulls:
            if p.layout is None:
                continue
            event(p.name, "converting", 0, len(p.groups))
            for group in p.groups:
                with lock:
                    if group.key not in made:
                        made[group.key] = pool.submit(convert, group)

                def done(_f: Future, p: _Pull = p) -> None:
                    with lock:
                        remaining[p.name] -= 1
                        left = remaining[p.name]
                    event(p.name, "converting", len(p.groups) - left, len(p.groups))

                made[group.key].add_done_callback(done)
        results: list[Image | LayerBuildError] = []
        for p in pulls:
            if p.layout is None:
                results.append(p.error or LayerBuildError(f"pulling {p.ref} failed"))
                continue
            try:
                layers = tuple(made[g.key].result() for g in p.groups)
                results.append(store.put_image(Image(name=p.name, layers=layers, env=p.layout.env,
                                                     workdir=p.layout.workdir, user=p.layout.user)))
                event(p.name, "done", len(layers), len(layers))
            except (InvalidRequest, OSError) as exc:
                results.append(LayerBuildError(f"pulling {p.ref}: {exc}"))
                event(p.name, "failed")
    return results
