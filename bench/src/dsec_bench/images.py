"""``dsec bench images``: the layer store at production size against a store of ten.

A production week held about 10,000 base images and 100,000 workspaces in one store. This
benchmark generates a store of that shape (``--bases``, ``--workspaces``): one real busybox
layer under every image, each base one small layer of its own above it, each workspace its
base's layers plus one small layer of its own (``/workspace/id``, its number). Beside it, a
store of ten workspaces made the same way. Then, on both, in the same run:

- create latency (p50, p99): real container sandboxes (crun) of random workspaces, one
  ``dsec serve`` per store, no warm pool, the creates alternating between the two servers so
  both see the same machine; each sandbox is checked to read its own ``/workspace/id``;
- builds beside the creates: a build's store work (a new layer and its manifest) every 0.1 s
  on each store, timed;
- what an operator runs: a page of ``image ls`` (plain, and filtered by name and role),
  ``inspect``, ``gc``, ``ls --stats``, and a build's store work (a new layer and manifest), each
  timed in a fresh ``LayerStore`` as a ``dsec image`` command starts with one.

The goal (issue: "create latency with 100,000 workspaces within 1.1× of the same with 10") is
the ratio of the two p50s and of the two p99s.

Generating 110,000 layers with ``mkfs.erofs`` takes half an hour here (10 ms a process), so the
small layers are made from one real one: ``mkfs.erofs`` builds a template layer whose
``id`` file holds sixteen zeros; each layer is the template with those bytes replaced by its
number and the superblock's CRC32C updated, which is exactly what ``mkfs.erofs`` writes for that
tree (the tests compare the two byte for byte, bar the build time). It is named by
``tree_digest`` of the tree it holds, as ``LayerStore.add_dir`` names one, and enters the store
through the store's index as a built layer does.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs
from dsec.images.builders import build_busybox
from dsec.images.store import Image, LayerStore, tree_digest
from dsec.local import LocalServer, leftovers

RESULTS_FILE = "images.json"
SMALL_WORKSPACES = 10
PAGE = 8  # images on a page of ``image ls`` timed at both sizes
_FIXED_NS = 1_700_000_000_000_000_000
_SB_OFFSET = 1024  # EROFS's superblock: its checksum covers it to the end of its block
_SB_CHECKSUM = _SB_OFFSET + 4
_SB_FEATURE_COMPAT = _SB_OFFSET + 8
_SB_BLKSZBITS = _SB_OFFSET + 12
_FEATURE_SB_CHKSUM = 0x1


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC32C as the kernel's ``crc32c(~0, …)`` (no final inversion), which EROFS stores."""
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


class LayerMaker:
    """Small layers of distinct content (``/<kind>/id`` holding a number), made by patching one
    layer ``mkfs.erofs`` built (see the module's docstring)."""

    DIGITS = 16

    def __init__(self, store: LayerStore, kind: str, scratch: Path) -> None:
        self.store, self.kind = store, kind
        self.src = scratch / f"src-{kind}"
        (self.src / kind).mkdir(parents=True, exist_ok=True)
        self.file = self.src / kind / "id"
        self._write(0)
        self.template = store.layer_path(store.add_dir(self.src)).read_bytes()
        zeros = b"0" * self.DIGITS + b"\n"
        if self.template.count(zeros) != 1:
            raise RuntimeError(f"the template layer holds its id {self.template.count(zeros)} times, not once")
        self.offset = self.template.index(zeros)
        self.checked = bool(struct.unpack_from("<I", self.template, _SB_FEATURE_COMPAT)[0] & _FEATURE_SB_CHKSUM)
        self.sb_end = 1 << self.template[_SB_BLKSZBITS]
        if self.checked:
            if crc32c(self._sb(self.template)) != struct.unpack_from("<I", self.template, _SB_CHECKSUM)[0]:
                raise RuntimeError("the template layer's superblock checksum is not the CRC32C this bench computes")
            if self.offset + self.DIGITS > self.sb_end:
                self.checked = False  # the id lies past the checksummed block
        if self.checked:
            # The CRC is affine in its input: the change of one byte at one place is a fixed
            # value, so a new checksum is sixteen table lookups, not a pass over the block.
            n = self.sb_end - _SB_OFFSET
            base = crc32c(bytes(n))
            rel = self.offset - _SB_OFFSET
            self._delta: list[list[int]] = []
            for pos in range(self.DIGITS):
                bits = []
                for bit in range(8):
                    buf = bytearray(n)
                    buf[rel + pos] = 1 << bit
                    bits.append(crc32c(bytes(buf)) ^ base)
                self._delta.append([_xor_bits(bits, v) for v in range(256)])
            self._crc = struct.unpack_from("<I", self.template, _SB_CHECKSUM)[0]

    def _sb(self, data: bytes | bytearray) -> bytes:
        sb = bytearray(data[_SB_OFFSET:self.sb_end])
        sb[4:8] = b"\0\0\0\0"
        return bytes(sb)

    def _write(self, n: int) -> str:
        text = f"{n:0{self.DIGITS}d}"
        self.file.write_text(text + "\n")
        for path in (self.file, self.file.parent, self.src):
            os.utime(path, ns=(_FIXED_NS, _FIXED_NS))
        return text

    def layer_bytes(self, n: int) -> bytes:
        text = f"{n:0{self.DIGITS}d}".encode()
        data = bytearray(self.template)
        data[self.offset:self.offset + self.DIGITS] = text
        if self.checked:
            crc = self._crc
            for pos, ch in enumerate(text):
                crc ^= self._delta[pos][ch ^ 0x30]
            struct.pack_into("<I", data, _SB_CHECKSUM, crc)
        return bytes(data)

    def make(self, n: int) -> str:
        """The layer holding number ``n``, in the store; its digest."""
        self._write(n)
        digest = tree_digest(self.src)
        final = self.store.layer_path(digest)
        if final.exists():
            return digest
        data = self.layer_bytes(n)
        fd, tmp = tempfile.mkstemp(dir=self.store.tmp_dir, suffix=".erofs")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o444)
            self.store.index.layer_placed(digest, len(data), lambda: os.rename(tmp, final))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return digest


def _xor_bits(bits: list[int], v: int) -> int:
    out = 0
    for bit in range(8):
        if v >> bit & 1:
            out ^= bits[bit]
    return out


def generate(root: Path, bases: int, workspaces: int, log=lambda msg: None) -> dict:
    """A store at ``root`` of ``bases`` base images (``base-NNNNN``) and ``workspaces``
    workspaces (``ws-NNNNNN``, over the bases in turn); returns what it took."""
    t0 = time.perf_counter()
    store = LayerStore(root)
    busybox = store.get_image("busybox") if store.has_image("busybox") else build_busybox(store)
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as scratch:
        base_layers, ws_layers = LayerMaker(store, "base", Path(scratch)), LayerMaker(store, "workspace", Path(scratch))
        base_images = []
        for b in range(bases):
            base_images.append(store.put_image(Image(
                name=f"base-{b:05d}", layers=busybox.layers + (base_layers.make(b),),
                roles=busybox.roles + ("base",), env=busybox.env)))
            if b % 1000 == 999:
                log(f"{b + 1} base images")
        for w in range(workspaces):
            base = base_images[w % bases]
            store.put_image(Image(name=f"ws-{w:06d}", layers=base.layers + (ws_layers.make(w),),
                                  roles=base.roles + ("workspace",), env=base.env, workdir="/workspace"))
            if w % 5000 == 4999:
                log(f"{w + 1} workspaces")
    store.index.close()
    return {"bases": bases, "workspaces": workspaces, "seconds": round(time.perf_counter() - t0, 1)}


# -- what an operator runs, timed at both sizes -----------------------------------------------


def _timed(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return {"median_ms": round(statistics.median(times), 3), "max_ms": round(max(times), 3)}


def store_timings(root: Path, workspaces: int, repeat: int, scratch: Path) -> dict:
    rng = random.Random(7)

    def fresh() -> LayerStore:
        return LayerStore(root)

    # A page of PAGE images at both sizes (the small store holds just over PAGE).
    def ls_page() -> None:
        store = fresh()
        after = f"ws-{rng.randrange(workspaces - PAGE):06d}"
        for name in store.index.names(limit=PAGE, after=after):
            store.describe(store.get_image(name))

    def ls_filtered() -> None:
        store = fresh()
        for name in store.index.names(limit=PAGE, prefix="ws-0", role="workspace"):
            store.describe(store.get_image(name))

    def inspect() -> None:
        store = fresh()
        store.describe(store.resolve(f"ws-{rng.randrange(workspaces):06d}"))

    def gc() -> None:
        if fresh().gc():
            raise RuntimeError("gc removed layers of a store where every layer is used")

    def stats() -> None:
        fresh().index.stats()

    built = iter(range(repeat))

    def build() -> None:
        # A build's work in the store: a new layer, then the image naming it over a base.
        store, n = fresh(), next(built)
        src = scratch / f"build-{n}"
        (src / "workspace").mkdir(parents=True)
        (src / "workspace" / "built").write_text(f"{n} {root}\n")
        base = store.get_image("base-00000")
        store.put_image(Image(name=f"built-{n}", layers=base.layers + (store.add_dir(src),),
                              roles=base.roles + ("workspace",)))

    out = {op.__name__: _timed(op, repeat) for op in (ls_page, ls_filtered, inspect, gc, stats, build)}
    store = fresh()
    for n in range(repeat):  # the builds' images and layers go again
        store.remove_image(f"built-{n}")
    store.gc()
    st = store.index.stats()
    out["store"] = {"images": st.images, "distinct_layers": st.distinct_layers, "stored_layers": st.stored_layers,
                    "stored_bytes": st.stored_bytes, "referenced_bytes": st.referenced_bytes}
    store.index.close()
    return out


class ConcurrentBuilds:
    """A build's store work (a new layer, then an image naming it) every ``every_s`` in a
    thread of its own while the creates run, each timed; its images and layers are removed
    when it finishes."""

    def __init__(self, root: Path, scratch: Path, every_s: float = 0.1) -> None:
        self.root, self.scratch, self.every_s = root, scratch, every_s
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"builds {root}", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def _run(self) -> None:
        store = LayerStore(self.root)
        base = store.get_image("base-00000")
        n = 0
        try:
            while not self._stop.wait(self.every_s):
                src = self.scratch / f"b{n}"
                (src / "workspace").mkdir(parents=True)
                (src / "workspace" / "built").write_text(f"{n}\n")
                t = time.perf_counter()
                store.put_image(Image(name=f"cbuild-{n}", layers=base.layers + (store.add_dir(src),),
                                      roles=base.roles + ("workspace",)))
                self.times.append(time.perf_counter() - t)
                shutil.rmtree(src)
                n += 1
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc
        finally:
            for i in range(n):
                store.remove_image(f"cbuild-{i}")
            store.gc()
            store.index.close()

    def finish(self, errors: list[str]) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._error is not None:
            errors.append(f"builds beside the creates ({self.root}): {type(self._error).__name__}: {self._error}")


# -- create latency --------------------------------------------------------------------------


async def _creates(servers: dict[str, LocalServer], workspaces: dict[str, int], creates: int, warmup: int,
                   errors: list[str]) -> dict[str, list[float]]:
    rng = random.Random(11)
    times: dict[str, list[float]] = {label: [] for label in servers}
    clients = {label: DSecClient(s.endpoint, token=s.token, timeout=120) for label, s in servers.items()}
    try:
        for c in clients.values():
            await c.open()
        for i in range(warmup + creates):
            for label in (list(servers) if i % 2 == 0 else list(servers)[::-1]):
                n = rng.randrange(workspaces[label])
                args = DSecContainerRunArgs(container_image=f"ws-{n:06d}", memory_limit_mb=64)
                t = time.perf_counter()
                sandbox = await clients[label].run_container(args)
                took = time.perf_counter() - t
                try:
                    got = (await sandbox.run_shell("cat /workspace/id")).stdout.strip()
                    if got != f"{n:016d}":
                        errors.append(f"{label}: ws-{n:06d} read {got!r} from /workspace/id")
                finally:
                    await sandbox.stop()
                if i >= warmup:
                    times[label].append(took)
    finally:
        for c in clients.values():
            await c.close()
    return times


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))] if xs else float("nan")


def main(state_dir: Path, console: Console, bases: int = 10_000, workspaces: int = 100_000, creates: int = 600,
         warmup: int = 5, repeat: int = 20, keep: bool = False, strict: bool = False) -> int:
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DSEC_VMS", "0")
    sizes = {"small": (1, SMALL_WORKSPACES), "big": (bases, workspaces)}
    dirs = {label: state_dir / label for label in sizes}
    errors: list[str] = []
    res: dict = {"options": {"bases": bases, "workspaces": workspaces, "creates": creates, "repeat": repeat},
                 "generated": {}, "timings": {}, "creates": {}, "concurrent_builds": {}}
    servers: dict[str, LocalServer] = {}
    try:
        for label, (b, w) in sizes.items():
            with console.status(f"generating the {label} store ({b} bases, {w} workspaces) …") as status:
                res["generated"][label] = generate(dirs[label] / "store", b, w, log=status.update)
            console.print(f"generated the {label} store: {b} bases, {w} workspaces in "
                          f"{res['generated'][label]['seconds']} s")
        for label, (_, w) in sizes.items():
            scratch = dirs[label] / "scratch"
            scratch.mkdir(exist_ok=True)
            res["timings"][label] = store_timings(dirs[label] / "store", w, repeat, scratch)
            shutil.rmtree(scratch, ignore_errors=True)
        for label in sizes:
            servers[label] = LocalServer(dirs[label], extra_args=("--pool-max", "0", "--fncall-max", "0"),
                                         start_timeout_s=120).start()
        builders = {label: ConcurrentBuilds(dirs[label] / "store", dirs[label] / "builds") for label in sizes}
        with console.status(f"{creates} creates on each store, alternating, builds beside them …"):
            for builder in builders.values():
                builder.start()
            try:
                times = asyncio.run(_creates(servers, {k: w for k, (_, w) in sizes.items()}, creates, warmup, errors))
            finally:
                for builder in builders.values():
                    builder.finish(errors)
        for label, builder in builders.items():
            res["concurrent_builds"][label] = {"n": len(builder.times),
                                               "median_ms": round(_pct(builder.times, 0.5) * 1000, 2),
                                               "p99_ms": round(_pct(builder.times, 0.99) * 1000, 2)}
        for label, xs in times.items():
            res["creates"][label] = {"n": len(xs), "p50_ms": round(_pct(xs, 0.5) * 1000, 1),
                                     "p99_ms": round(_pct(xs, 0.99) * 1000, 1),
                                     "mean_ms": round(statistics.fmean(xs) * 1000, 1) if xs else None}
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up and checked
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for server in servers.values():
            try:
                server.stop()
            except RuntimeError as exc:
                errors.append(str(exc))
    left = [x for d in dirs.values() if d.exists() for x in leftovers(d)]
    c = res["creates"]
    if "big" in c and "small" in c and c["small"]["n"]:
        res["ratio"] = {"p50": round(c["big"]["p50_ms"] / c["small"]["p50_ms"], 3),
                        "p99": round(c["big"]["p99_ms"] / c["small"]["p99_ms"], 3)}
        res["goal_met"] = res["ratio"]["p50"] <= 1.1 and res["ratio"]["p99"] <= 1.1
    res.update({"errors": errors, "leftovers": left})
    (state_dir / RESULTS_FILE).write_text(json.dumps(res, indent=1) + "\n")
    if not keep:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    _print(console, res)
    code = 1 if errors or left else 0
    if code == 0 and strict and not res.get("goal_met"):
        code = 2
    return code


def _print(console: Console, res: dict) -> None:
    big = res["options"]
    if res["timings"]:
        t = Table("operation", f"{SMALL_WORKSPACES} workspaces", f"{big['workspaces']} workspaces", "ratio",
                  title="the store (median of each, a fresh LayerStore as a command starts with)")
        for op in ("ls_page", "ls_filtered", "inspect", "gc", "stats", "build"):
            s, b = (res["timings"].get(k, {}).get(op, {}).get("median_ms") for k in ("small", "big"))
            if s is not None and b is not None:
                t.add_row(op, f"{s:.2f} ms", f"{b:.2f} ms", f"{b / s:.2f}×" if s else "")
        console.print(t)
        st = res["timings"].get("big", {}).get("store")
        if st:
            console.print(f"big store: {st['images']} images, {st['distinct_layers']} distinct layers, "
                          f"{st['stored_bytes'] / 1e6:.1f} MB stored, {st['referenced_bytes'] / 1e6:.1f} MB referenced")
    c = res["creates"]
    if c:
        t = Table("store", "creates", "p50", "p99", title="create latency (crun, no warm pool)")
        for label in ("small", "big"):
            if label in c:
                t.add_row(label, str(c[label]["n"]), f"{c[label]['p50_ms']} ms", f"{c[label]['p99_ms']} ms")
        console.print(t)
    cb = res.get("concurrent_builds") or {}
    if "small" in cb and "big" in cb:
        console.print(f"builds beside the creates (a layer and a manifest): median {cb['small']['median_ms']} ms "
                      f"with {SMALL_WORKSPACES} workspaces, {cb['big']['median_ms']} ms with {big['workspaces']} "
                      f"({cb['small']['n']} and {cb['big']['n']} builds)")
    if "ratio" in res:
        verdict = "[green]met[/green]" if res["goal_met"] else "[red]missed[/red]"
        console.print(f"goal: create latency with {big['workspaces']} workspaces within 1.1× of {SMALL_WORKSPACES}: "
                      f"p50 {res['ratio']['p50']}×, p99 {res['ratio']['p99']}× {verdict}")
    for e in res["errors"]:
        console.print(f"[red]error:[/red] {e}")
    if res["leftovers"]:
        console.print(f"[red]left behind:[/red] {res['leftovers']}")
