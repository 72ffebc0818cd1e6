"""The public table (``libdsec.api_ops``) and who makes it: the SDK, the apiserver (its routes
and OpenAPI document), ``EdgeAPI``, the in-process ``Edge`` and ``RemoteEdge`` (with the node
table) name the same operations, and each is served where the table says."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import httpx
import pytest

import libdsec
from dsec.apiserver import table
from dsec.apiserver.app import Cluster
from dsec.apiserver.calls import ApiCalls
from dsec.app import create_app
from dsec.edge.api import EdgeAPI
from dsec.edge.edge import Edge
from dsec.edge.lifecycle import Action
from dsec.edge.ops import NODE_OPS_BY_NAME
from dsec.edge.remote import RemoteEdge
from libdsec.api_ops import PREFIX, PUBLIC_OPS, PUBLIC_OPS_BY_NAME, api_path, api_route
from libdsec.ops import path_format

# Operations no SDK method makes (the tar of a tree as NDJSON text lines, for clients that
# cannot read a raw stream; the SDK reads the raw tar).
NO_SDK_METHOD = {"download_tree"}
# Routes on a sandbox that are not the table's: the port proxy, its methods each a route.
HAND_WRITTEN = re.compile(r"/v1/sandboxes/\{sandbox_id\}/ports/")

# The operations the nodes serve, and those the apiserver serves itself (ApiCalls).
NODE_SERVED = [op for op in PUBLIC_OPS if op.served == "node"]
APISERVER_SERVED = [op for op in PUBLIC_OPS if op.served == "apiserver"]

SDK = Path(libdsec.__file__).parent
_SDK_CALL = re.compile(r"""(?:api_route|_route)\(\s*"([a-z_]+)\"""")


def _example(op) -> str:
    values = {name: "7" if kind == "int" else "n0-0123456789abcdef" if name == "sandbox_id" else "busybox"
              for name, kind in op.params}
    return api_path(op.name, **values)


def test_the_table_is_well_formed():
    assert len(PUBLIC_OPS_BY_NAME) == len(PUBLIC_OPS), "an operation named twice"
    for op in PUBLIC_OPS:
        assert op.lifecycle is None or op.lifecycle in Action.__members__, op.name
        assert op.journal in (None, "recorded", "made", "read"), op.name
        assert op.served in ("node", "apiserver"), op.name
        if op.served == "apiserver":  # (the node checks a lifecycle; a job's log keeps sandbox calls)
            assert op.lifecycle is None and op.journal is None and "sandbox_id" not in dict(op.params), op.name
        assert (op.journal == "read") == (op.name == "read_file"), op.name
        assert (op.unwrap is None) or op.unwrap in op.answer.model_fields, op.name


@pytest.mark.parametrize("op", NODE_SERVED, ids=lambda op: op.name)
def test_each_operation_is_the_node_seams_too(op):
    """EdgeAPI, the in-process Edge and RemoteEdge (from the node table) have the method the
    apiserver calls; the node table has the operation."""
    assert op.name in NODE_OPS_BY_NAME, op.name
    for cls in (EdgeAPI, Edge, RemoteEdge):
        assert callable(getattr(cls, op.name, None)), (cls.__name__, op.name)
    edge_args = [p for p in inspect.signature(EdgeAPI.__dict__[op.name]).parameters if p != "self"]
    assert [n for n, _ in op.params if n in edge_args] == [n for n, _ in op.params], (op.name, edge_args)


@pytest.mark.parametrize("op", APISERVER_SERVED, ids=lambda op: op.name)
def test_each_operation_the_apiserver_serves_is_a_method_of_its_calls(op):
    """``ApiCalls`` has the method, taking the caller and then the table's arguments (by the
    table handler's own check, ``table._route``)."""
    params = list(inspect.signature(getattr(ApiCalls, op.name)).parameters)
    assert params[:2] == ["self", "caller"], (op.name, params)
    assert table._route(op).own


@pytest.mark.parametrize("op", PUBLIC_OPS, ids=lambda op: op.name)
def test_each_operation_is_served_by_the_table_handler(op):
    """The handler finds each operation at its own path (none shadows another)."""
    found = table.match(op.method, _example(op))
    assert found is not None and found[0].op is op, op.name
    assert api_route(op.name, **{n: 1 for n, _ in op.params})[0] == op.method


def test_the_openapi_document_has_the_table_and_no_route_on_a_sandbox_besides(edge_free_app):
    doc = edge_free_app.openapi()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    wanted = {(op.method, PREFIX + path_format(op.path)) for op in PUBLIC_OPS}
    assert wanted <= documented, sorted(wanted - documented)
    stray = {(m, p) for m, p in documented if p.startswith("/v1/sandboxes/{sandbox_id}")
             and (m, p) not in wanted and not HAND_WRITTEN.match(p)}
    assert not stray, sorted(stray)
    for op in PUBLIC_OPS:  # the models are the table's
        entry = doc["paths"][PREFIX + path_format(op.path)][op.method.lower()]
        if op.request is not None:
            schema = entry["requestBody"]["content"]["application/json"]["schema"]
            if op.body_shape == "optional":  # (the model or null; no body at all is allowed too)
                assert not entry["requestBody"].get("required"), op.name
                schema = schema["anyOf"][0]
            assert schema["$ref"].endswith("/" + op.request.__name__), op.name
        if op.answer is not None and op.answers in ("json", "lines"):
            ok = entry["responses"]["200"]["content"]["application/json"]["schema"]
            assert ok.get("$ref", "").endswith("/" + op.answer.__name__), (op.name, ok)


def test_the_sdk_makes_every_operation():
    made = set()
    for path in SDK.glob("_*.py"):
        made |= set(_SDK_CALL.findall(path.read_text()))
    unknown = made - set(PUBLIC_OPS_BY_NAME)
    assert not unknown, sorted(unknown)
    missing = set(PUBLIC_OPS_BY_NAME) - made - NO_SDK_METHOD
    assert not missing, sorted(missing)
    assert not (NO_SDK_METHOD & made), sorted(NO_SDK_METHOD & made)


async def test_an_operation_the_table_does_not_know_is_a_404_naming_it(edge_free_app):
    transport = httpx.ASGITransport(app=edge_free_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        for method, path in (("GET", "/v1/sandboxes/n0-0123456789abcdef/nonsense"), ("POST", "/v1/nothing"),
                             ("GET", "/v1/sandboxes/n0-0123456789abcdef/processes/7/nonsense")):
            r = await http.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "invalid_request", (method, path)
            assert r.json()["error"]["message"] == f"Not Found: no such operation: {method} {path}"


@pytest.fixture
def edge_free_app():
    return create_app(Cluster([]), "token")
