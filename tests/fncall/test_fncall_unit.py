"""FnCall without containers: argument checks, the zygote's wire format (both ends), the wire
models, the SDK over a mock transport, and the routes over a fake edge."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import libdsec
from dsec import native
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.fncall import zygote
from dsec.fncall.pool import FnCallConfig, FnCallPool, _workdir_path
from dsec.fncall.worker import CallLimits, encode_request
from dsec.images.store import Image
from libdsec import DSecFnCallArgs, FnCallResult
from libdsec.protocol import NodeInfo

TOKEN = "s3cret"


class _Store:
    def get_image(self, name: str) -> Image:
        if name != "python":
            raise libdsec.ImageNotFound(f"unknown image {name!r}")
        return Image(name="python", layers=("sha256-00",), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def _pool() -> FnCallPool:
    return FnCallPool(backend=None, store=_Store(), config=FnCallConfig(max_timeout_s=60, max_memory_mb=1024))


# -- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,expected", [
    ("a.txt", "a.txt"), ("d/e/f.py", "d/e/f.py"), ("/work/x/y", "x/y"),
])
def test_workdir_paths(path, expected):
    assert _workdir_path(path, "files") == expected


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../../b", "a//b", "./a", "a/", "nul\0", "/work/",
                                  "x" * 2000])
def test_workdir_paths_refused(path):
    with pytest.raises(libdsec.InvalidRequest):
        _workdir_path(path, "files")


@pytest.mark.parametrize("args,error,match", [
    ({"language": "ruby"}, libdsec.InvalidRequest, "unsupported language 'ruby'"),
    ({"timeout": 0}, libdsec.LimitOutOfRange, "timeout=0"),
    ({"timeout": 61}, libdsec.LimitOutOfRange, "timeout=61"),
    ({"memory_limit_mb": 8}, libdsec.LimitOutOfRange, "memory_limit_mb=8"),
    ({"memory_limit_mb": 4096}, libdsec.LimitOutOfRange, "memory_limit_mb=4096"),
    ({"max_output_bytes": -1}, libdsec.LimitOutOfRange, "max_output_bytes"),
    ({"files": {"../evil": b"x"}}, libdsec.InvalidRequest, "not a path inside"),
    ({"fetch_files": ["/etc/shadow"]}, libdsec.InvalidRequest, "not a path inside"),
    ({"env": {"A=B": "x"}}, libdsec.InvalidRequest, "environment variable"),
    ({"image": "nope"}, libdsec.ImageNotFound, "unknown image"),
])
def test_bad_calls_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        _pool()._prepare(DSecFnCallArgs(code="print(1)", **args))


def test_inputs_over_the_limit():
    pool = FnCallPool(backend=None, store=_Store(), config=FnCallConfig(max_input_bytes=100))
    with pytest.raises(libdsec.LimitOutOfRange, match="over the 100-byte limit"):
        pool._prepare(DSecFnCallArgs(code="print(1)", files={"big": b"x" * 200}))


def test_call_env():
    """The zygote holds the image's environment (HOME and TMPDIR set for calls); a request
    carries only what the call changes."""
    from dsec.fncall.worker import call_env

    base = call_env(_Store().get_image("python"))
    assert base == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/work", "TMPDIR": "/tmp"}
    prepared = _pool()._prepare(DSecFnCallArgs(code="x", env={"A": "1", "PATH": "/opt/bin", "LANG": "C.UTF-8"}))
    body = memoryview(prepared.frame)[8 + _header_len(prepared.frame):]
    _, _, env, _, _ = zygote._parse_body(body)
    assert env == {"A": "1", "PATH": "/opt/bin"}


# -- the wire format between the edge and the zygote -------------------------------------------


def _header_len(frame: bytes) -> int:
    return int.from_bytes(frame[:4], "big")


def test_request_frame_is_what_the_zygote_reads():
    limits = CallLimits(timeout_s=2.5, memory_bytes=64 << 20, max_output=1000, max_fetch=10, max_fetch_total=20)
    files = [("a.txt", b"\x00\xffdata"), ("d/b.py", b"print(2)\n")]
    frame = encode_request("bash", "echo héllo", {"K": "v=w", "L": ""}, b"in\n", files, ["out.txt", "d/r"], limits)
    hlen, blen = int.from_bytes(frame[:4], "big"), int.from_bytes(frame[4:8], "big")
    assert len(frame) == 8 + hlen + blen
    header = zygote._parse_header(memoryview(frame[8:8 + hlen]))
    assert header == {"timeout": 2.5, "memory": 64 << 20, "cpu": 3, "max_output": 1000, "max_fetch": 10,
                      "max_fetch_total": 20, "fetch": ["out.txt", "d/r"]}
    language, code, env, stdin, got = zygote._parse_body(memoryview(frame[8 + hlen:]))
    assert (language, code, env, bytes(stdin)) == ("bash", "echo héllo", {"K": "v=w", "L": ""}, b"in\n")
    assert [(p, bytes(d)) for p, d in got] == files


def test_zygote_refuses_to_run_outside_a_sandbox():
    assert zygote._inside_a_sandbox() is False  # pid 1 here is not the sandbox init


def test_the_c_loop_is_built_once_and_fits_the_zygote(tmp_path):
    """The zygote's C loop: a shared library, built once per source, that the zygote's ctypes
    can load, whose struct is the one ``_NativeLoop`` describes, and that needs no glibc symbol
    newer than 2.17 (it is loaded by the image's python3, not the host's)."""
    library = native.library("zygote", tmp_path)
    assert library.name.startswith("dsec-zygote-") and library.suffix == ".so"
    inode = library.stat().st_ino
    assert native.library("zygote", tmp_path) == library and library.stat().st_ino == inode
    assert zygote._load_loop(str(library)) is not None
    versions = {tuple(map(int, v)) for v in re.findall(rb"GLIBC_(\d+)\.(\d+)", library.read_bytes())}
    assert versions and max(versions) <= (2, 17), versions
    source = (native.SOURCES / "zygote.c").read_text()
    struct = source[source.index("struct dsec_zygote {"):source.index("};", source.index("struct dsec_zygote {"))]
    struct = re.sub(r"\(\*(\w+)\)\(void\)", r"\1", re.sub(r"/\*.*?\*/", "", struct, flags=re.S))  # no comments
    fields = re.findall(r"\b(\w+)(?:\[\w+\])?[,;]", struct)
    assert fields == [name for name, _ in zygote._NativeLoop._fields_]


_HUGE_PAGES_CHILD = """
import ctypes, os, sys
move = ctypes.PyDLL(sys.argv[1]).dsec_zygote_code_to_huge_pages
move.restype = ctypes.c_long
moved = move()
anon_code = [line for line in open("/proc/self/maps") if line.split()[1:2] == ["r-xp"] and len(line.split()) == 5]
import json, decimal  # new code and data through the moved interpreter, here and in a fork
pid = os.fork()
if pid == 0:
    os._exit(0 if json.loads(json.dumps({"x": str(decimal.Decimal(1) / 7)}))["x"].startswith("0.142857") else 1)
print(moved, len(anon_code), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_the_c_loop_moves_the_interpreters_code_onto_huge_pages(tmp_path):
    """``dsec_zygote_code_to_huge_pages`` moves the 2 MiB-aligned stretches of the loaded
    objects' read-only mappings onto huge pages, where the kernel gives them (THP not "never"):
    the interpreter (libpython here, a static python3.11 in the image) keeps running from the
    copies, in the process and in its forks."""
    library = native.library("zygote", tmp_path)
    done = subprocess.run([sys.executable, "-c", _HUGE_PAGES_CHILD, str(library)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    moved, anon_code, child = (int(x) for x in done.stdout.split())
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert moved >= 2 << 20 and moved % (2 << 20) == 0
        assert anon_code >= moved >> 21  # each moved stretch is an anonymous executable mapping now
    else:
        assert moved == 0
    assert child == 0


# -- wire models -------------------------------------------------------------------------------


def test_file_contents_travel_as_base64():
    args = DSecFnCallArgs(code="x", files={"bin": b"\x00\xff", "text.txt": "héllo"})
    assert args.files == {"bin": b"\x00\xff", "text.txt": "héllo".encode()}
    wire = json.loads(args.model_dump_json())
    assert wire["files"] == {"bin": "AP8=", "text.txt": "aMOpbGxv"}
    assert DSecFnCallArgs.model_validate_json(args.model_dump_json()) == args
    assert DSecFnCallArgs.model_validate_json('{"code": "x", "files": {"a": "/w==", "b": "_w=="}}').files == {
        "a": b"\xff", "b": b"\xff"}
    result = FnCallResult(exit_code=0, files={"o": b"\x01"})
    assert FnCallResult.model_validate_json(result.model_dump_json()).files == {"o": b"\x01"}


def test_result_ok():
    assert FnCallResult(exit_code=0).ok
    assert not FnCallResult(exit_code=1).ok
    assert not FnCallResult(exit_code=-9, timed_out=True).ok
    assert not FnCallResult(exit_code=-1, error={"code": "invalid_request", "message": "m"}).ok


def test_batch_bounds():
    with pytest.raises(ValueError):
        libdsec.protocol.FnCallBatchRequest(calls=[])


# -- the SDK -----------------------------------------------------------------------------------


def _result(**kw) -> dict:
    return json.loads(FnCallResult(**{"exit_code": 0, **kw}).model_dump_json())


async def test_sdk_fncall_and_errors():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if body["language"] == "ruby":
            return httpx.Response(422, json=libdsec.InvalidRequest("unsupported language 'ruby'").to_wire())
        return httpx.Response(200, json=_result(stdout="42\n", files={"o.txt": b"\x00"}))

    transport = httpx.MockTransport(handler)
    async with libdsec.DSecClient("http://dsec.test", token="t", transport=transport) as client:
        result = await client.fncall(DSecFnCallArgs(code="print(42)", files={"in": b"\xff"}))
        assert result.stdout == "42\n" and result.files == {"o.txt": b"\x00"} and result.ok
        with pytest.raises(libdsec.InvalidRequest, match="ruby"):
            await client.fncall(DSecFnCallArgs(code="x", language="ruby"))
    assert seen[0].url.path == "/v1/fncall"
    assert json.loads(seen[0].content)["files"] == {"in": "_w=="}  # URL-safe base64 out; both kinds in


async def test_sdk_fncall_many_chunks_and_keeps_order():
    sizes = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls = json.loads(request.content)["calls"]
        sizes.append(len(calls))
        results = []
        for call in calls:
            if call["language"] == "ruby":
                results.append(_result(exit_code=-1, error={"code": "invalid_request", "message": "ruby"}))
            else:
                results.append(_result(stdout=call["code"]))
        return httpx.Response(200, json={"results": results})

    calls = [DSecFnCallArgs(code=str(i)) for i in range(25)]
    calls[7] = DSecFnCallArgs(code="7", language="ruby")
    async with libdsec.DSecClient("http://dsec.test", token="t", transport=httpx.MockTransport(handler)) as client:
        results = await client.fncall_many(calls, per_request=10)
        assert await client.fncall_many([]) == []
    assert sorted(sizes) == [5, 10, 10]
    assert [r.stdout for i, r in enumerate(results) if i != 7] == [str(i) for i in range(25) if i != 7]
    assert results[7].error.code == "invalid_request" and not results[7].ok


# -- the routes, over a fake edge ------------------------------------------------------------


class _FakeEdge:
    node = "n0"

    async def node_info(self) -> NodeInfo:
        return NodeInfo(node="n0", cgroup_version="v1", runtime="fncall", sandboxes=0, memory_total_mb=1, cpu_cores=1)

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        if args.language not in ("python", "bash"):
            raise libdsec.InvalidRequest(f"unsupported language {args.language!r}")
        return FnCallResult(exit_code=0, stdout=args.code, files={k: v[::-1] for k, v in args.files.items()})

    async def fncall_many(self, calls):
        return [await self.fncall(c) for c in calls]


@pytest.fixture
async def http():
    app = create_app(Cluster([_FakeEdge()]), TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec.test",
                                 headers={"authorization": f"Bearer {TOKEN}"}) as client:
        yield client


async def test_routes_parse_base64_and_map_errors(http):
    body = DSecFnCallArgs(code="hi", files={"f": b"\x01\x02"}).model_dump_json()
    response = await http.post("/v1/fncall", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert FnCallResult.model_validate_json(response.content).files == {"f": b"\x02\x01"}
    response = await http.post("/v1/fncall", content=json.dumps({"code": "x", "language": "ruby"}))
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"
    response = await http.post("/v1/fncall", content=json.dumps({"code": "x", "memroy": 1}))
    assert response.status_code == 422 and "memroy" in response.json()["error"]["message"]
    response = await http.post("/v1/fncall", content=b"{not json")
    assert response.status_code == 422


async def test_batch_route(http):
    body = libdsec.protocol.FnCallBatchRequest(calls=[DSecFnCallArgs(code=str(i)) for i in range(3)])
    response = await http.post("/v1/fncall:batch", content=body.model_dump_json())
    assert [r["stdout"] for r in response.json()["results"]] == ["0", "1", "2"]
    assert (await http.post("/v1/fncall:batch", content=json.dumps({"calls": []}))).status_code == 422


async def test_routes_need_a_token(http):
    response = await http.post("/v1/fncall", content="{}", headers={"authorization": "Bearer wrong"})
    assert response.status_code == 401


async def test_openapi_documents_the_routes(http):
    doc = (await http.get("/openapi.json")).json()

    def body(path: str) -> dict:  # (the table's entries name their models: a $ref to the components)
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]

    assert "code" in body("/v1/fncall")["properties"]
    calls = body("/v1/fncall:batch")["properties"]["calls"]
    assert (calls["minItems"], calls["maxItems"]) == (1, libdsec.protocol.MAX_BATCH_COUNT)
