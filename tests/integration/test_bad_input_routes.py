"""Bad input on the routes that had no such test, against a real ``dsec serve``: every route
that names a sandbox refuses a malformed id (taken from the server's own OpenAPI document, so a
new route is covered the day it is added); VM bodies, snapshot, security events, network rules,
pack_diff's name and role, image refs, images:gc's method, project and quota bodies, fncall:batch. Each
is a 4xx with a wire error naming the problem, and the server goes on serving."""

from __future__ import annotations

import re

import httpx
import pytest

from libdsec import DSecContainerRunArgs, InvalidRequest
from libdsec.protocol import MAX_BATCH_COUNT

pytestmark = [pytest.mark.slow, pytest.mark.root]

BAD_IDS = ["xyz", "n0-0123", "n0-0123456789ABCDEF", "n0-0123456789abcdeg", "n0_0123456789abcdef",
           "a" * 40 + "-0123456789abcdef", "..", "n0-0123456789abcdef%00"]
# A body each route takes (so that what is refused is the id, not the body).
BODIES = {"exec": {"command": "true"}, "exec:stream": {"command": "true"}, "processes": {"command": "true"},
          "signal": {"signal": 15}, "stdin": {"data": ""}, "remove": {"path": "/x"}, "mkdir": {"path": "/x"},
          "rename": {"src": "/a", "dst": "/b"}, "tree:download": {"path": "/x"}, "network_rules": {"network_rules": {}},
          "clean_copy": {"keep": ["/x"]}, "input": {"data": ""}, "resize": {"cols": 80, "rows": 24},
          "ttl": {"ttl_running_stop": 60}, "watches": {"path": "/x"}}
PARAMS = {"pid": "7", "session": "7", "pty": "7", "watch": "7", "port": "80", "path": "x"}


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.endpoint, headers={"authorization": f"Bearer {server.token}"},
                                 timeout=30) as c:
        yield c


def error_of(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    return r.json()["error"]


async def test_every_sandbox_route_refuses_a_malformed_id(http):
    doc = (await http.get("/openapi.json")).json()
    routes = [(method.upper(), path) for path, ops in doc["paths"].items() if "{sandbox_id}" in path for method in ops]
    assert len(routes) > 30, routes
    for sandbox_id in BAD_IDS:
        for method, path in routes:
            url = re.sub(r"\{(\w+)\}", lambda m: sandbox_id if m[1] == "sandbox_id" else PARAMS[m[1]], path)
            last = path.rsplit("/", 1)[1]
            kwargs = {"json": BODIES.get(last, {})} if method in ("POST", "PUT") else {}
            r = await http.request(method, url, params={"path": "/x"}, **kwargs)
            if sandbox_id in ("..", "n0-0123456789abcdef%00") and r.status_code in (404, 405):
                continue  # the URL itself resolves elsewhere: no such route
            if method == "HEAD":  # (no body)
                assert r.status_code == 422, (method, url)
                continue
            err = error_of(r)
            assert (r.status_code, err["code"]) == (422, "invalid_request"), (method, url, r.text[:300])
            assert "malformed sandbox id" in err["message"], (method, url, err)


@pytest.mark.parametrize(("path", "body", "names"), [
    ("/v1/microvms", {"container_image": "busybox", "snapshot": 5}, "snapshot"),
    ("/v1/microvms", {"container_image": "busybox", "memory_limit_mb": "lots"}, "memory_limit_mb"),
    ("/v1/microvms", {"container_image": "busybox", "vcpus": 1, "nonsense": 1}, "nonsense"),
    ("/v1/microvms", {}, "container_image"),
    ("/v1/vms", {"container_image": ["busybox"]}, "container_image"),
    ("/v1/vms", {"container_image": "busybox", "ttl_running_stop": "soon"}, "ttl_running_stop"),
    ("/v1/vms", {"container_image": "busybox", "extra": True}, "extra"),
    ("/v1/fncall:batch", {"calls": []}, "calls"),
    ("/v1/fncall:batch", {"calls": [{"code": "print(1)"}] * (MAX_BATCH_COUNT + 1)}, "calls"),
    ("/v1/fncall:batch", {"calls": [{"code": 5}]}, "code"),
    ("/v1/fncall:batch", {"call": [{"code": "print(1)"}]}, "call"),
    ("/v1/fncall:batch", [1, 2], "body"),
    ("/v1/fncall", {"code": "print(1)", "timeout": "soon"}, "timeout"),
    ("/v1/fncall", {"code": "print(1)", "nonsense": 1}, "nonsense"),
    ("/v1/projects", {"name": "team", "quota": 5}, "quota"),
    ("/v1/projects", {"name": "Bad Name!", "quota": {}}, "name"),
    ("/v1/projects", {"name": "team", "quota": {"memory_mb": -5}}, "memory_mb"),
    ("/v1/projects", {"name": "team", "quota": {"sandboxes": "many"}}, "sandboxes"),
])
async def test_malformed_bodies(http, path, body, names):
    r = await http.post(path, json=body)
    err = error_of(r)
    assert err["code"] in ("invalid_request", "limit_out_of_range"), err
    assert re.search(names, err["message"]), err


async def test_quota_and_token_bodies(http, client):
    for method, path in (("GET", "/v1/projects/no-such"), ("DELETE", "/v1/projects/no-such"),
                         ("POST", "/v1/projects/no-such/tokens")):
        r = await http.request(method, path)  # (the root token found a KeyError here: a 500)
        assert (r.status_code, error_of(r)["code"]) == (404, "project_not_found"), (method, path, r.text)
    r = await http.put("/v1/projects/root/quota", json={"memory_mb": "x"})
    assert "memory_mb" in error_of(r)["message"]
    r = await http.put("/v1/projects/no-such/quota", json={})
    assert error_of(r)["code"] in ("project_not_found", "invalid_request")
    r = await http.put("/v1/projects/root/quota", content=b"{not json", headers={"content-type": "application/json"})
    assert error_of(r)["code"] == "invalid_request"
    r = await http.post("/v1/projects/no-such-project/tokens")
    assert error_of(r)["code"] in ("project_not_found", "invalid_request")
    r = await http.post("/v1/projects/" + "x" * 300 + "/tokens")
    assert 400 <= r.status_code < 500


async def test_sandbox_bodies_snapshot_events_network_rules_and_pack_diff(http, client):
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)) as s:
        base = f"/v1/sandboxes/{s.id}"
        # a full snapshot is for microVMs only
        with pytest.raises(InvalidRequest, match="a container sandbox takes no full snapshots"):
            await s.snapshot("full")
        assert await s.security_events() == [] or isinstance(await s.security_events(), list)
        for body, names in (({"network_rules": {"pypi": "yes"}}, "network_rules"), ({"network_rules": []}, "network_rules"),
                            ({"rules": {}}, "rules"), ({"network_rules": {"x": [5]}}, "network_rules")):
            r = await http.put(f"{base}/network_rules", json=body)
            assert names in error_of(r)["message"], (body, r.text)
        with pytest.raises(InvalidRequest, match="unknown service 'nope'"):
            await s.set_network_rules({"nope": True})
        for body, names in (({"role": "bogus"}, "role"), ({"name": 5}, "name"), ({"name": "x", "extra": 1}, "extra")):
            r = await http.post(f"{base}/pack_diff", json=body)
            assert names in error_of(r)["message"], (body, r.text)
        for name in ("../evil", "/abs", "a/b", "", "x" * 300, "UPPER CASE", "busybox"):
            r = await http.post(f"{base}/pack_diff", json={"name": name})
            err = error_of(r)
            assert err["code"] == "invalid_request" and ("name" in err["message"] or "exists" in err["message"]), (name, err)
        assert (await s.run_shell("echo still")).stdout == "still\n"


@pytest.mark.parametrize("ref", ["no-such-image", "..", "a+", "+a", "busybox+no-such", "x" * 500, "%2e%2e%2fetc"])
async def test_get_image_with_bad_refs(http, ref):
    r = await http.get(f"/v1/images/{ref}")
    err = error_of(r)
    assert err["code"] in ("image_not_found", "invalid_request"), err


async def test_images_gc_by_the_wrong_method(http):
    """(A real gc is not run here: the test store is shared with other runs' servers.)"""
    for method in ("GET", "PUT", "DELETE"):
        r = await http.request(method, "/v1/images:gc")
        assert r.status_code in (404, 405) and error_of(r)["code"] == "invalid_request", (method, r.text)
