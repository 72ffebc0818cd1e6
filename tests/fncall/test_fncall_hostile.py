"""Bad input and hostile code: each call gets a clear result (or error) of its own, and the pool
goes on serving — with the same worker: none of these needs the worker replaced."""

from __future__ import annotations

import asyncio

import pytest

import libdsec
from fncall_kit import make_pool  # noqa: F401 - a fixture
from libdsec import DSecFnCallArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def run(pool, code: str, **kw) -> libdsec.FnCallResult:
    result = await pool.call(DSecFnCallArgs(code=code, **kw))
    # The pool serves the next call, clean, on the same worker.
    after = await pool.call(DSecFnCallArgs(code="import os\nprint(sum(range(1000)), sorted(os.listdir('/work')), "
                                                "len([p for p in os.listdir('/proc') if p.isdigit()]))"))
    assert (after.exit_code, after.stdout) == (0, "499500 [] 3\n"), after
    assert pool.stats["workers_replaced"] == 0 and pool.stats["workers_started"] == 1
    return result


@pytest.fixture(params=["native", "python"])
async def pool(make_pool, request):
    """A pool whose zygote serves with the C loop, or with the Python one (its fallback)."""
    pool = await make_pool(max_file_bytes=8 << 20, loop=request.param)
    assert (await pool.call(DSecFnCallArgs(code="pass"))).ok
    assert pool.workers()[0].loop == request.param
    return pool


async def test_syntax_error(pool):
    r = await run(pool, "def f(:\n  pass")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr and not r.timed_out


async def test_infinite_loop(pool):
    r = await run(pool, "while True:\n    pass", timeout=1)
    assert r.timed_out and r.exit_code == -9 and 1 <= r.duration_s < 3


async def test_infinite_loop_in_bash_with_children(pool):
    r = await run(pool, "sleep 1000 & sleep 1000 & while :; do :; done", language="bash", timeout=1)
    assert r.timed_out and r.exit_code == -9


async def test_fork_bomb(pool):
    r = await run(pool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  timeout=2)
    assert r.timed_out


async def test_bash_fork_bomb(pool):
    # The bomb runs in the background; the shell waits a moment (while it hits the process
    # limit), then the zygote kills whatever is left.
    r = await run(pool, ":(){ :|:& };:; sleep 1; echo done", language="bash", timeout=3)
    # Contained: it ran into the call's process limit (bash's fork fails with EAGAIN), the call
    # ended by its timeout, and (``run``) nothing of it outlived the call.
    assert "Resource temporarily unavailable" in r.stderr, r
    assert r.duration_s < 3 + 1.5 and (r.timed_out or r.stdout.endswith("done\n")), r


async def test_escaping_the_process_group(pool):
    """Children that leave the call's session and outlive it are killed all the same."""
    r = await run(pool, "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
                        "        if os.fork() == 0:\n            time.sleep(1000)\n        os._exit(0)\nprint('bye')")
    assert r.exit_code == 0 and r.stdout == "bye\n"


async def test_memory_bomb(pool):
    r = await run(pool, "x = bytearray(10 ** 10)", memory_limit_mb=64)
    assert r.exit_code == 1 and "MemoryError" in r.stderr
    r = await run(pool, "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)", memory_limit_mb=64)
    assert r.exit_code == 1 and "MemoryError" in r.stderr


async def test_memory_bomb_in_many_processes(pool):
    """Each process keeps within its address space; together they pass the worker's memory
    limit and the kernel kills the biggest of them (the call's, never the zygote)."""
    r = await run(pool, "import os, time\npids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
                        "        x = bytearray(60 << 20)\n        for i in range(0, len(x), 4096):\n"
                        "            x[i] = 1\n        time.sleep(3)\n        os._exit(0)\n    pids.append(pid)\n"
                        "print(sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids))",
                  memory_limit_mb=64, timeout=20)
    killed = r.stdout.count("-9")
    assert r.exit_code == 0 and killed >= 3, r  # 6 × 60 MB in a 64 + 64 MB worker


async def test_memory_limits_that_change_from_call_to_call(pool):
    for memory_mb in (512, 32, 256, 16, 1024, 64):
        r = await run(pool, "x = bytearray(24 << 20)\nprint(len(x) >> 20)", memory_limit_mb=memory_mb)
        if memory_mb > 24:
            assert r.stdout == "24\n", r
        else:
            assert "MemoryError" in r.stderr, r


async def test_os_exit(pool):
    r = await run(pool, "import os\nprint('unflushed', end='')\nos._exit(3)")
    assert r.exit_code == 3 and r.stdout == ""  # as with python3 -c: the buffer was not flushed


async def test_killing_the_parent(pool):
    r = await run(pool, "import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n    except OSError as exc:\n"
                        "        print(pid, type(exc).__name__)\nprint('alive')")
    assert r.exit_code == 0 and "PermissionError" in r.stdout and r.stdout.endswith("alive\n")


async def test_killing_itself(pool):
    r = await run(pool, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert r.exit_code == -11


async def test_writing_outside_the_workdir(pool):
    r = await run(pool, "import os\nfor path in ('/etc/passwd', '/x', '/usr/bin/python3', '/root/x', '/dev/x', "
                        "'/dev/.dsec-zygote.py', '/proc/sys/kernel/hostname'):\n    try:\n"
                        "        open(path, 'a').write('x')\n        print(path, 'WRITTEN')\n"
                        "    except OSError as exc:\n        print(path, exc.errno)\n"
                        "open('/tmp/kept-here', 'w').write('only until the call ends')")
    assert "WRITTEN" not in r.stdout, r.stdout


async def test_fetching_through_symlinks(pool):
    r = await run(pool, "ln -s /etc etc; ln -s /proc/self me; ln -s ../../etc/passwd up; mkdir d; echo in > d/f; "
                        "ln -s d/f final; ln -s d dir", language="bash",
                  fetch_files=["etc/passwd", "me/environ", "up", "final", "dir/f"])
    assert r.files == {"dir/f": b"in\n"}, r
    assert r.file_errors == {"etc/passwd": "outside the working directory", "me/environ": "outside the working directory",
                             "up": "a symbolic link", "final": "a symbolic link"}, r.file_errors


async def test_code_with_a_nul_byte(pool):
    """Neither language runs code cut short at a NUL byte."""
    r = await run(pool, "echo a\0echo b", language="bash")
    assert (r.exit_code, r.stdout) == (126, "") and "could not start" in r.stderr, r
    r = await run(pool, "print('a')\0print('b')")
    assert (r.exit_code, r.stdout) == (1, "") and "null bytes" in r.stderr, r


async def test_input_files_that_cannot_be_written(pool):
    """"a" is a file, so "a/b" cannot be made: the call does not start (126, and why)."""
    r = await run(pool, "print(1)", files={"a": "x", "a/b": "y"})
    assert (r.exit_code, r.stdout) == (126, "") and "fncall: the call could not start" in r.stderr, r
    assert "a" in r.stderr


async def test_output_of_every_size_arrives_whole(pool):
    """Output up to 16 KiB travels in the answer's own write (C loop), more with sendfile; both
    arrive whole, and cut at max_output_bytes."""
    for n in (0, 1, 16383, 16384 - 7, 16384, 16385, 100 << 10):
        r = await pool.call(DSecFnCallArgs(code=f"import sys\nsys.stdout.write('a' * {n})\nsys.stderr.write('b' * 7)"))
        assert (r.stdout, r.stderr, r.stdout_bytes) == ("a" * n, "b" * 7, n), n
    r = await run(pool, "import sys\nsys.stdout.write('a' * 20000)\nsys.stderr.write('b' * 20000)",
                  max_output_bytes=9000)
    assert (r.stdout, r.stderr, r.stdout_truncated, r.stderr_bytes) == ("a" * 9000, "b" * 9000, True, 20000)


async def test_huge_output(pool):
    r = await run(pool, "import sys\nsys.stdout.write('x' * (100 << 20))", max_output_bytes=1000)
    assert r.stdout == "x" * 1000 and r.stdout_truncated and r.stdout_bytes > 1000
    assert "File too large" in r.stderr  # stops at the file size limit, not at 100 MiB
    r = await run(pool, "yes", language="bash", max_output_bytes=10, timeout=30)
    assert r.stdout == "y\n" * 5 and r.stdout_truncated and not r.timed_out
    assert r.exit_code == -25  # SIGXFSZ at the file size limit


async def test_reading_another_calls_files(make_pool):
    """Two calls at once run in two workers; neither can find the other's files."""
    pool = await make_pool(workers_min=2, workers_max=2)
    writer = asyncio.create_task(pool.call(DSecFnCallArgs(
        code="open('/work/secret.txt', 'w').write('s')\nopen('/tmp/secret.txt', 'w').write('s')\n"
             "import time; time.sleep(3)")))
    await asyncio.sleep(1)
    reader = await pool.call(DSecFnCallArgs(
        code="import glob, os\nfound = glob.glob('/work/**', recursive=True) + glob.glob('/tmp/**', recursive=True)\n"
             "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
             "        found += glob.glob(f'/proc/{pid}/root/work/*') + glob.glob(f'/proc/{pid}/cwd/*')\n"
             "print(sorted(f for f in found if 'secret' in f))"))
    assert reader.stdout == "[]\n", reader
    assert (await writer).ok


async def test_bad_requests_are_errors_of_their_own(pool):
    calls = [DSecFnCallArgs(code="print(1)"), DSecFnCallArgs(code="x", language="cobol"),
             DSecFnCallArgs(code="print(2)", files={"../../etc/x": b"x"}),
             DSecFnCallArgs(code="print(3)", memory_limit_mb=1 << 20), DSecFnCallArgs(code="print(4)")]
    results = await pool.call_many(calls)
    assert [r.error.code if r.error else r.stdout for r in results] == [
        "1\n", "invalid_request", "invalid_request", "limit_out_of_range", "4\n"]
    assert "cobol" in results[1].error.message


async def test_landlock_holds_even_a_root_call(make_pool):
    """With calls run as root in the worker (uid 0, as no pool does by default), what stops a
    call is its Landlock domain alone: it cannot signal its zygote, nor write outside /work,
    /tmp and /dev/shm (here: create a file in the worker's own /dev, which root could)."""
    pool = await make_pool(uid_base=0, uid_count=1)
    r = await pool.call(DSecFnCallArgs(code=(
        "import os, signal\nprint(os.getuid())\n"
        "try:\n    os.kill(os.getppid(), signal.SIGKILL); print('KILLED')\nexcept OSError as exc:\n    print(exc.errno)\n"
        "for path in ('/dev/x', '/work/ok', '/tmp/ok'):\n"
        "    try:\n        open(path, 'w').write('x'); print(path, 'written')\n"
        "    except OSError as exc:\n        print(path, exc.errno)\n")))
    assert r.stdout.split("\n")[:5] == ["0", "1", "/dev/x 13", "/work/ok written", "/tmp/ok written"], r
    again = await pool.call(DSecFnCallArgs(code="print('next')"))
    assert again.stdout == "next\n" and pool.stats["workers_replaced"] == 0
