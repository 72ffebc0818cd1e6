"""PTYs through the SDK against a real ``dsec serve`` (containers): typed, resized, Ctrl-C,
exit codes, bad input; the sync twin; what an idle PTY costs the server; and ``dsec shell``
driven under tmux as a person would."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest

from libdsec import DSecContainerRunArgs, InvalidRequest, SessionClosed, SyncDSecClient

pytestmark = [pytest.mark.slow, pytest.mark.root]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


async def read_until(pty, needle: bytes, seen: bytearray, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        async for data in pty:
            seen.extend(data)
            if needle in seen:
                return
    raise AssertionError(f"the PTY ended before {needle!r}: {bytes(seen)!r}")


async def test_a_shell_on_a_pty(client):
    async with await client.run_container(args()) as sandbox:
        async with await sandbox.open_pty(cols=90, rows=20, env={"PS1": "$ "}) as pty:
            seen = bytearray()
            await pty.write(b"stty size; echo $TERM\n")
            await read_until(pty, b"20 90\r\nxterm-256color", seen)
            await pty.resize(132, 43)
            await pty.write(b"stty size\n")
            await read_until(pty, b"43 132", seen)
            await pty.write(b"sleep 30\n")
            await asyncio.sleep(0.5)
            await pty.write(b"\x03")  # Ctrl-C: the sleep ends, the shell goes on
            await pty.write("echo 'after' $? ✓\n")
            await read_until(pty, "after 130 ✓".encode(), seen)
            await pty.write(b"exit 5\n")
            assert await pty.wait() == 5 and pty.exit_code == 5
        with pytest.raises(SessionClosed, match="closed"):
            await pty.write(b"x")  # after close
        # A command of its own, as a user, in a workdir.
        async with await sandbox.open_pty(command="id -u; pwd; tty", user="1000", workdir="/tmp") as pty:
            out = b"".join([d async for d in pty])
            assert pty.exit_code == 0 and out.split(b"\r\n")[:2] == [b"1000", b"/tmp"], out
            assert b"/dev/pts/" in out
        for cols, rows in ((0, 24), (80, 0), (100000, 24), (80, 100000)):
            with pytest.raises(InvalidRequest, match="cols|rows"):
                await sandbox.open_pty(cols=cols, rows=rows)
        # The server refuses them too, naming the field (a client that skips the SDK's check).
        answer = await client._transport.request("POST", f"/v1/sandboxes/{sandbox.id}/ptys", params=None,
                                                 body=b'{"cols": 100000, "rows": 24}', content_type="application/json",
                                                 timeout=10, headers=None)
        assert answer.status_code == 422 and "cols" in answer.text, answer.text
        pty = await sandbox.open_pty()
        await sandbox._client._request("POST", f"/v1/sandboxes/{sandbox.id}/ptys/{pty.id}/close")
        with pytest.raises(SessionClosed, match="no open PTY"):
            await pty.write(b"echo\n")  # closed by another client: the server says so
    # Its sandbox stopped: the PTY ended with it.
    with pytest.raises(Exception):
        await pty.resize(80, 24)


def test_the_sync_twin_opens_a_pty(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            with sandbox.open_pty(command="read line; echo got $line; exit 4") as pty:
                pty.write(b"it\n")
                out = b"".join(pty)
                assert b"got it" in out and pty.exit_code == 4


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("what", ["pty", "session"])
async def test_an_idle_pty_or_session_costs_the_server_little(client, server, what):
    """≤ 1 MiB each beyond the sandbox (docs/INSIDE.md), for an open PTY and an open session
    alike: 20 idle shells, the server's RSS."""
    async with await client.run_container(args(memory_limit_mb=128)) as sandbox:
        open_one = sandbox.open_pty if what == "pty" else sandbox.open_session
        warm = await open_one()
        await warm.close()
        before = rss_bytes(server.proc.pid)
        shells = [await open_one() for _ in range(20)]
        await asyncio.sleep(0.5)
        grown = rss_bytes(server.proc.pid) - before
        for shell in shells:
            await shell.close()
        print(f"server RSS +{grown / 20 / 1024:.0f} KiB per idle {what}")
        assert grown / 20 <= 1 << 20, grown


def tmux(socket: str, *argv: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *argv], check=True, capture_output=True, text=True).stdout


def wait_for_screen(socket: str, needle: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = tmux(socket, "capture-pane", "-p", "-t", "shell")
        if needle in screen:
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not on the screen:\n{screen}")
        time.sleep(0.1)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="no tmux (scripts/setup-host.sh installs it)")
def test_dsec_shell_under_tmux(server, tmp_path):
    """Typed into, its pane resized, a sleep Ctrl-C'd, exited with a code: as a person would."""
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            socket = f"dsec-test-{os.getpid()}"
            status = tmp_path / "status"
            env = {"DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token,
                   "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": os.environ["PATH"], "TERM": "xterm"}
            command = (f"env PS1='$ ' {sys.executable} -m dsec shell {sandbox.id} -e PS1='sbx$ '; "
                       f"echo $? > {status}; sleep 60")
            subprocess.run(["tmux", "-L", socket, "-f", "/dev/null", "new-session", "-d", "-s", "shell",
                            "-x", "100", "-y", "30", *(f"-e{k}={v}" for k, v in env.items()), command], check=True)
            try:
                wait_for_screen(socket, "sbx$")
                tmux(socket, "send-keys", "-t", "shell", "stty size; hostname", "Enter")
                wait_for_screen(socket, "30 100")
                tmux(socket, "resize-window", "-t", "shell", "-x", "120", "-y", "40")
                time.sleep(0.5)  # SIGWINCH reaches dsec shell, which resizes the sandbox's terminal
                tmux(socket, "send-keys", "-t", "shell", "clear; stty size", "Enter")
                wait_for_screen(socket, "40 120")
                tmux(socket, "send-keys", "-t", "shell", "sleep 100", "Enter")
                time.sleep(0.5)
                tmux(socket, "send-keys", "-t", "shell", "C-c")
                tmux(socket, "send-keys", "-t", "shell", "echo interrupted $?", "Enter")
                wait_for_screen(socket, "interrupted 130")
                tmux(socket, "send-keys", "-t", "shell", "exit 7", "Enter")
                deadline = time.monotonic() + 20
                while not status.exists() or not status.read_text().strip():
                    assert time.monotonic() < deadline, tmux(socket, "capture-pane", "-p", "-t", "shell")
                    time.sleep(0.1)
                assert status.read_text().strip() == "7"
            finally:
                subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


# A WebSocket server of the standard library only (the python image has no websockets): echoes
# text as "echo:TEXT PATH", binary reversed, answers a close with the same code.
WS_SERVER = r'''
import base64, hashlib, socket, struct, sys, threading

def serve(conn):
    f = conn.makefile("rb")
    request = f.readline().decode().split()
    headers = {}
    while (line := f.readline().decode().strip()):
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    key = headers["sec-websocket-key"]
    accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
    extra = "Sec-WebSocket-Protocol: chat\r\n" if "chat" in headers.get("sec-websocket-protocol", "") else ""
    conn.sendall(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Accept: {accept}\r\n{extra}\r\n".encode())

    def send(opcode, data):
        n = len(data)
        head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else bytes([126]) + struct.pack(">H", n) if n < 65536
                                         else bytes([127]) + struct.pack(">Q", n))
        conn.sendall(head + data)

    while True:
        b0, b1 = f.read(2)
        n = b1 & 0x7F
        n = struct.unpack(">H", f.read(2))[0] if n == 126 else struct.unpack(">Q", f.read(8))[0] if n == 127 else n
        mask = f.read(4)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
        opcode = b0 & 0x0F
        if opcode == 1:
            send(1, b"echo:" + data + b" " + request[1].encode())
        elif opcode == 2:
            send(2, data[::-1])
        elif opcode == 9:
            send(10, data)
        elif opcode == 8:
            send(8, data[:2])
            conn.close()
            return

s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


async def test_websocket_through_a_port(client, server, python_image):
    """A real client library (websockets) to a real WebSocket server inside, through port_url."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async with await client.run_container(args(container_image=python_image, memory_limit_mb=128)) as sandbox:
        await sandbox.write_file("/tmp/ws.py", WS_SERVER)
        proc = await sandbox.start_shell("exec python3 /tmp/ws.py 8001")
        async for event in proc.stream():
            assert event.event == "stdout" and "ready" in event.data, event
            break
        url = sandbox.port_url(8001).replace("http://", "ws://")
        auth = {"authorization": f"Bearer {server.token}"}
        async with connect(url + "chat?room=1", additional_headers=auth, subprotocols=["chat"]) as ws:
            assert ws.subprotocol == "chat"
            await ws.send("hello ✓")
            assert await ws.recv() == "echo:hello ✓ /chat?room=1"
            blob = bytes(range(256)) * 1024  # every byte value, 256 KiB: through the tunnel unchanged
            await ws.send(blob)
            assert await ws.recv() == blob[::-1]
            for i in range(20):
                await ws.send(f"m{i}")
            assert [await ws.recv() for _ in range(20)] == [f"echo:m{i} /chat?room=1" for i in range(20)]
            await ws.close(code=4001)
        # Nothing listens there: the handshake is denied, 502, naming the port.
        with pytest.raises(InvalidStatus) as denied:
            async with connect(sandbox.port_url(8002).replace("http://", "ws://"), additional_headers=auth):
                pass
        assert denied.value.response.status_code == 502 and b"port 8002" in denied.value.response.body
        with pytest.raises(InvalidStatus) as denied:
            async with connect(url, additional_headers={"authorization": "Bearer wrong"}):
                pass
        assert denied.value.response.status_code == 401
        await proc.kill()


def test_dsec_shell_with_stdin_not_a_terminal(server, tmp_path):
    """Piped or from a file: typed as it comes, then Ctrl-D; the exit code is the command's."""
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token}
    script = tmp_path / "in.sh"
    script.write_text("echo from-file\nexit 4\n")
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            argv = [sys.executable, "-m", "dsec", "shell", sandbox.id]
            piped = subprocess.run(argv, input=b"echo from-pipe\nexit 5\n", env=env, capture_output=True, timeout=60)
            assert piped.returncode == 5 and b"from-pipe\r\n" in piped.stdout, piped
            with script.open("rb") as f:
                done = subprocess.run(argv, stdin=f, env=env, capture_output=True, timeout=60)
            assert done.returncode == 4 and b"from-file\r\n" in done.stdout, done
            ended = subprocess.run([*argv, "-c", "cat"], stdin=subprocess.DEVNULL, env=env, capture_output=True,
                                   timeout=60)
            assert ended.returncode == 0, ended  # end of input: Ctrl-D ends cat
