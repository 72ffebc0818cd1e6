"""The compatibility adapters' pure parts: SWE-ReX's zip upload as a tar, its models against
the swe-rex package's own, and SandboxFusion's request → FnCall → answer translation."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile

import pytest

from dsec.compat import sandboxfusion as sf
from dsec.compat import swerex
from libdsec import InvalidRequest
from libdsec.protocol import FnCallResult


def test_the_zip_swerex_sends_becomes_a_tar_with_modes_and_links():
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as z:
        z.writestr(zipfile.ZipInfo("pkg/"), "")
        script = zipfile.ZipInfo("pkg/run.sh")
        script.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(script, "#!/bin/sh\n")
        link = zipfile.ZipInfo("pkg/link")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(link, "run.sh")
        z.writestr("plain.txt", "text")  # (zipfile records 0o600)
    with tarfile.open(fileobj=io.BytesIO(swerex.zip_to_tar(raw.getvalue()))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["pkg"].isdir()
        assert members["pkg/run.sh"].mode == 0o755 and tar.extractfile("pkg/run.sh").read() == b"#!/bin/sh\n"
        assert members["pkg/link"].issym() and members["pkg/link"].linkname == "run.sh"
        assert members["plain.txt"].mode == 0o600
    with pytest.raises(InvalidRequest, match="not a zip"):
        swerex.zip_to_tar(b"not a zip")


def test_our_swerex_models_read_what_the_swerex_client_sends():
    from swerex.runtime import abstract

    for theirs, ours in [(abstract.CreateBashSessionRequest(), swerex.CreateBashSessionRequest),
                         (abstract.CloseBashSessionRequest(), swerex.CloseBashSessionRequest),
                         (abstract.Command(command=["ls"]), swerex.Command),
                         (abstract.ReadFileRequest(path="/a"), swerex.ReadFileRequest),
                         (abstract.WriteFileRequest(path="/a", content="x"), swerex.WriteFileRequest)]:
        assert ours.model_validate(theirs.model_dump()).model_dump() == theirs.model_dump()
    for action in (abstract.BashAction(command="ls", expect=["$ "]), abstract.BashInterruptAction()):
        assert swerex.Action.validate_python(action.model_dump()).model_dump() == action.model_dump()
    # and the answers parse as the client's models
    abstract.BashObservation(**swerex.BashObservation(output="x", exit_code=0).model_dump())
    abstract.CommandResponse(**swerex.CommandResponse(stdout="x").model_dump())


def test_sandboxfusion_requests_translate_to_one_fncall():
    args, toolchain = sf.translate(sf.RunCodeRequest(code="print(1)", language="python", stdin="x",
                                                     files={"a/b.txt": "aGk="}, run_timeout=3))
    assert toolchain is None and (args.language, args.image, args.timeout) == ("python", "python", 3)
    assert args.files == {"a/b.txt": b"hi"} and args.stdin == "x"
    args, toolchain = sf.translate(sf.RunCodeRequest(code="int main(){}", language="cpp", memory_limit_MB=300,
                                                     compile_timeout=5, run_timeout=2))
    assert toolchain.image == "lang-cpp" and args.language == "bash" and args.memory_limit_mb == 300
    assert args.files["main.cpp"] == b"int main(){}" and args.timeout == 5 + 1 + 2 + sf.SLACK_S
    assert "step compile 5 " in args.code and "step run 2 " in args.code
    for bad, match in [({"language": "rust"}, "does not run"), ({"language": "cobol"}, "unknown"),
                       ({"language": "python", "run_timeout": 0}, "run_timeout"),
                       ({"language": "python", "files": {"x": "!!"}}, "base64")]:
        with pytest.raises(sf._Refused, match=match):
            sf.translate(sf.RunCodeRequest(code="x", **bad))


def test_sandboxfusion_answers_from_the_driver_notes():
    request = sf.RunCodeRequest(code="x", language="cpp", compile_timeout=2, run_timeout=1, fetch_files=["out"])
    toolchain = sf.TOOLCHAINS["cpp"]

    def result(**files) -> FnCallResult:
        return FnCallResult(exit_code=0, stdout="o", stderr="e", files={f"{sf.META}/{k}": v for k, v in files.items()})

    ok = sf.answer(request, toolchain, result(compile=b"0 1.0 1.5", run=b"0 2.0 2.25"))
    assert ok.status == "Success" and ok.compile_result.execution_time == 0.5 and ok.run_result.stdout == "o"
    broken = sf.answer(request, toolchain, result(compile=b"1 1.0 1.2", **{"compile.err": b"error: x"}))
    assert broken.status == "Failed" and broken.run_result is None and broken.compile_result.stderr == "error: x"
    slow = sf.answer(request, toolchain, result(compile=b"124 1.0 3.0"))
    assert slow.compile_result.status == "TimeLimitExceeded" and slow.run_result is None
    spin = sf.answer(request, toolchain, result(compile=b"0 1.0 1.5", run=b"124 2.0 3.0"))
    assert spin.status == "Failed" and spin.run_result.status == "TimeLimitExceeded"
    # a program's own exit code 124, well before its limit, is just that
    own = sf.answer(request, toolchain, result(compile=b"0 1.0 1.5", run=b"124 2.0 2.1"))
    assert own.run_result.status == "Finished" and own.run_result.return_code == 124
    gone = sf.answer(request, toolchain, FnCallResult(exit_code=-9, memory_exceeded=True))
    assert gone.status == "Failed" and gone.compile_result.status == "Error"
    assert "memory limit" in gone.compile_result.stderr


async def test_swerex_replays_keep_the_last_answers_within_their_bounds():
    from fastapi.responses import JSONResponse

    replays = swerex.Replays(max_answers=2, max_bytes=100)
    runs: list[str] = []

    def work(name: str, size: int = 1, keep: bool = True):
        async def run():
            runs.append(name)
            return JSONResponse({"v": name * size}), keep
        return run

    for name in ("a", "b", "c"):
        await replays.once((name,), work(name))
    assert (await replays.once(("c",), work("c"))).body == b'{"v":"c"}' and runs == ["a", "b", "c"]
    await replays.once(("a",), work("a"))  # the oldest was dropped: it runs again
    assert runs == ["a", "b", "c", "a"] and len(replays) == 2
    await replays.once(("big",), work("x", size=200))  # larger than all it may keep: not kept
    await replays.once(("big",), work("x", size=200))
    assert runs[-2:] == ["x", "x"] and len(replays) == 2
    await replays.once(("busy",), work("busy", keep=False))  # nothing ran (Overloaded): run again
    await replays.once(("busy",), work("busy", keep=False))
    assert runs[-2:] == ["busy", "busy"]
