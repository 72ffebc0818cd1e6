"""SandboxFusion's ``run_code`` on DSec's FnCall pool: ``sandbox_fusion.run_code(RunCodeRequest(…),
endpoint="<endpoint>/sandboxfusion/<token>")``, verl's plain ``POST …/run_code`` (its client
sends no credential header: the token rides in the path) and ``GET …/v1/ping``.

Each request is one FnCall (``DSecClient.fncall``'s call, on the node's warm pool), never a
second way to run code:

- ``python`` and ``bash`` run as FnCall's own languages in the ``python`` image;
- ``cpp``, ``nodejs``, ``go``, ``java`` run in their toolchain image (``lang-cpp`` …, built by
  DSec's builders: ``dsec image build lang-cpp``), as FnCall's ``bash`` language: a small driver
  compiles (within ``compile_timeout``) and runs (within ``run_timeout``, with ``stdin``) in the
  one fresh call process, and the compile step's output and both steps' exit codes and times
  come back as fetched files.

The answer is SandboxFusion's: ``status`` ``Success`` (every step exited 0), ``Failed``
(a step did not: a compile error, a non-zero exit, a time limit), ``SandboxError`` (DSec could
not run it: an image not built, a limit out of range); each step ``Finished`` (it exited, with
its ``return_code``), ``TimeLimitExceeded`` or ``Error``. ``memory_limit_MB`` is the call's
memory limit (compiler included; -1: the language's default).
"""

from __future__ import annotations

import base64
import binascii
import shlex
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from libdsec import DSecError, Unauthenticated
from libdsec.protocol import DSecFnCallArgs, FnCallResult

# SandboxFusion's own language names (sandbox_fusion.models.Language); those DSec runs are below.
KNOWN_LANGUAGES = frozenset({
    "python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script",
    "jest", "verilog", "python_gpu", "lean", "swift", "racket", "gtest", "react"})
META = ".dsec-sf"  # the driver's notes, in the call's working directory


class Toolchain(BaseModel):
    image: str
    source: str  # the file the code is written to
    compile: str | None  # shell commands, in the working directory
    run: str
    memory_mb: int  # the call's memory limit when the request gives none


TOOLCHAINS: dict[str, Toolchain] = {
    "cpp": Toolchain(image="lang-cpp", source="main.cpp", compile="g++ -std=c++17 main.cpp -o main -lpthread",
                     run="./main", memory_mb=1024),
    "nodejs": Toolchain(image="lang-nodejs", source="main.js", compile=None, run="node main.js", memory_mb=1024),
    "go": Toolchain(image="lang-go", source="main.go", compile="GOCACHE=/tmp/go-cache go build -o main main.go",
                    run="./main", memory_mb=1024),
    # FnCall bounds each process's address space by the call's memory limit: the JVM's own
    # reservations (heap, class space, code cache) are sized to fit in it.
    "java": Toolchain(image="lang-java", source="Main.java",
                      compile="javac -J-Xmx{heap_mb}m -J-XX:CompressedClassSpaceSize=64m -J-XX:ReservedCodeCacheSize=64m "
                              "-J-XX:+UseSerialGC -J-XX:TieredStopAtLevel=1 Main.java",
                      run="java -Xmx{heap_mb}m -XX:CompressedClassSpaceSize=64m -XX:ReservedCodeCacheSize=64m "
                          "-XX:+UseSerialGC -ea Main", memory_mb=2048),
}
DIRECT_IMAGE = "python"  # python and bash: FnCall's own languages
DIRECT_MEMORY_MB = 512
RUNNABLE = frozenset({"python", "bash", *TOOLCHAINS})
SLACK_S = 3.0  # the call's own timeout is the steps' plus this


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest`` as its server takes it (and verl sends it)."""

    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: str
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class _Refused(Exception):
    """The request cannot run here: a ``SandboxError`` answer naming why."""


# The driver (bash): each step under timeout(1), its exit code and start/end times to META.
# The compile step's output goes to files; the run step's is the call's own stdout and stderr.
_DRIVER = r'''mkdir -p %(meta)s
step() {  # NAME LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$EPOCHREALTIME
  timeout -k 1 "$limit" "$@"; local rc=$?
  echo "$rc $start $EPOCHREALTIME" > %(meta)s/$name
  return $rc
}
'''


def driver_script(toolchain: Toolchain, compile_timeout: float, run_timeout: float, memory_mb: int) -> str:
    sizes = {"heap_mb": max(16, memory_mb // 2)}
    script = _DRIVER % {"meta": META}
    if toolchain.compile is not None:
        script += (f"step compile {compile_timeout:g} bash -c {shlex.quote(toolchain.compile.format(**sizes))} "
                   f"</dev/null >{META}/compile.out 2>{META}/compile.err || exit 0\n")
    script += f"step run {run_timeout:g} bash -c {shlex.quote(toolchain.run.format(**sizes))}\n"
    return script


def _files(request: RunCodeRequest) -> dict[str, bytes]:
    out = {}
    for path, content in request.files.items():
        if content is None:  # (SandboxFusion skips these too)
            continue
        try:
            out[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise _Refused(f"files[{path!r}] is not base64") from None
    return out


def translate(request: RunCodeRequest) -> tuple[DSecFnCallArgs, Toolchain | None]:
    """The FnCall that runs ``request`` (and the toolchain, for a compiled language)."""
    if request.language not in RUNNABLE:
        known = "a SandboxFusion language DSec does not run" if request.language in KNOWN_LANGUAGES else "unknown"
        raise _Refused(f"language {request.language!r} is {known}: use one of {', '.join(sorted(RUNNABLE))}")
    for limit in ("compile_timeout", "run_timeout"):
        if not 0 < getattr(request, limit) <= 600:
            raise _Refused(f"{limit}={getattr(request, limit)} is out of range: (0, 600] seconds")
    files = _files(request)
    toolchain = TOOLCHAINS.get(request.language)
    memory = request.memory_limit_MB if request.memory_limit_MB > 0 else (
        toolchain.memory_mb if toolchain else DIRECT_MEMORY_MB)
    fetch = list(request.fetch_files)
    if toolchain is None:
        return DSecFnCallArgs(code=request.code, language=request.language, stdin=request.stdin, files=files,
                              fetch_files=fetch, timeout=request.run_timeout, memory_limit_mb=memory,
                              image=DIRECT_IMAGE), None
    files[toolchain.source] = request.code.encode()
    fetch += [f"{META}/{name}" for name in ("compile", "compile.out", "compile.err", "run")]
    steps = request.run_timeout + (request.compile_timeout + 1 if toolchain.compile else 0)
    return DSecFnCallArgs(code=driver_script(toolchain, request.compile_timeout, request.run_timeout, memory),
                          language="bash", stdin=request.stdin, files=files, fetch_files=fetch,
                          timeout=min(steps + SLACK_S, 600.0), memory_limit_mb=memory, image=toolchain.image), toolchain


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")


def _step(note: bytes | None, limit: float, stdout: str, stderr: str) -> CommandRunResult | None:
    """A driver step from its note (``RC START END``); None if it never ran."""
    if not note:
        return None
    rc, start, end = note.split()
    rc, took = int(rc), max(0.0, float(end) - float(start))
    if rc == 124 and took >= limit * 0.98:  # timeout(1)'s code once the limit passed
        return CommandRunResult(status="TimeLimitExceeded", execution_time=took, stdout=stdout, stderr=stderr)
    return CommandRunResult(status="Finished", execution_time=took, return_code=rc, stdout=stdout, stderr=stderr)


def answer(request: RunCodeRequest, toolchain: Toolchain | None, result: FnCallResult) -> RunCodeResponse:
    """The FnCall's result as SandboxFusion answers."""
    fetched = {path: base64.b64encode(data).decode() for path, data in result.files.items()
               if not path.startswith(META + "/")}
    stderr = result.stderr + ("\n(memory limit exceeded)" if result.memory_exceeded else "")
    if toolchain is None:
        if result.timed_out:
            run = CommandRunResult(status="TimeLimitExceeded", execution_time=result.duration_s,
                                   stdout=result.stdout, stderr=stderr)
        else:
            # (FnCall's -N for a signal is the shell's 128 + N)
            code = result.exit_code if result.exit_code >= 0 else 128 - result.exit_code
            run = CommandRunResult(status="Finished", execution_time=result.duration_s, return_code=code,
                                   stdout=result.stdout, stderr=stderr)
        return _verdict(None, run, fetched)
    compiled = None
    if toolchain.compile is not None:
        compiled = _step(result.files.get(f"{META}/compile"), request.compile_timeout,
                         _text(result.files.get(f"{META}/compile.out")), _text(result.files.get(f"{META}/compile.err")))
        if compiled is None:  # the call ended before the compiler did (its memory, the call's timeout)
            compiled = CommandRunResult(status="Error", stdout="", stderr=stderr or "the compile step did not finish")
            return _verdict(compiled, None, fetched)
        if compiled.status != "Finished" or compiled.return_code != 0:
            return _verdict(compiled, None, fetched)
    run = _step(result.files.get(f"{META}/run"), request.run_timeout, result.stdout, stderr)
    if run is None:
        status = "TimeLimitExceeded" if result.timed_out else "Error"
        run = CommandRunResult(status=status, execution_time=result.duration_s, stdout=result.stdout,
                               stderr=stderr or "the run step did not finish")
    return _verdict(compiled, run, fetched)


def _verdict(compiled: CommandRunResult | None, run: CommandRunResult | None, files: dict[str, str]) -> RunCodeResponse:
    ok = all(step is None or (step.status == "Finished" and step.return_code == 0) for step in (compiled, run))
    return RunCodeResponse(status="Success" if ok and run is not None else "Failed", compile_result=compiled,
                           run_result=run, files=files)


async def run_code(cluster, request: RunCodeRequest) -> RunCodeResponse:
    try:
        args, toolchain = translate(request)
        result = await cluster.fncall(args)
    except _Refused as exc:
        return RunCodeResponse(status="SandboxError", message=str(exc))
    except DSecError as exc:
        hint = ""
        if exc.code == "image_not_found" and request.language in TOOLCHAINS:
            hint = f" (build it once: dsec image build {TOOLCHAINS[request.language].image})"
        return RunCodeResponse(status="SandboxError", message=f"{exc.code}: {exc.message}{hint}")
    return answer(request, toolchain, result)


def add_sandboxfusion_routes(app: FastAPI, cluster, authenticator) -> None:
    prefix = "/sandboxfusion/{token}"

    def check(token: str) -> JSONResponse | None:
        try:
            authenticator.caller(f"Bearer {token}")
        except Unauthenticated as exc:
            return JSONResponse({"detail": "invalid token in the path (…/sandboxfusion/<token>/…)",
                                 **exc.to_wire()}, status_code=401)
        return None

    async def ping(token: str):
        return check(token) or PlainTextResponse('"pong"', media_type="application/json")

    async def run(token: str, request: Request):
        if (refused := check(token)) is not None:
            return refused
        try:
            parsed = RunCodeRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return JSONResponse({"detail": exc.errors(include_url=False, include_context=False, include_input=False)},
                                status_code=422)
        return (await run_code(cluster, parsed)).model_dump()

    app.add_api_route(prefix + "/v1/ping", ping, methods=["GET"], include_in_schema=False)
    app.add_api_route(prefix + "/run_code", run, methods=["POST"], include_in_schema=False)
