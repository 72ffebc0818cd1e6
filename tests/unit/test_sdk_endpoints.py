"""The SDK over several apiservers: it moves on from one it cannot reach and stays with the next;
a request that may have reached a server goes to another only when it is safe to repeat; an
error answer is an answer. Over httpx.MockTransport, and over the lean client against small
real servers on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import libdsec
from dsec.local import free_port
from libdsec import DSecClient, SyncDSecClient
from sdk_answers import ARGS, INFO

EMPTY = {"sandboxes": []}


def test_endpoints_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setenv("DSEC_ENDPOINT", " http://a:1/ , http://b:2,")
    assert DSecClient().endpoints == ("http://a:1", "http://b:2")
    assert DSecClient().endpoint == "http://a:1"
    assert DSecClient("http://c:3").endpoints == ("http://c:3",)
    with pytest.raises(libdsec.InvalidRequest, match="no DSec endpoint"):
        DSecClient(" , ")


def _hosts(failures: dict[str, type[httpx.TransportError]], seen: list[tuple[str, str]]):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.method))
        failure = failures.get(request.url.host)
        if failure is not None:
            raise failure("down", request=request)
        if request.method == "POST":
            return httpx.Response(200, json=INFO)
        return httpx.Response(200, json=EMPTY)
    return httpx.MockTransport(handler)


async def test_it_moves_on_from_one_it_cannot_reach_and_stays():
    seen: list = []
    transport = _hosts({"a": httpx.ConnectError}, seen)
    async with DSecClient("http://a,http://b", token="t", transport=transport) as client:
        assert await client.list_sandboxes() == []
        assert client.endpoint == "http://b"
        await client.run_container(ARGS)
        await client.list_sandboxes()
    assert seen == [("a", "GET"), ("b", "GET"), ("b", "POST"), ("b", "GET")]


async def test_a_create_the_connection_never_took_goes_to_the_next():
    seen: list = []
    transport = _hosts({"a": httpx.ConnectError}, seen)
    async with DSecClient("http://a,http://b", token="t", transport=transport) as client:
        assert (await client.run_container(ARGS)).id == INFO["id"]
    assert seen == [("a", "POST"), ("b", "POST")]


@pytest.mark.parametrize("failure", [httpx.ReadError, httpx.RemoteProtocolError])
async def test_a_request_that_may_have_reached_a_server_is_repeated_only_when_safe(failure):
    seen: list = []
    transport = _hosts({"a": failure}, seen)
    async with DSecClient("http://a,http://b", token="t", transport=transport) as client:
        sandbox = libdsec.Sandbox(client, libdsec.SandboxInfo.model_validate(INFO))
        for create in (client.run_container(ARGS), sandbox.run_shell("true")):
            with pytest.raises(libdsec.ServerUnavailable, match="http://a"):
                await create
        assert client.endpoint == "http://a" and {host for host, _ in seen} == {"a"}
        assert await client.list_sandboxes() == []  # a read: safe to repeat
        assert client.endpoint == "http://b"
    assert seen[-2:] == [("a", "GET"), ("b", "GET")]


async def test_an_error_answer_is_an_answer():
    seen = []

    def handler(request):
        seen.append(request.url.host)
        return httpx.Response(503, json=libdsec.ServerUnavailable("draining").to_wire())

    async with DSecClient("http://a,http://b", token="t", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(libdsec.ServerUnavailable, match="draining"):
            await client.list_sandboxes()
    assert seen == ["a"]


async def test_every_endpoint_down_names_them_all():
    seen: list = []
    transport = _hosts({"a": httpx.ConnectError, "b": httpx.ConnectError, "c": httpx.ConnectError}, seen)
    async with DSecClient("http://b,http://a,http://c", token="t", transport=transport) as client:
        with pytest.raises(libdsec.ServerUnavailable, match="http://b, http://a, http://c"):
            await client.list_sandboxes()
        with pytest.raises(libdsec.ServerUnavailable):
            await client.run_containers(ARGS, count=2)  # the streamed batch too
    assert [host for host, _ in seen] == ["b", "a", "c", "c", "b", "a"]


async def test_a_batch_create_moves_on_only_before_it_left():
    def handler(request):
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        lines = [{"event": "created", "index": 0, "sandbox": INFO}, {"event": "done"}]
        return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines).encode())

    async with DSecClient("http://a,http://b", token="t", transport=httpx.MockTransport(handler)) as client:
        assert [s.id for s in await client.run_containers(ARGS, count=1)] == [INFO["id"]]
        assert client.endpoint == "http://b"


# -- the lean client, against small real servers on 127.0.0.1 ------------------------------------

class TinyServer:
    """An HTTP/1.1 server in a thread: answers every request with ``body`` and keeps the
    connection, or (``answer=False``) reads the request and closes without answering."""

    def __init__(self, body: dict, answer: bool = True) -> None:
        self.body = json.dumps(body).encode()
        self.answer = answer
        self.requests: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        try:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(data) < length:
                    data += conn.recv(65536)
                data = data[length:]
                self.requests.append(head.split(b" ")[0].decode())
                if not self.answer:
                    conn.close()
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(self.body), self.body))
        except OSError:
            return

    def stop(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone does not)
        except OSError:
            pass
        self.listener.close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


@pytest.fixture
def servers():
    made: list[TinyServer] = []

    def make(body: dict, answer: bool = True) -> TinyServer:
        made.append(TinyServer(body, answer))
        return made[-1]

    yield make
    for server in made:
        server.stop()


async def test_lean_client_moves_on_from_a_refused_endpoint(servers):
    live = servers(EMPTY)
    dead = f"http://127.0.0.1:{free_port()}"
    async with DSecClient(f"{dead},{live.endpoint}", token="t") as client:
        assert await client.list_sandboxes() == []
        assert client.endpoint == live.endpoint
        await client.list_sandboxes()
    assert live.requests == ["GET", "GET"]


async def test_lean_client_after_a_server_went_away_between_requests(servers):
    """The first server stops while the client's loop is not running (it has not seen its
    connection close): a create still goes to the second, for the first never read it."""
    first, second = servers(INFO), servers(INFO)
    async with DSecClient(f"{first.endpoint},{second.endpoint}", token="t") as client:
        await client.get_sandbox(INFO["id"])  # leaves an idle connection to the first
        first.stop()
        time.sleep(0.05)  # the FIN is there; the event loop has not looked
        await client.run_container(ARGS)
        assert client.endpoint == second.endpoint
    assert first.requests == ["GET"] and second.requests == ["POST"]


async def test_lean_client_does_not_repeat_a_create_a_server_may_have_read(servers):
    reads, live = servers(EMPTY, answer=False), servers(INFO)
    async with DSecClient(f"{reads.endpoint},{live.endpoint}", token="t") as client:
        with pytest.raises(libdsec.ServerUnavailable, match=str(reads.port)):
            await client.run_container(ARGS)
        assert live.requests == [] and client.endpoint == reads.endpoint
        await client.get_sandbox(INFO["id"])  # a read: safe to repeat
        assert client.endpoint == live.endpoint
    assert reads.requests == ["POST", "GET"] and live.requests == ["GET"]


def test_sync_twin_takes_several_endpoints(servers):
    live = servers(EMPTY)
    with SyncDSecClient(f"http://127.0.0.1:{free_port()},{live.endpoint}", token="t") as client:
        assert client.list_sandboxes() == []
