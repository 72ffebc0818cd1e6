"""Images through the public API a page at a time: the SDK's ``list_images`` with a limit, a
cursor (``after``), a name prefix and a role, over the real routes and an edge on a real store;
a call without them lists every image as before; a bad page is a clear 4xx."""

from __future__ import annotations

import httpx
import pytest

import libdsec
from dsec.apiserver.cluster import Cluster
from dsec.app import create_app
from dsec.images.store import Image

TOKEN = "t0ken"


@pytest.fixture
def app(edge, store):
    tiny = store.get_image("tiny")
    for i in range(7):
        store.put_image(Image(name=f"task-{i}", layers=tiny.layers * 2, roles=("base", "workspace")))
    return create_app(Cluster([edge]), TOKEN)


async def test_the_sdk_pages_through_the_images(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with libdsec.DSecClient("http://api", token=TOKEN, transport=transport) as client:
        every = [i.name for i in (await client.list_images()).images]
        assert every == ["task-0", "task-1", "task-2", "task-3", "task-4", "task-5", "task-6", "tiny"]
        pages, after = [], None
        while True:
            page = (await client.list_images(limit=3, after=after)).images
            pages.append([i.name for i in page])
            if len(page) < 3:
                break
            after = page[-1].name
        assert pages == [every[:3], every[3:6], every[6:]]
        workspaces = (await client.list_images(role="workspace", prefix="task-", after="task-4")).images
        assert [i.name for i in workspaces] == ["task-5", "task-6"] and workspaces[0].roles == ["base", "workspace"]
        assert [i.name for i in (await client.list_images(role="base")).images] == ["tiny"]
        with pytest.raises(libdsec.InvalidRequest, match="bad limit"):
            await client.list_images(limit=0)
        with pytest.raises(libdsec.InvalidRequest, match="bad role"):
            await client.list_images(role="nope")


async def test_the_wire_answers_and_documents_the_page(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                 headers={"authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.get("/v1/images", params={"limit": "2", "prefix": "task-"})
        assert r.status_code == 200 and [i["name"] for i in r.json()["images"]] == ["task-0", "task-1"]
        r = await http.get("/v1/images", params={"limit": "lots"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        assert "bad limit 'lots'" in r.json()["error"]["message"]
        doc = (await http.get("/openapi.json")).json()
        params = {p["name"]: p for p in doc["paths"]["/v1/images"]["get"]["parameters"]}
        assert set(params) == {"limit", "after", "prefix", "role"}
        assert not any(p.get("required") for p in params.values())
