"""A desktop's live view, ``sandbox.desktop.stream_url()``, through a real ``dsec serve``: noVNC's
page and its VNC WebSocket for the caller's project only; every other key refused with its
reason, the server serving on (in a browser: ``test_desktop_browser.py``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from websockets.asyncio.client import connect

from libdsec import DesktopSpec, DSecClient, DSecContainerRunArgs, Sandbox, SandboxNotFound

pytestmark = [pytest.mark.slow, pytest.mark.root]

W, H = 1280, 800


def _args(image: str) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=1024, desktop=DesktopSpec(width=W, height=H))


async def test_stream_url_opens_for_its_project_only(client, server, desktop_image, no_sandbox_outlives_the_test):
    await client.create_project("stream-a")
    await client.create_project("stream-b")
    async with DSecClient(server.endpoint, token=await client.create_project_token("stream-a")) as team_a, \
            DSecClient(server.endpoint, token=await client.create_project_token("stream-b")) as team_b:
        async with await team_a.run_container(_args(desktop_image)) as sandbox, \
                await team_a.run_container(_args(desktop_image)) as other:
            url = await sandbox.desktop.stream_url()
            assert url.startswith(f"{server.endpoint}/v1/sandboxes/{sandbox.id}/desktop/stream/")
            page_url, _, query = url.partition("?")
            base = page_url.rsplit("/", 1)[0]
            async with httpx.AsyncClient(timeout=30) as http:  # no token at all: the key is the pass
                page = await http.get(url)
                assert page.status_code == 200 and "noVNC" in page.text, page.text[:200]
                assert (await http.get(f"{base}/app/ui.js")).status_code == 200  # what the page loads
                # The page's WebSocket: the VNC server's greeting through the apiserver.
                ws_url = base.replace("http://", "ws://") + "/websockify"
                async with connect(ws_url, subprotocols=["binary"], open_timeout=30) as ws:
                    assert (await asyncio.wait_for(ws.recv(), 30))[:4] == b"RFB "

                # Refused, each with its reason: no key, an altered key, a key of another sandbox,
                # an expired one; a token in a header does not stand for the key.
                root = f"{server.endpoint}/v1/sandboxes/{sandbox.id}/desktop/stream"
                key = base.rsplit("/", 1)[1]
                expires, name, mac = key.split(".")
                refusals = {
                    f"{root}/vnc.html": "this path has none",
                    f"{root}/{expires}.{name}.{'0' * len(mac)}/vnc.html": "this one is not it",
                    f"{root}/{int(expires) + 60}.{name}.{mac}/vnc.html": "this one is not it",
                    f"{server.endpoint}/v1/sandboxes/{other.id}/desktop/stream/{key}/vnc.html": "this one is not it",
                }
                for wrong, reason in refusals.items():
                    answer = await http.get(wrong, headers={"authorization": f"Bearer {server.token}"})
                    assert answer.status_code == 401, (wrong, answer.text)
                    assert answer.json()["error"]["code"] == "unauthenticated" and reason in answer.text, answer.text
                with pytest.raises(Exception, match="401"):
                    async with connect(f"{root}/vnc.html".replace("http://", "ws://"), open_timeout=30):
                        pass
                # Another project cannot ask for the sandbox's view (nor see the sandbox at all).
                with pytest.raises(SandboxNotFound):
                    await Sandbox(team_b, sandbox.info).desktop.stream_url()
                # A second call finds the stream running, and gives a working key again.
                again = await sandbox.desktop.stream_url()
                assert (await http.get(again)).status_code == 200
        # The sandbox stopped, its key opens nothing.
        async with httpx.AsyncClient(timeout=30) as http:
            gone = await http.get(url)
            assert gone.status_code == 409 and "is stopped" in gone.json()["error"]["message"], gone.text
        assert (await client.list_sandboxes()) is not None  # the server keeps serving
