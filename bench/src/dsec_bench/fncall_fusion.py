"""The SandboxFusion arm of ``dsec bench fncall``: the same program as a python and as a C++ call
through ``run_code`` with SandboxFusion's own async client (``sandbox_fusion.async_client``, one
HTTP request a call, as verl sends them), against the same program run per call with ``bwrap``
(python: ``python3 -c``; C++: ``g++ -std=c++17 … -lpthread`` as SandboxFusion compiles, then the
binary, in a fresh tmpfs), in the same run, the same calls in flight. Every answer is checked.
C++ runs in the ``lang-cpp`` image (built, once, if the store lacks it: a few minutes) and with
the host's g++ for the peer."""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any

from rich.console import Console

from dsec.compat.sandboxfusion import TOOLCHAINS
from dsec.images.builders import build_language
from dsec.images.store import LayerStore
from . import hoststats as host

PYTHON = "print(sum(range(1000)))"
CPP = "#include <cstdio>\nint main() { long s = 0; for (int i = 0; i < 1000; i++) s += i; printf(\"%ld\\n\", s); }\n"
EXPECTED = "499500\n"
CPP_PEER = "cd /tmp && cat > main.cpp && g++ -std=c++17 main.cpp -o main -lpthread && ./main"


class FusionBenchError(RuntimeError):
    pass


def ensure_image(store: LayerStore, console: Console) -> None:
    name = TOOLCHAINS["cpp"].image
    if not store.has_image(name):
        with console.status(f"building the {name} image (debootstrap + g++, a few minutes) …"):
            build_language(store, name)


async def _peer(argv: list[str], stdin: bytes | None, count: int, in_flight: int, meter) -> dict:
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate(stdin)
            latencies.append(time.perf_counter() - start)
            if out.decode() != EXPECTED:
                raise FusionBenchError(f"{argv[0]} answered {out!r} {err[-300:]!r}")

    await asyncio.gather(*(one() for _ in range(count)))
    return {"calls": count, "in_flight": in_flight, "latency": host.latency_summary(latencies), **meter.stop(count)}


async def _fusion(endpoint: str, language: str, code: str, count: int, in_flight: int, meter) -> dict:
    from sandbox_fusion import RunCodeRequest
    from sandbox_fusion.async_client import run_code

    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)
    request = RunCodeRequest(language=language, code=code, compile_timeout=60, run_timeout=10)

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            answer = await run_code(request, endpoint=endpoint, max_attempts=1, client_timeout=300)
            latencies.append(time.perf_counter() - start)
            if answer.status != "Success" or answer.run_result.stdout != EXPECTED:
                raise FusionBenchError(f"run_code {language} answered {answer!r}"[:800])

    await asyncio.gather(*(one() for _ in range(count)))
    return {"calls": count, "in_flight": in_flight, "latency": host.latency_summary(latencies), **meter.stop(count)}


async def measure(endpoint: str, bwrap: list[str], python3: str, meter_of, wait_quiet, opts: dict,
                  console: Console) -> dict[str, Any]:
    """Both arms, python then C++ (``meter_of()``: a fresh CPU meter for a phase)."""
    if shutil.which("g++") is None:
        raise FusionBenchError("g++ not found on the host (the C++ peer compiles with it): apt-get install g++")
    n_py, n_cpp = opts["fusion_calls"], opts["fusion_cpp_calls"]
    in_py, in_cpp = opts["in_flight"], opts["fusion_cpp_in_flight"]
    out: dict[str, Any] = {}
    console.log("SandboxFusion run_code: warming up python and cpp")
    await _fusion(endpoint, "python", PYTHON, 20, 4, meter_of())
    await _fusion(endpoint, "cpp", CPP, 4, 2, meter_of())
    await wait_quiet()
    console.log(f"SandboxFusion run_code python: {n_py} calls, {in_py} in flight; bwrap python3 -c the same")
    out["python"] = await _fusion(endpoint, "python", PYTHON, n_py, in_py, meter_of())
    out["python_bwrap"] = await _peer([*bwrap, python3, "-c", PYTHON], None, n_py, in_py, meter_of())
    await wait_quiet()
    console.log(f"SandboxFusion run_code cpp: {n_cpp} calls, {in_cpp} in flight; bwrap g++ && ./main the same")
    out["cpp"] = await _fusion(endpoint, "cpp", CPP, n_cpp, in_cpp, meter_of())
    out["cpp_bwrap"] = await _peer([*bwrap, "/bin/sh", "-c", CPP_PEER], CPP.encode(), n_cpp, in_cpp, meter_of())
    out["summary"] = {
        "python_calls_per_s": out["python"]["calls_per_s"],
        "python_bwrap_calls_per_s": out["python_bwrap"]["calls_per_s"],
        "python_vs_bwrap": out["python"]["calls_per_s"] / out["python_bwrap"]["calls_per_s"],
        "cpp_calls_per_s": out["cpp"]["calls_per_s"],
        "cpp_bwrap_calls_per_s": out["cpp_bwrap"]["calls_per_s"],
        "cpp_vs_bwrap": out["cpp"]["calls_per_s"] / out["cpp_bwrap"]["calls_per_s"],
    }
    return out


def rows(fusion: dict) -> list[tuple[str, dict, dict]]:
    """(name, figures, latency) for the bench's table."""
    return [(f"SandboxFusion run_code python, {fusion['python']['in_flight']} in flight", fusion["python"],
             fusion["python"]["latency"]),
            ("bwrap … python3 -c, same calls", fusion["python_bwrap"], fusion["python_bwrap"]["latency"]),
            (f"SandboxFusion run_code cpp, {fusion['cpp']['in_flight']} in flight", fusion["cpp"],
             fusion["cpp"]["latency"]),
            ("bwrap … g++ && ./main, same calls", fusion["cpp_bwrap"], fusion["cpp_bwrap"]["latency"])]


def report(fusion: dict, console: Console) -> None:
    s = fusion["summary"]
    console.print(f"SandboxFusion run_code (its client, a request a call): python {s['python_calls_per_s']:.0f} calls/s "
                  f"vs bwrap {s['python_bwrap_calls_per_s']:.0f} ({s['python_vs_bwrap']:.1f}×); cpp (compile + run) "
                  f"{s['cpp_calls_per_s']:.2f} calls/s vs bwrap {s['cpp_bwrap_calls_per_s']:.2f} ({s['cpp_vs_bwrap']:.2f}×)")
