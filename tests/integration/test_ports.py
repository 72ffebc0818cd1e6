"""A port inside a sandbox from outside: ``port_url`` and the host name ``PORT-SANDBOXID.localhost``,
HTTP (streamed both ways, kept alive) and WebSocket, in the python image (no ``nc`` there), with
curl and headless Chromium as clients too; and their errors."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess

import pytest

from dsec_bench.ports import APP_SERVER
from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def _serving(sandbox, command: str, port: int):
    proc = await sandbox.start_shell(command)
    for _ in range(100):
        if (await sandbox.run_shell(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\"",
                                    timeout=10)).exit_code == 0:
            return proc
        await asyncio.sleep(0.1)
    raise AssertionError(f"nothing came to listen on {port}: {await proc.wait()}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _server_pid(server) -> int:
    return server.proc.pid


async def test_http_through_port_url(client, server, python_image):
    import httpx

    async with await client.run_container(DSecContainerRunArgs(container_image=python_image,
                                                               memory_limit_mb=256)) as sandbox:
        assert (await sandbox.run_shell("command -v nc")).exit_code != 0  # the image has none
        await sandbox.run_shell("mkdir -p /tmp/www && echo hello > /tmp/www/index.html")
        httpd = await _serving(sandbox, "exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www", 8000)
        await sandbox.write_file("/tmp/app.py", APP_SERVER)
        app = await _serving(sandbox, "exec python3 /tmp/app.py 8001", 8001)
        auth = {"authorization": f"Bearer {server.token}"}
        plain, url = sandbox.port_url(8000), sandbox.port_url(8001)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1)) as http:
            answer = await http.get(plain + "index.html?x=1", headers=auth)
            assert (answer.status_code, answer.text) == (200, "hello\n")
            assert (await http.get(plain + "missing.html", headers=auth)).status_code == 404
            head = await http.head(url, headers=auth)
            assert head.status_code == 200 and int(head.headers["content-length"]) > 0 and head.content == b""

            # 10 MB up with a length, then chunked (a body of unknown length): both whole, in order.
            blob = os.urandom(10 << 20)
            summed = await http.post(url + "sum", content=blob, headers=auth)
            assert summed.text == f"{hashlib.sha256(blob).hexdigest()} {len(blob)}"

            async def pieces():
                for i in range(0, len(blob), 1 << 20):
                    yield blob[i:i + (1 << 20)]
            summed = await http.post(url + "sum", content=pieces(), headers=auth)
            assert summed.text == f"{hashlib.sha256(blob).hexdigest()} {len(blob)}"

            # Streamed: the first chunk arrives while the server inside waits to write the last.
            async with http.stream("GET", url + "stream", headers=auth) as streamed:
                chunks = streamed.aiter_raw()
                assert await asyncio.wait_for(anext(chunks), 30) == b"first\n"
                await sandbox.write_file("/tmp/go", "")
                assert b"".join([c async for c in chunks]) == b"last\n"

            # Kept alive: one connection to the apiserver, and one to the server inside.
            seen = {(await http.get(url + "conn", headers=auth)).text for _ in range(5)}
            assert len(seen) == 1, seen
            echoed = await http.get(url, headers=auth)
            assert echoed.headers["x-seen-host"] == "127.0.0.1:8001" and echoed.headers["x-seen-auth"] == "no"
            # A job's request goes through the framework's route (which logs it): the same answer.
            from libdsec.protocol import JOB_HEADER
            logged = await http.post(url + "sum?x=1", content=b"abc", headers={**auth, JOB_HEADER: "ports-job"})
            assert logged.text == f"{hashlib.sha256(b'abc').hexdigest()} 3", logged.text
            assert (await http.get(sandbox.port_url(8002), headers={**auth, JOB_HEADER: "ports-job"})).status_code == 502

            # Nothing there: 502 naming the port, DSec-shaped; a bad port, no token, an upgrade
            # that is no WebSocket handshake: refused.
            gone = await http.get(sandbox.port_url(8002), headers=auth)
            assert gone.status_code == 502 and gone.json()["error"]["code"] == "port_unreachable"
            assert "port 8002" in gone.json()["error"]["message"]
            assert (await http.get(url.replace("/8001/", "/70000/"), headers=auth)).status_code == 422
            assert (await http.get(url)).status_code == 401
            upgrade = await http.get(url, headers={**auth, "upgrade": "h2c", "connection": "upgrade"})
            assert upgrade.status_code == 422 and "upgrade" in upgrade.text, upgrade.text
        await app.kill()
        await httpd.kill()


async def test_websocket_and_host_names(client, server, python_image, tmp_path, monkeypatch):
    import httpx
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    api_port = server.port
    async with await client.run_container(DSecContainerRunArgs(container_image=python_image,
                                                               memory_limit_mb=256)) as sandbox:
        await sandbox.write_file("/tmp/app.py", APP_SERVER)
        app = await _serving(sandbox, "exec python3 /tmp/app.py 8001", 8001)
        name = f"8001-{sandbox.id}.localhost"
        token = server.token
        auth = {"authorization": f"Bearer {token}"}

        # WebSocket, through port_url and through the host name.
        for uri, extra in ((sandbox.port_url(8001).replace("http://", "ws://") + "ws", {}),
                           (f"ws://{name}:{api_port}/ws", {"host": "127.0.0.1", "port": api_port})):
            async with connect(uri, additional_headers=auth, max_size=None, **extra) as ws:
                await ws.send("hello ✓")
                assert await ws.recv() == "echo:hello ✓"
                blob = bytes(range(256)) * 1024
                await ws.send(blob)
                assert await ws.recv() == blob[::-1]
                for i in range(20):
                    await ws.send(f"m{i}")
                assert [await ws.recv() for _ in range(20)] == [f"echo:m{i}" for i in range(20)]
        with pytest.raises(InvalidStatus) as denied:
            async with connect(f"ws://8002-{sandbox.id}.localhost:{api_port}/", additional_headers=auth,
                               host="127.0.0.1", port=api_port):
                pass
        assert denied.value.response.status_code == 502 and b'"code":502' in denied.value.response.body

        async with httpx.AsyncClient(base_url=server.endpoint, timeout=60) as http:
            def at(host: str, **headers):
                return {"host": f"{host}:{api_port}", **headers}

            page = await http.get("/", headers=at(name, **auth))
            assert page.status_code == 200 and b"hello from the sandbox" in page.content
            # The server inside sees the host name and no token; the credential headers all work.
            assert page.headers["x-seen-host"] == f"{name}:{api_port}" and page.headers["x-seen-auth"] == "no"
            for header in ({"x-api-key": token}, {"e2b-traffic-access-token": token}):
                assert (await http.get("/conn", headers=at(name, **header))).status_code == 200
            async with http.stream("GET", "/stream", headers=at(name, **auth)) as streamed:
                chunks = streamed.aiter_raw()
                assert await asyncio.wait_for(anext(chunks), 30) == b"first\n"
                await sandbox.write_file("/tmp/go", "")
                assert b"".join([c async for c in chunks]) == b"last\n"
            # Errors, E2B-shaped: no token (a Basic challenge), a wrong one, another project's
            # sandbox, nothing listening, a port outside 1-65535; other hosts are the API's.
            missing = await http.get("/", headers=at(name))
            assert missing.status_code == 401 and missing.json()["code"] == 401
            assert missing.headers["www-authenticate"].startswith("Basic")
            assert (await http.get("/", headers=at(name, authorization="Bearer wrong"))).status_code == 401
            await client.create_project("ports-other")
            try:
                other = await client.create_project_token("ports-other")
                hidden = await http.get("/", headers=at(name, authorization=f"Bearer {other}"))
                assert hidden.status_code == 404 and hidden.json()["code"] == 404
            finally:
                await client.remove_project("ports-other")
            gone = await http.get("/", headers=at(f"8002-{sandbox.id}.localhost", **auth))
            assert gone.status_code == 502 and "port 8002" in gone.json()["message"]
            bad = await http.get("/", headers=at(f"70000-{sandbox.id}.localhost", **auth))
            assert bad.status_code in (400, 422) and bad.json()["code"] == bad.status_code
            assert (await http.get("/healthz", headers=at("localhost"))).json() == {"ok": True}

        # curl, as the user would (the token as Basic's password, or a header).
        base = ["--resolve", f"{name}:{api_port}:127.0.0.1", "-s", "--max-time", "30"]
        got = subprocess.run(["curl", *base, "-H", f"Authorization: Bearer {token}", f"http://{name}:{api_port}/"],
                             capture_output=True, text=True, timeout=60)
        assert "hello from the sandbox" in got.stdout, got
        got = subprocess.run(["curl", *base, "-u", f"agent:{token}", f"http://{name}:{api_port}/"],
                             capture_output=True, text=True, timeout=60)
        assert "hello from the sandbox" in got.stdout, got

        # Headless Chromium, the token in the URL (sent as Basic once challenged). Its name
        # resolution is told to find nothing but *.localhost: it reaches nothing else.
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            pytest.skip("no chromium on the host")
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              "--disable-background-networking", "--disable-component-update", "--disable-sync",
                              f"--user-data-dir={tmp_path / 'chromium'}",
                              "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE *.localhost",
                              "--dump-dom", f"http://agent:{token}@{name}:{api_port}/"],
                             capture_output=True, text=True, timeout=120)
        assert "hello from the sandbox" in dom.stdout, (dom.stdout[-2000:], dom.stderr[-2000:])
        await app.kill()


async def test_e2b_get_host(server, python_image, monkeypatch):
    """With E2B_DOMAIN the apiserver's domain, the e2b SDK's ``get_host(port)`` is the name that
    reaches the port."""
    e2b = pytest.importorskip("e2b")
    import httpx

    api_port = server.port
    monkeypatch.setenv("E2B_API_URL", f"{server.endpoint}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.endpoint}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.token)
    monkeypatch.setenv("E2B_DOMAIN", f"localhost:{api_port}")
    sandbox = await e2b.AsyncSandbox.create(template=python_image)
    try:
        host = sandbox.get_host(8001)
        assert host == f"8001-{sandbox.sandbox_id}.localhost:{api_port}"
        await sandbox.files.write("/tmp/app.py", APP_SERVER)
        await sandbox.commands.run("python3 /tmp/app.py 8001", background=True)
        async with httpx.AsyncClient(base_url=server.endpoint, timeout=60) as http:
            for _ in range(100):
                page = await http.get("/", headers={"host": host, "e2b-traffic-access-token": server.token})
                if page.status_code != 502:
                    break
                await asyncio.sleep(0.1)
            assert page.status_code == 200 and b"hello from the sandbox" in page.content
    finally:
        await sandbox.kill()


async def test_a_sandbox_stopped_mid_stream(client, server, python_image):
    """The client's answer breaks off; the server keeps serving, with nothing left open; a kept
    connection's next request gets the sandbox's error (the edge ends its port connections)."""
    import httpx

    async def ask(conn, path: str) -> tuple[bytes, bytes]:
        reader, writer = conn
        writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n{auth_line}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        return head.split(b"\r\n")[0], await reader.readexactly(length)

    pid = _server_pid(server)
    auth = {"authorization": f"Bearer {server.token}"}
    auth_line = f"authorization: Bearer {server.token}\r\n"
    async with httpx.AsyncClient(timeout=60) as http:
        for round_ in range(2):
            async with await client.run_container(DSecContainerRunArgs(container_image=python_image,
                                                                       memory_limit_mb=256)) as sandbox:
                await sandbox.write_file("/tmp/app.py", APP_SERVER)
                await _serving(sandbox, "exec python3 /tmp/app.py 8001", 8001)
                if round_ == 0:
                    await http.get(sandbox.port_url(8001), headers=auth)  # (a first use: pools, tasks)
                    before = _fds(pid)
                kept = await asyncio.open_connection("127.0.0.1", server.port)
                path = f"/v1/sandboxes/{sandbox.id}/ports/8001/conn"
                assert b" 200 " in (await ask(kept, path))[0]
                async with http.stream("GET", sandbox.port_url(8001) + "stream", headers=auth) as streamed:
                    chunks = streamed.aiter_raw()
                    assert await asyncio.wait_for(anext(chunks), 30) == b"first\n"
                    await sandbox.stop()
                    with pytest.raises(httpx.HTTPError):
                        async for _ in chunks:
                            pass
                assert (await http.get(sandbox.port_url(8001), headers=auth)).status_code in (404, 409, 410)
                status, body = await ask(kept, path)
                assert status.split()[1] in (b"404", b"409", b"410") and sandbox.id.encode() in body, (status, body)
                kept[1].close()
        assert (await http.get(f"{server.endpoint}/healthz")).status_code == 200
    for _ in range(50):  # (closed connections take a moment on the server's side)
        if _fds(pid) <= before + 2:
            break
        await asyncio.sleep(0.2)
    assert _fds(pid) <= before + 2, (before, _fds(pid))
