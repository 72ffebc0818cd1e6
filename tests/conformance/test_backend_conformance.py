"""One suite every sandbox backend passes (the fake one included): the lifecycle in
``dsec.backends.base``'s docstring, exec semantics and errors, files, users, recovery."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import pytest

from dsec.backends.base import ExecContext, Handle, SandboxSpec
from dsec.resources.cgroups import Limits
from libdsec import CommandTimeout, InvalidRequest, SandboxFileNotFound, SandboxStateError
from libdsec.protocol import ExecRequest

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})
LIMITS = Limits(memory_mb=64, cpu_cores=0.5, pids=128)


@pytest.fixture(params=["fake", pytest.param("container", marks=[pytest.mark.slow, pytest.mark.root]),
                        pytest.param("microvm", marks=[pytest.mark.slow, pytest.mark.root]),
                        pytest.param("fullvm", marks=[pytest.mark.slow, pytest.mark.root])])
async def kit(request, tmp_path_factory, test_store_lazy):
    """(backend, spec) for one backend kind; checks that the backend left nothing behind."""
    if request.param == "fake":
        from dsec.backends.fake import FakeBackend

        yield FakeBackend(), SandboxSpec(image="busybox", layers=("fake",), env={}, limits=None)
        return
    from dsec._sys import set_child_subreaper
    from dsec.backends.container import ContainerBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers
    from dsec.resources import cgroups

    set_child_subreaper()  # as dsec serve does: sandbox inits are reaped by us, at once
    store_path = test_store_lazy()
    if request.param in ("microvm", "fullvm"):
        async for kit in _vm_kit(request.param, store_path, tmp_path_factory):
            yield kit
        return
    state = tmp_path_factory.mktemp("conformance")
    store = LayerStore(store_path)
    backend = ContainerBackend(state / "node", store, cgroup_parent=cgroups.parent_for(state))
    image = store.get_image("busybox")
    try:
        yield backend, SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    finally:
        await backend.recover([])  # removes whatever a failed test left
        backend.release_unused()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


async def _vm_kit(kind, store_path, tmp_path_factory):
    from dsec.backends.vm.fullvm import FullVMBackend
    from dsec.backends.vm.microvm import MicroVMBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers

    state = tmp_path_factory.mktemp(f"conformance-{kind}")
    store = LayerStore(store_path)
    cls = MicroVMBackend if kind == "microvm" else FullVMBackend
    # Guest kernel and initramfs are shared by every test run, like the test store.
    # KSM is node-wide: the tests leave the host's settings alone.
    # Boot templates as a node keeps them (the run's dir: the first microVM of the run boots,
    # the rest restore its memory; tests/vm/test_microvm.py boots every one).
    templates = os.environ.get("DSEC_VM_TEMPLATES_DIR")
    extra = {"use_ksm": False, "templates_dir": Path(templates) if templates else None} if kind == "microvm" else {}
    backend = cls(state / "node", store, Path(store_path).parent / "vm", boot_timeout_s=90, **extra)
    image = store.get_image("busybox")
    try:
        yield backend, SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    finally:
        await backend.recover([])
        await backend.close()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


@pytest.fixture
def test_store_lazy(request):
    return lambda: request.getfixturevalue("test_store")


def cid() -> str:
    return f"c{secrets.token_hex(8)}"


def run(command: str, **kw) -> ExecRequest:
    return ExecRequest(command=command, **kw)


async def test_create_exec_destroy(kit):
    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        assert await backend.is_alive(handle)
        result = await backend.exec(handle, run("echo hello; exit 3"), ROOT)
        assert (result.exit_code, result.stdout) == (3, "hello\n")
    finally:
        await backend.destroy(handle)
    assert not await backend.is_alive(handle)
    await backend.destroy(handle)  # idempotent
    with pytest.raises(SandboxStateError):
        await backend.exec(handle, run("echo late"), ROOT)


async def test_files(kit):
    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        await backend.write_file(handle, "/tmp/conf.txt", b"payload", 0o644, 0, 0)
        assert await backend.read_file(handle, "/tmp/conf.txt", 1 << 20) == b"payload"
        assert (await backend.exec(handle, run("cat /tmp/conf.txt"), ROOT)).stdout == "payload"
        with pytest.raises(SandboxFileNotFound):
            await backend.read_file(handle, "/tmp/missing", 1 << 20)
        with pytest.raises(InvalidRequest):
            await backend.write_file(handle, "relative.txt", b"x", 0o644, 0, 0)
        if type(backend).__name__ != "FakeBackend":  # (the fake keeps no owners)
            # A new file belongs to the writer; one that exists keeps its owner.
            await backend.write_file(handle, "/tmp/theirs.txt", b"a", 0o644, 1000, 1000)
            await backend.write_file(handle, "/tmp/conf.txt", b"b", 0o644, 1000, 1000)
            owners = await backend.exec(handle, run("stat -c %u /tmp/theirs.txt /tmp/conf.txt"), ROOT)
            assert owners.stdout.split() == ["1000", "0"], owners
    finally:
        await backend.destroy(handle)


async def test_timeout_and_output_cap(kit):
    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        with pytest.raises(CommandTimeout):
            await backend.exec(handle, run("sleep 5", timeout=0.3), ROOT)
        assert await backend.is_alive(handle)
        result = await backend.exec(handle, run("echo 0123456789", max_output_bytes=4), ROOT)
        assert result.stdout == "0123" and result.stdout_truncated and result.stdout_bytes == 11
    finally:
        await backend.destroy(handle)


async def test_users_limits_pause(kit):
    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        assert await backend.resolve_user(handle, "root") == (0, 0)
        assert await backend.resolve_user(handle, "agent") == (1000, 1000)
        assert await backend.resolve_user(handle, "1234:99") == (1234, 99)
        with pytest.raises(InvalidRequest):
            await backend.resolve_user(handle, "nobody-such")
        await backend.apply_limits(handle, LIMITS)
        await backend.pause(handle)
        await backend.resume(handle)
        assert (await backend.exec(handle, run("echo back"), ROOT)).stdout == "back\n"
    finally:
        await backend.destroy(handle)


async def test_halt_keeps_the_files_and_boot_starts_it_afresh(kit):
    """``Capability.REBOOT``: halted, nothing runs and the files stay; recover adopts it; booted,
    it runs again over them (a new boot id where the backend gives one: the fake has none)."""
    from dsec.backends.base import Capability
    from dsec.backends.fake import FakeBackend

    backend, spec = kit
    if Capability.REBOOT not in backend.capabilities:
        pytest.skip(f"{backend.kind} sandboxes cannot start again over their files")
    handle = await backend.create(cid(), spec)
    try:
        await backend.write_file(handle, "/root/kept", b"kept", 0o644, 0, 0)
        boot_id = "cat /proc/sys/kernel/random/boot_id 2>/dev/null"
        before = (await backend.exec(handle, run(boot_id), ROOT)).stdout
        await backend.halt(handle)
        assert handle.pid == 0 and not await backend.is_alive(handle)
        assert [h.cid for h in await backend.recover([handle])] == [handle.cid]
        await backend.boot(handle)
        assert await backend.is_alive(handle)
        assert await backend.read_file(handle, "/root/kept", 1024) == b"kept"
        after = (await backend.exec(handle, run(boot_id), ROOT)).stdout
        if not isinstance(backend, FakeBackend):
            assert before.strip() and after.strip() and after != before
    finally:
        await backend.destroy(handle)


async def test_recover_adopts_live_and_drops_dead(kit):
    backend, spec = kit
    live = await backend.create(cid(), spec)
    dead = await backend.create(cid(), spec)
    try:
        await backend.destroy(dead)
        ghost = Handle(cid=cid(), image=spec.image, layers=spec.layers, pid=0)
        alive = await backend.recover([live, dead, ghost])
        assert [h.cid for h in alive] == [live.cid]
        assert (await backend.exec(live, run("echo still"), ROOT)).stdout == "still\n"
    finally:
        await backend.destroy(live)


async def test_pack_diff(kit):
    """The sandbox's changes as a layer (deletions as whiteouts, residue left out); it runs on."""
    import os
    import stat
    import subprocess
    import tempfile

    from libdsec import BackendError

    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        await backend.exec(handle, run("echo packed > /root/p; rm /bin/vi; echo x > /tmp/junk"), ROOT)
        if not hasattr(backend, "store"):
            with pytest.raises(BackendError, match="cannot pack"):
                await backend.pack_diff(handle)
            return
        started = time.perf_counter()
        packed = await backend.pack_diff(handle)
        digest = packed.digest
        assert "/tmp/junk" in packed.scrubbed
        assert 0 < packed.frozen_s <= time.perf_counter() - started
        assert (await backend.exec(handle, run("cat /root/p"), ROOT)).stdout == "packed\n"
        with tempfile.TemporaryDirectory() as mnt:
            subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(backend.store.layer_path(digest)), mnt], check=True)
            try:
                assert Path(mnt, "root/p").read_text() == "packed\n"
                whiteout = os.stat(Path(mnt, "bin/vi"), follow_symlinks=False)
                assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
                assert not Path(mnt, "tmp/junk").exists()
            finally:
                subprocess.run(["umount", mnt], check=True)
        if digest in backend.store.unreferenced_layers():
            backend.store.remove_layer(digest)
    finally:
        await backend.destroy(handle)
    with pytest.raises(SandboxStateError):
        await backend.pack_diff(handle)


async def test_clean_copy(kit):
    """The changes beneath kept paths only, carried into a new sandbox (containers: ``carry``) or
    made a layer (VMs: ``kept_layer``); residue left out; system files replaced or added seen."""
    import subprocess
    import tempfile

    from libdsec import SandboxFileNotFound

    backend, spec = kit
    source = await backend.create(cid(), spec)
    made = [source]
    try:
        for path, data in (("/root/w/f", b"kept"), ("/root/.ash_history", b"ls"), ("/usr/bin/forged", b"x")):
            await backend.write_file(source, path, data, 0o755, 0, 0)
        keep = ["/root/.ash_history", "/root/w"]
        if hasattr(backend, "carry"):
            await backend.check_kept(source, keep)
            target = await backend.create(cid(), spec)
            made.append(target)
            carried = await backend.carry(source, target, keep)
            assert await backend.read_file(target, "/root/w/f", 1 << 20) == b"kept"
            with pytest.raises(SandboxFileNotFound):
                await backend.read_file(target, "/usr/bin/forged", 1 << 20)
            assert "/usr/bin/forged" in backend.tampered(source)
        else:
            digest, carried, tampered = await backend.kept_layer(source, keep)
            assert "/usr/bin/forged" in tampered
            with tempfile.TemporaryDirectory() as mnt:
                subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(backend.store.layer_path(digest)), mnt], check=True)
                try:
                    assert Path(mnt, "root/w/f").read_bytes() == b"kept"
                    assert not Path(mnt, "usr").exists() and not Path(mnt, "root/.ash_history").exists()
                finally:
                    subprocess.run(["umount", mnt], check=True)
            if digest in backend.store.unreferenced_layers():
                backend.store.remove_layer(digest)
        assert (carried.files, carried.bytes, carried.scrubbed) == (1, 4, ["/root/.ash_history"])
    finally:
        for handle in made:
            await backend.destroy(handle)


class Chunks:
    """An ``emit`` that records (kind, bytes, when) and can be held shut."""

    def __init__(self) -> None:
        import asyncio
        import time

        self.got: list[tuple[str, bytes, float]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.clock = time.perf_counter

    async def __call__(self, kind: str, data: bytes) -> None:
        await self.open.wait()
        self.got.append((kind, data, self.clock()))

    def text(self, kind: str) -> str:
        return b"".join(d for k, d, _ in self.got if k == kind).decode()


async def test_exec_stream_hands_output_on_as_written(kit):
    import time

    backend, spec = kit
    handle = await backend.create(cid(), spec)
    try:
        chunks = Chunks()
        start = time.perf_counter()
        result = await backend.exec_stream(handle, run("echo one; sleep 1; echo two >&2; echo three"), ROOT, chunks)
        end = time.perf_counter()
        assert (result.exit_code, result.stdout, result.stderr) == (0, "one\nthree\n", "two\n")
        assert (chunks.text("stdout"), chunks.text("stderr")) == ("one\nthree\n", "two\n")
        if type(backend).__name__ != "FakeBackend":  # (the fake's output comes at its end)
            first = chunks.got[0]
            assert first[1] == b"one\n" and first[2] - start < end - start - 0.5, (chunks.got, end - start)
        # Caps apply to what is kept, not to what streams past.
        chunks = Chunks()
        result = await backend.exec_stream(handle, run("echo 0123456789", max_output_bytes=4), ROOT, chunks)
        assert (result.stdout, result.stdout_bytes, chunks.text("stdout")) == ("0123", 11, "0123456789\n")
    finally:
        await backend.destroy(handle)


async def test_exec_stream_backpressure_and_timeout(kit):
    """A consumer that does not take the output holds the command (nothing piles up for it)."""
    import asyncio

    backend, spec = kit
    if type(backend).__name__ == "FakeBackend":
        pytest.skip("the fake's commands write no real output")
    handle = await backend.create(cid(), spec)
    try:
        chunks = Chunks()
        chunks.open.clear()
        size = 4 << 20  # over every buffer on the way: the pipe's, the guest agent's window
        call = asyncio.ensure_future(backend.exec_stream(
            handle, run(f"head -c {size} /dev/zero; echo written >&2", max_output_bytes=1000, timeout=60), ROOT, chunks))
        await asyncio.sleep(1.5)
        assert not call.done(), "the command ran to its end with nobody reading"
        chunks.open.set()
        result = await call
        assert result.exit_code == 0 and result.stdout_bytes == size and len(result.stdout) == 1000
        assert result.stdout_truncated and chunks.text("stderr") == "written\n"
        assert sum(len(d) for k, d, _ in chunks.got if k == "stdout") == size
        # A timeout ends a streamed command as it ends any other; what it wrote came through.
        chunks = Chunks()
        with pytest.raises(CommandTimeout):
            await backend.exec_stream(handle, run("echo early; sleep 30", timeout=1), ROOT, chunks)
        assert chunks.text("stdout") == "early\n"
        assert (await backend.exec(handle, run("echo after"), ROOT)).stdout == "after\n"
    finally:
        await backend.destroy(handle)


async def test_background_processes(kit):
    """dsec.edge.processes' scripts on each backend: a process outlives its start, takes stdin
    and signals, streams its output and is listed with its exit code."""
    import asyncio

    from dsec.edge import processes
    from dsec.edge.stream import stream_exec

    backend, spec = kit
    if type(backend).__name__ == "FakeBackend":
        pytest.skip("the fake runs no shell")
    handle = await backend.create(cid(), spec)

    async def manage(script: str, stdin: str | None = None):
        return await backend.exec(handle, run(script, stdin=stdin, timeout=30), ROOT)

    try:
        started = await backend.exec(handle, run(processes.start_script("echo hi; read line; echo got $line >&2; sleep 30")), ROOT)
        pid = processes.started_pid(started)
        [info] = processes.parse_list((await manage(processes.list_script())).stdout)
        assert (info.pid, info.running, info.command) == (pid, True, "echo hi; read line; echo got $line >&2; sleep 30")
        processes.check(await manage(processes.stdin_script(pid, True, True), stdin="there\n"), pid, "write")
        follow = run(processes.follow_script(pid, 0, 0), max_output_bytes=0, timeout=60)
        events = stream_exec(lambda emit: backend.exec_stream(handle, follow, ROOT, emit))
        seen = ""
        async for event in events:
            if event.event == "stderr":
                seen += event.data
                if "got there" in seen:
                    break
        await events.aclose()
        processes.check(await manage(processes.signal_script(pid, 2)), pid, "signal")  # Ctrl-C reaches it
        processes.check(await manage(processes.wait_script(pid)), pid, "wait")
        [info] = processes.parse_list((await manage(processes.list_script())).stdout)
        assert (info.running, info.exit_code, info.stdout_bytes) == (False, 130, 3), info
        with pytest.raises(libdsec_errors().SandboxStateError, match="has exited"):
            processes.check(await manage(processes.signal_script(pid, 2)), pid, "signal it")
        with pytest.raises(libdsec_errors().ProcessNotFound):
            processes.check(await manage(processes.signal_script(1, 9)), 1, "signal it")
        # The whole output again from the start, then the exit code.
        events = [e async for e in stream_exec(lambda emit: backend.exec_stream(handle, follow, ROOT, emit))]
        assert "".join(e.data for e in events if e.event == "stdout") == "hi\n"
        assert events[-1].event == "exit" and events[-1].result.exit_code == 130
        await asyncio.sleep(0)
    finally:
        await backend.destroy(handle)


def libdsec_errors():
    import libdsec

    return libdsec


async def test_session_scripts(kit):
    """dsec.edge.processes' session on each backend: state persists, a timeout interrupts."""
    from dsec.edge import processes

    backend, spec = kit
    if type(backend).__name__ == "FakeBackend":
        pytest.skip("the fake runs no shell")
    handle = await backend.create(cid(), spec)

    async def session_run(pid: int, command: str, timeout: float = 30):
        nonce = secrets.token_hex(4)
        request = run(processes.session_run_script(pid, nonce), timeout=timeout,
                      stdin=processes.session_input(command))
        try:
            return await backend.exec(handle, request, ROOT), nonce
        except CommandTimeout:
            return None, nonce

    try:
        started = await backend.exec(handle, run(processes.start_script(processes.session_command(600))), ROOT)
        pid = processes.started_pid(started)
        await session_run(pid, "true")
        first, _ = await session_run(pid, "cd /tmp && export A=1; echo set")
        assert (first.exit_code, first.stdout) == (0, "set\n"), first
        later, _ = await session_run(pid, "pwd; echo $A >&2; exit_code_is() { return $1; }; exit_code_is 4")
        assert (later.exit_code, later.stdout, later.stderr) == (4, "/tmp\n", "1\n"), later
        timed_out, nonce = await session_run(pid, "sleep 30", timeout=1)
        assert timed_out is None
        after = await backend.exec(handle, run(processes.interrupt_script(pid, nonce), timeout=30), ROOT)
        assert after.exit_code == 0, after
        again, _ = await session_run(pid, "pwd")
        assert again.stdout == "/tmp\n"
    finally:
        await backend.destroy(handle)


async def test_file_tree_scripts(kit):
    """dsec.edge.files' commands on each backend: a tar in, listed, the same tar out."""
    import base64
    import io
    import tarfile

    from dsec.edge import files
    from dsec.edge.stream import stream_exec

    backend, spec = kit
    if type(backend).__name__ == "FakeBackend":
        pytest.skip("the fake runs no shell")
    handle = await backend.create(cid(), spec)

    async def sh(script: str, stdin: str | None = None):
        return await backend.exec(handle, run(script, stdin=stdin, timeout=60, max_output_bytes=8 << 20), ROOT)

    try:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, data in (("a.txt", b"alpha"), ("sub/b.bin", bytes(range(256)) * 40)):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o640
                tar.addfile(info, io.BytesIO(data))
            link = tarfile.TarInfo("ln")
            link.type, link.linkname = tarfile.SYMTYPE, "a.txt"
            tar.addfile(link)
        data = buf.getvalue()
        files.checked_tar(data)
        tmp = "/tmp/.up.tar"
        files.check(await sh(files.upload_piece_script(tmp, True), base64.b64encode(data).decode()), "upload", "/t")
        files.check(await sh(files.unpack_script(tmp, "/tmp/t")), "unpack", "/tmp/t")
        entries = {e.name: e for e in files.parse_entries(files.check(await sh(files.list_script("/tmp/t")), "list", "/").stdout, "/tmp/t")}
        assert set(entries) == {"a.txt", "ln", "sub"} and entries["a.txt"].mode == 0o640, entries
        assert (entries["ln"].type, entries["ln"].target, entries["sub"].type) == ("symlink", "a.txt", "dir")
        with pytest.raises(SandboxFileNotFound):
            files.check(await sh(files.stat_script("/tmp/none")), "stat", "/tmp/none")
        request = run(files.download_script("/tmp/t"), max_output_bytes=0, timeout=60)
        text = "".join([e.data async for e in stream_exec(lambda emit: backend.exec_stream(handle, request, ROOT, emit))
                        if e.event == "stdout"])
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode("".join(text.split()))), mode="r:") as tar:
            got = {m.name.removeprefix("./"): (tar.extractfile(m).read() if m.isreg() else m.linkname)
                   for m in tar.getmembers() if m.name not in (".", "./")}
        assert got == {"a.txt": b"alpha", "sub": "", "sub/b.bin": bytes(range(256)) * 40, "ln": "a.txt"}, got.keys()
        # The binary stream out (every kind): the tar's bytes as they are.
        from dsec.edge.stream import stream_bytes

        request = run(files.download_tar_script("/tmp/t"), max_output_bytes=1 << 16, timeout=60)
        raw = b"".join([c async for c in stream_bytes(lambda emit: backend.exec_stream(handle, request, ROOT, emit),
                                                      lambda result: files.check(result, "download", "/tmp/t"))])
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            assert tar.extractfile("./sub/b.bin").read() == bytes(range(256)) * 40
        # The binary stream in, where the backend feeds one (a tar fed to tar x as its stdin).
        from dsec.backends.base import Capability
        from libdsec._tarcheck import TarChecker

        if Capability.PIPED_STDIN in backend.capabilities:
            async def pieces():
                for at in range(0, len(data), 777):
                    yield data[at:at + 777]

            async def discard(kind: str, out: bytes) -> None:
                pass
            result = await backend.exec_piped(handle, run(files.unpack_stdin_script("/tmp/piped"), timeout=60), ROOT,
                                              TarChecker(1 << 30).checked(pieces()), discard)
            files.check(result, "unpack into", "/tmp/piped")
            assert (await sh("cat /tmp/piped/a.txt; readlink /tmp/piped/ln")).stdout == "alphaa.txt\n"

            async def megabytes():  # (more than a VM agent queues: its refusals are waited out)
                for _ in range(80):
                    yield bytes(range(256)) * 256

            counted = await backend.exec_piped(handle, run("sleep 0.5; wc -c", timeout=60), ROOT, megabytes(), discard)
            assert (counted.exit_code, counted.stdout.strip()) == (0, str(80 * 65536)), counted
    finally:
        await backend.destroy(handle)


async def test_connect_port(kit):
    """A connection from the node to a port inside (``Capability.PORTS``), needing nothing of the
    image: HTTP over it both ways; nothing listening is PortUnreachable naming the port, for
    every kind (a VM's tunnel says it is ready only once it is connected)."""
    import asyncio

    from dsec.backends.base import Capability
    from dsec.edge import processes
    from libdsec import PortUnreachable

    backend, spec = kit
    if type(backend).__name__ == "FakeBackend":
        pytest.skip("the fake runs no shell (its ports are the node's: tests/conformance/test_node_seam.py)")
    assert Capability.PORTS in backend.capabilities
    handle = await backend.create(cid(), spec)

    async def ask(port: int) -> bytes:
        reader, writer = await backend.connect_port(handle, port)
        try:
            writer.write(b"GET /index.html HTTP/1.0\r\nhost: x\r\n\r\n")
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 30)
        finally:
            writer.close()

    try:
        await backend.exec(handle, run("mkdir -p /tmp/www && echo hello > /tmp/www/index.html"), ROOT)
        await backend.exec(handle, run(processes.start_script("httpd -f -p 127.0.0.1:8000 -h /tmp/www")), ROOT)
        for _ in range(50):
            try:
                answer = await ask(8000)
                if answer:
                    break
            except PortUnreachable:
                pass
            await asyncio.sleep(0.2)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nhello\n"), answer
        with pytest.raises(PortUnreachable, match="port 8001"):
            await ask(8001)
    finally:
        await backend.destroy(handle)


async def test_pty(kit):
    """A shell on a terminal of the sandbox's: its size, resized; Ctrl-C stops its foreground
    job and not the shell; its exit code; nothing typed after its end."""
    import asyncio

    backend, spec = kit
    fake = type(backend).__name__ == "FakeBackend"
    handle = await backend.create(cid(), spec)
    ctx = ExecContext(uid=0, gid=0, workdir="/", env={**ROOT.env, "TERM": "xterm", "PS1": "$ "})
    seen = bytearray()

    async def until(pty, needle: bytes, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while needle not in seen:
                data = await pty.read()
                assert data, f"the PTY ended before {needle!r}: {bytes(seen)!r}"
                seen.extend(data)

    try:
        pty = await backend.open_pty(handle, "/bin/sh", ctx, 80, 24)
        try:
            await pty.write(b"stty size\n")
            await until(pty, b"24 80")
            await pty.resize(100, 30)
            await pty.write(b"stty size\n")
            await until(pty, b"30 100")
            if not fake:
                await pty.write(b"tty; echo $((6 * 7))\n")
                await until(pty, b"42")
                assert b"/dev/pts/" in seen, bytes(seen)
                await pty.write(b"sleep 30\n")
                await asyncio.sleep(1.0)
                await pty.write(b"\x03")
                await pty.write(b"echo after $?\n")
                await until(pty, b"after 130", timeout=20)
            await pty.write(b"exit 3\n")
            async with asyncio.timeout(60):
                while await pty.read():
                    pass
            assert await pty.wait() == 3
            with pytest.raises(SandboxStateError, match="exited"):
                await pty.write(b"x")
        finally:
            await pty.close()
            await pty.close()  # again: nothing happens
        # Closed while it runs: what it started is killed.
        pty = await backend.open_pty(handle, "sleep 300", ctx, 80, 24)
        await pty.close()
        assert await pty.wait() != 0
        with pytest.raises(SandboxStateError, match="closed"):
            await pty.resize(80, 24)
    finally:
        await backend.destroy(handle)
