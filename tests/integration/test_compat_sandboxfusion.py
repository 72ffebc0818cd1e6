"""SandboxFusion's own client (``sandbox_fusion.run_code``, from the sandbox-fusion package) and
verl's plain POST against a real ``dsec serve``: run_code on the FnCall pool, with SandboxFusion's
statuses. python and bash always; the compiled languages build their toolchain images once
(kept in the shared test store: a first build takes 2-4 minutes each)."""

from __future__ import annotations

import base64

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, run_code

pytestmark = [pytest.mark.slow, pytest.mark.root]


def endpoint(server, token: str | None = None) -> str:
    return f"{server.endpoint}/sandboxfusion/{token or server.token}"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def run(server, **kw):
    return run_code(RunCodeRequest(**kw), endpoint=endpoint(server), max_attempts=1, client_timeout=120)


def test_python_and_bash_through_the_client(server, python_image):
    r = run(server, language="python", code="import sys\nprint(open('data/in.txt').read() + sys.stdin.read())\n"
                                            "open('out.txt', 'w').write('made')",
            stdin="from stdin", files={"data/in.txt": b64("from a file, ")}, fetch_files=["out.txt", "missing.txt"])
    assert r.status == "Success" and r.compile_result is None, r
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == "from a file, from stdin\n"
    assert r.files == {"out.txt": b64("made")}

    r = run(server, language="python", code="raise SystemExit('bad input')")
    assert r.status == "Failed" and r.run_result.status == "Finished" and r.run_result.return_code == 1
    assert "bad input" in r.run_result.stderr

    r = run(server, language="python", code="import time; time.sleep(30)", run_timeout=1)
    assert r.status == "Failed" and r.run_result.status == "TimeLimitExceeded", r

    r = run(server, language="bash", code="read line; echo \"got $line\"; echo warn >&2; exit 3", stdin="x\n")
    assert r.status == "Failed" and r.run_result.return_code == 3, r
    assert (r.run_result.stdout, r.run_result.stderr) == ("got x\n", "warn\n")


def test_verls_plain_post_ping_and_errors(server, python_image):
    payload = {"compile_timeout": 10, "run_timeout": 10, "code": "print(int(input()) * 2)", "stdin": "21",
               "memory_limit_MB": 128, "language": "python", "files": {}, "fetch_files": []}
    answer = httpx.post(f"{endpoint(server)}/run_code", json=payload, timeout=60).json()
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "42\n", answer
    assert httpx.get(f"{endpoint(server)}/v1/ping").json() == "pong"
    # memory_limit_MB (verl sends it; the client's model has no such field)
    big = {**payload, "code": "x = b'x' * (200 << 20); print('allocated')"}
    answer = httpx.post(f"{endpoint(server)}/run_code", json={**big, "memory_limit_MB": 64}, timeout=60).json()
    assert answer["status"] == "Failed" and "MemoryError" in answer["run_result"]["stderr"], answer
    answer = httpx.post(f"{endpoint(server)}/run_code", json={**big, "memory_limit_MB": 512}, timeout=60).json()
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "allocated\n", answer

    assert httpx.get(f"{endpoint(server, 'wrong')}/v1/ping").status_code == 401
    with pytest.raises(Exception, match="code 401"):
        run_code(RunCodeRequest(language="python", code="print(1)"), endpoint=endpoint(server, "wrong"), max_attempts=1)
    # A language SandboxFusion knows and DSec does not run: its SandboxError, which the client raises.
    with pytest.raises(Exception, match="Sandbox responded with error: .*rust"):
        run(server, language="rust", code="fn main() {}")
    answer = httpx.post(f"{endpoint(server)}/run_code", json={**payload, "files": {"a": "not base64!"}}).json()
    assert answer["status"] == "SandboxError" and "base64" in answer["message"]
    assert httpx.post(f"{endpoint(server)}/run_code", json={"code": "x"}).status_code == 422


# -- compiled languages (their images are built once, then kept) --------------------------------

PROGRAMS = {
    "cpp": '#include <iostream>\nint main() { std::string s; std::cin >> s; std::cout << "cpp " << s << std::endl; }\n',
    "nodejs": "const s = require('fs').readFileSync(0, 'utf8').trim(); console.log('nodejs ' + s);\n",
    "go": 'package main\nimport "fmt"\nfunc main() { var s string; fmt.Scan(&s); fmt.Println("go " + s) }\n',
    "java": 'import java.util.Scanner;\npublic class Main { public static void main(String[] a) {\n'
            '  System.out.println("java " + new Scanner(System.in).next()); } }\n',
}
BROKEN = {"cpp": "int main() { return undefined_name; }\n", "go": "package main\nfunc main() { x := }\n"}
SPIN = {"cpp": "int main() { volatile unsigned long i = 0; for (;;) i++; }\n", "nodejs": "for (;;) {}\n",
        "go": "package main\nfunc main() { for {} }\n", "java": "public class Main { public static void main(String[] a) { for (;;) {} } }\n"}


@pytest.fixture(scope="session")
def toolchain_image(request, test_store, python_image):
    """``toolchain_image(language)``: its image's name, once the store has it. At the first call
    every selected language's image the store lacks starts building, two at a time, in the
    tests' order: a debootstrap is mostly one process at a time (checksums, unpacking,
    maintainer scripts), so on a fresh 2-core machine the next images build while the first
    language's test waits for its own and runs, and each test waits only for its own image.
    (After ``python``, built from the same download cache: the toolchains' own packages share
    none, so two builds never download one file into the cache at once.)"""
    from concurrent.futures import Future, ThreadPoolExecutor

    from dsec.compat.sandboxfusion import TOOLCHAINS
    from dsec.images.builders import build_language
    from dsec.images.store import LayerStore

    store = LayerStore(test_store)
    selected = sorted({item.callspec.params["language"] for item in request.session.items
                       if getattr(item, "originalname", None) == "test_a_compiled_language"})
    builds: dict[str, Future] = {}

    def build(name: str) -> None:
        if not store.has_image(name):
            build_language(store, name)

    with ThreadPoolExecutor(2) as pool:  # (leaving it waits for a build still under way)
        def ensure(language: str) -> str:
            for each in (*selected, language):
                if each not in builds:
                    builds[each] = pool.submit(build, TOOLCHAINS[each].image)
            builds[language].result()
            return TOOLCHAINS[language].image

        yield ensure


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_a_compiled_language(server, python_image, toolchain_image, language):
    toolchain_image(language)
    r = run(server, language=language, code=PROGRAMS[language], stdin="stdin-word\n", compile_timeout=60)
    assert r.status == "Success", r
    assert r.run_result.stdout == f"{language} stdin-word\n"
    if language != "nodejs":
        assert r.compile_result.status == "Finished" and r.compile_result.return_code == 0
    if language in BROKEN:
        broken = run(server, language=language, code=BROKEN[language], compile_timeout=60)
        assert broken.status == "Failed" and broken.run_result is None, broken
        assert broken.compile_result.status == "Finished" and broken.compile_result.return_code != 0
        assert broken.compile_result.stderr
    spin = run(server, language=language, code=SPIN[language], compile_timeout=60, run_timeout=1)
    assert spin.status == "Failed" and spin.run_result.status == "TimeLimitExceeded", spin
    if language == "cpp":
        slow = run(server, language="cpp", code=PROGRAMS["cpp"], compile_timeout=0.05)
        assert slow.status == "Failed" and slow.compile_result.status == "TimeLimitExceeded" and slow.run_result is None
