"""``dsec call``: one stateless call from the command line (the command itself is in dsec.cli)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from libdsec import DSecClient, DSecFnCallArgs, FnCallResult, InvalidRequest


def read_inputs(code: str | None, code_file: Path | None, stdin_file: Path | None,
                put: list[str], env: list[str]) -> tuple[str, str | None, dict[str, bytes], dict[str, str]]:
    """The call's code, stdin, files and env from the command line's arguments."""
    if code_file is not None:
        source = code_file.read_text()
    elif code is None or code == "-":
        source = sys.stdin.read()
    else:
        source = code
    files = {}
    for item in put:
        path, sep, local = item.partition("=")
        if not sep or not path or not local:
            raise InvalidRequest(f"--put {item!r}: use PATH=LOCAL_FILE")
        files[path] = Path(local).read_bytes()
    variables = {}
    for item in env:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"--env {item!r}: use NAME=VALUE")
        variables[name] = value
    stdin = stdin_file.read_text() if stdin_file is not None else None
    return source, stdin, files, variables


def exit_status(result: FnCallResult) -> int:
    """The shell's convention: 124 for a timeout (as timeout(1)), 128+N for signal N."""
    if result.timed_out:
        return 124
    if result.exit_code < 0:
        return 128 - result.exit_code
    return result.exit_code


def save_fetched(result: FnCallResult, out: Path) -> list[Path]:
    """Write the fetched files under ``out`` (never outside it)."""
    out = out.resolve()
    written = []
    for name, data in result.files.items():
        target = (out / name).resolve()
        if out not in target.parents:
            raise InvalidRequest(f"fetched file {name!r} would land outside {out}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(target)
    return written


def run_call(args: DSecFnCallArgs, out: Path, as_json: bool) -> int:
    async def go() -> FnCallResult:
        async with DSecClient() as client:
            return await client.fncall(args)

    result = asyncio.run(go())
    if as_json:
        sys.stdout.write(result.model_dump_json(indent=1) + "\n")
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.stdout_truncated or result.stderr_truncated:
            sys.stderr.write(f"dsec call: output cut at {args.max_output_bytes} bytes a stream "
                             f"(stdout {result.stdout_bytes}, stderr {result.stderr_bytes} bytes)\n")
        if result.timed_out:
            sys.stderr.write(f"dsec call: timed out after {args.timeout:g}s and was killed\n")
        elif result.memory_exceeded:
            sys.stderr.write(f"dsec call: killed at the {args.memory_limit_mb} MB memory limit\n")
        for path, reason in result.file_errors.items():
            sys.stderr.write(f"dsec call: cannot fetch {path}: {reason}\n")
    save_fetched(result, out)
    return exit_status(result)
