"""The FnCall pool over real containers: what a call sees, that every call starts from the same
clean state, and how the pool grows, shrinks and replaces its workers."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import libdsec
from fncall_kit import alive, make_pool, zygote_pid  # noqa: F401 - make_pool is a fixture
from libdsec import DSecFnCallArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]


def call(code: str, **kw) -> DSecFnCallArgs:
    return DSecFnCallArgs(code=code, **kw)


LOOPS = pytest.mark.parametrize("loop", ["native", "python"])  # the zygote's C loop, and its fallback


@LOOPS
async def test_python_and_bash(make_pool, loop):
    pool = await make_pool(loop=loop)
    r = await pool.call(call("import os, sys\nprint(sum(range(1000)), os.getcwd(), os.environ['HOME'], sys.argv, "
                             "__name__)\nprint('warn', file=sys.stderr)\nsys.exit(3)"))
    assert (r.exit_code, r.stdout, r.stderr) == (3, "499500 /work /work ['-c'] __main__\n", "warn\n")
    assert r.duration_s > 0 and r.worker_s >= r.duration_s and not r.timed_out
    r = await pool.call(call("import helper, sys\nprint(helper.x + sys.stdin.read())\nopen('out.txt', 'w').write('o')",
                             stdin="in", files={"helper.py": "x = 'h'", "d/data.bin": b"\x00\xff"},
                             fetch_files=["out.txt", "d/data.bin", "missing.txt", "d"]))
    assert r.exit_code == 0 and r.stdout == "hin\n"
    assert r.files == {"out.txt": b"o", "d/data.bin": b"\x00\xff"}
    assert r.file_errors == {"missing.txt": "no such file", "d": "not a regular file"}
    r = await pool.call(call("echo $0 $HOME $GREETING; cat a.txt; read x; echo got $x; exit 4", language="bash",
                             env={"GREETING": "hi"}, files={"a.txt": "A\n"}, stdin="line\n"))
    assert (r.exit_code, r.stdout) == (4, "bash /work hi\nA\ngot line\n")
    env = await pool.call(call("import os; print(sorted(os.environ.items()))"))
    assert env.stdout == str(sorted({"HOME": "/work", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                                     "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}.items())) + "\n"
    env = await pool.call(call("env | sort", language="bash", env={"X": "1"}))
    assert "X=1\nHOME=/work" not in env.stdout and "X=1\n" in env.stdout and "PYTHON" not in env.stdout
    env = await pool.call(call("env", language="bash", env={"HOME": "/tmp", "Y": "2=3"}))
    assert "HOME=/tmp\n" in env.stdout and "HOME=/work" not in env.stdout and "Y=2=3\n" in env.stdout


async def test_python_errors_look_like_python3_c(make_pool):
    pool = await make_pool()
    r = await pool.call(call("def f():\n    1 / 0\nf()"))
    assert r.exit_code == 1
    assert r.stderr == ('Traceback (most recent call last):\n  File "<string>", line 3, in <module>\n'
                        '  File "<string>", line 2, in f\nZeroDivisionError: division by zero\n')
    r = await pool.call(call("raise SystemExit('bye')"))
    assert (r.exit_code, r.stderr) == (1, "bye\n")
    r = await pool.call(call("import sys; sys.excepthook = lambda *a: print('hooked', file=sys.stderr); 1/0"))
    assert (r.exit_code, r.stderr) == (1, "hooked\n")


@LOOPS
async def test_every_call_starts_clean(make_pool, loop):
    """One worker serves both calls: the second sees nothing the first left."""
    pool = await make_pool(loop=loop)
    first = await pool.call(call(
        "import os, subprocess, sys\n"
        "leftover = 42\n"
        "sys.modules['struct'].pack = None  # a module the zygote holds\n"
        "os.environ['LEFT'] = 'over'\n"
        "for path in ('/work/w.txt', '/tmp/t.txt', '/dev/shm/s.txt', '/work/d/e/f.txt'):\n"
        "    os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "    open(path, 'w').write('left')\n"
        "os.chmod('/work', 0o777)\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        import time; time.sleep(300)\n"
        "    os._exit(0)\n"
        "print(os.getpid())\n"))
    assert first.exit_code == 0, first.stderr
    second = await pool.call(call(
        "import os, stat, struct\n"
        "print('leftover' in globals(), os.environ.get('LEFT'), struct.pack is None)\n"
        "print(sorted(os.listdir('/work')), os.listdir('/tmp'), os.listdir('/dev/shm'))\n"
        "print(oct(stat.S_IMODE(os.stat('/work').st_mode)), os.stat('/work').st_uid == os.getuid())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == sorted({1, os.getppid(), os.getpid()}))\n"))
    assert second.stdout.splitlines() == ["False None False", "[] [] []", "0o700 True", "True"], second.stderr
    assert pool.stats["workers_started"] == 1  # the same worker served both


@LOOPS
async def test_a_call_holds_no_fd_of_the_zygote(make_pool, loop):
    """A call's code finds only its stdin, stdout and stderr open: not the channel, not a memfd,
    not the request body its child read its code from (the C loop's BODY_FD)."""
    pool = await make_pool(loop=loop)
    r = await pool.call(call("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))", env={"A": "b"}))
    # listdir holds one fd of its own while it reads
    assert r.exit_code == 0, r.stderr
    (fds,) = [eval(line) for line in r.stdout.splitlines()]  # noqa: S307 - a list of ints we printed
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, fds


@LOOPS
async def test_the_zygotes_bind_now_is_not_the_calls(make_pool, loop):
    """The edge starts the zygote with LD_BIND_NOW (its symbols bound once, not in every child);
    the calls' environment, Python's and bash's, is the image's without it."""
    pool = await make_pool(loop=loop)
    r = await pool.call(call("import os; print(os.environ.get('LD_BIND_NOW'), os.environ['HOME'])"))
    assert r.stdout == "None /work\n", r.stderr
    r = await pool.call(call('echo "[${LD_BIND_NOW-unset}]"', language="bash"))
    assert r.stdout == "[unset]\n", r.stderr
    r = await pool.call(call("import os; print(os.environ.get('LD_BIND_NOW'))", env={"LD_BIND_NOW": "1"}))
    assert r.stdout == "1\n", r.stderr


@LOOPS
async def test_no_memory_of_an_earlier_call(make_pool, loop):
    """A child is a copy of the zygote: the zygote must hold nothing of a call, not even in freed
    memory, or the next call could read the last one's code, input or output there (nor the
    names of the files it fetched)."""
    pool = await make_pool(loop=loop)
    secret = "DSEC-SECRET-" + os.urandom(8).hex()
    r = await pool.call(call(f"s = {secret!r}\nprint(s + input())\nopen('f', 'w').write(s)", stdin=secret,
                             files={"in.txt": secret}, fetch_files=["f", f"{secret}.txt"], env={"S": secret}))
    assert r.stdout == secret * 2 + "\n" and r.files == {"f": secret.encode()}
    assert r.file_errors == {f"{secret}.txt": "no such file"}
    scan = (
        "import os, re\n"
        "mine = 'DSEC-SECRET-' + os.urandom(8).hex()  # a control: the scan must find this one\n"
        "found = set()\n"
        "mem = os.open('/proc/self/mem', os.O_RDONLY)\n"
        "for line in open('/proc/self/maps'):\n"
        "    addr, perms = line.split()[:2]\n"
        "    if 'r' not in perms or line.rstrip().endswith(('[vvar]', '[vsyscall]')):\n"
        "        continue\n"
        "    start, end = (int(x, 16) for x in addr.split('-'))\n"
        "    try:\n"
        "        data = os.pread(mem, end - start, start)\n"
        "    except OSError:\n"
        "        continue\n"
        "    found.update(m.decode() for m in re.findall(rb'DSEC-SECRET-[0-9a-f]{16}', data))\n"
        "print(mine in found, sorted(found - {mine}))\n")
    r = await pool.call(call(scan))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "True []\n", f"the earlier call's secret is readable: {r.stdout}"


async def test_what_a_call_may_do(make_pool):
    pool = await make_pool()
    r = await pool.call(call(
        "import os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid() != 0, int(status['CapEff'], 16), status['NoNewPrivs'].strip(), status['Seccomp'].strip())\n"
        "print(sorted(os.listdir('/sys/class/net')))\n"
        "for path in ('/etc/passwd', '/x', '/usr/lib/x', '/root/x', '/dev/x', '/proc/1/environ', f'/proc/{os.getppid()}/mem'):\n"
        "    try:\n"
        "        open(path, 'a').close()\n"
        "        print(path, 'writable')\n"
        "    except OSError as exc:\n"
        "        print(path, type(exc).__name__)\n"))
    lines = r.stdout.splitlines()
    assert lines[0] == "True 0 1 2"  # not root, no capabilities, no_new_privs, seccomp filter
    assert lines[1] == "['lo']"  # no network
    assert all(not line.endswith("writable") for line in lines[2:]), lines


async def test_ipc_that_would_outlive_a_call_is_off(make_pool):
    pool = await make_pool()
    r = await pool.call(call(
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0, 4096, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600))\n"))
    assert r.stdout == "-1 -1 -1\n", r.stderr


async def test_unsupported_language_and_bad_calls(make_pool):
    pool = await make_pool()
    with pytest.raises(libdsec.InvalidRequest, match="unsupported language 'ruby'"):
        await pool.call(call("puts 1", language="ruby"))
    results = await pool.call_many([call("print(1)"), call("x", language="ruby"), call("print(2)", timeout=-1),
                                    call("print(3)")])
    assert [r.stdout for r in results] == ["1\n", "", "", "3\n"]
    assert results[1].error.code == "invalid_request" and results[2].error.code == "limit_out_of_range"
    assert results[0].error is None and results[3].ok


async def test_grows_for_calls_that_wait_and_shrinks_back(make_pool):
    pool = await make_pool(workers_min=1, workers_max=4, idle_s=0.5, slow_call_s=0.05)
    results = await asyncio.gather(*(pool.call(call("import time; time.sleep(2)")) for _ in range(4)))
    assert all(r.ok for r in results)
    assert pool.stats["workers_started"] >= 2
    deadline = time.monotonic() + 30
    while len(pool.workers()) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert len(pool.workers()) == 1 and pool.stats["workers_retired"] >= 1


async def test_a_cancelled_call_keeps_its_worker(make_pool):
    """A caller that goes away (a client disconnects, say) does not cost the pool a worker."""
    pool = await make_pool()
    task = asyncio.create_task(pool.call(call("import time; time.sleep(1)")))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await pool.call(call("print(2)"))).stdout == "2\n"
    assert pool.stats["workers_replaced"] == 0 and pool.stats["workers_started"] == 1


async def test_a_queued_call_whose_caller_goes_away_is_dropped(make_pool):
    """A call still waiting for a worker when its caller goes away is never sent."""
    pool = await make_pool()
    first = asyncio.create_task(pool.call(call("import time; time.sleep(0.5); print(1)")))
    await asyncio.sleep(0.2)
    queued = asyncio.create_task(pool.call(call("print(2)")))
    await asyncio.sleep(0.1)
    queued.cancel()
    assert (await first).stdout == "1\n"
    with pytest.raises(asyncio.CancelledError):
        await queued
    (worker,) = pool.workers()
    assert worker.calls == 1 and not worker.busy
    assert (await pool.call(call("print(3)"))).stdout == "3\n"
    assert worker.calls == 2 and pool.stats["workers_started"] == 1


async def test_a_zygote_that_dies_between_calls_is_replaced(make_pool):
    pool = await make_pool()
    assert (await pool.call(call("print(1)"))).ok
    (worker,) = pool.workers()
    pid = zygote_pid(worker)
    os.kill(pid, signal.SIGKILL)
    while alive(pid):
        await asyncio.sleep(0.01)
    r = await pool.call(call("print(2)"))  # goes to a new worker
    assert r.stdout == "2\n"
    assert pool.stats["workers_replaced"] == 1 and pool.workers()[0] is not worker


async def test_a_zygote_that_dies_during_a_call_fails_that_call_alone(make_pool):
    pool = await make_pool()
    assert (await pool.call(call("print(1)"))).ok
    (worker,) = pool.workers()
    pending = asyncio.create_task(pool.call(call("import time; time.sleep(30)")))
    await asyncio.sleep(0.5)
    os.kill(zygote_pid(worker), signal.SIGKILL)
    with pytest.raises(libdsec.BackendError, match="failed during the call"):
        await pending
    assert (await pool.call(call("print(2)"))).stdout == "2\n"


async def test_a_hung_zygote_is_replaced(make_pool):
    pool = await make_pool(answer_grace_s=1.0)
    assert (await pool.call(call("print(1)"))).ok
    (worker,) = pool.workers()
    os.kill(zygote_pid(worker), signal.SIGSTOP)
    with pytest.raises(libdsec.BackendError, match="no answer"):
        await pool.call(call("print(2)", timeout=0.5))
    assert (await pool.call(call("print(3)"))).stdout == "3\n"
    assert pool.stats["workers_replaced"] == 1


async def test_an_image_without_python(make_pool):
    pool = await make_pool(prewarm=())
    for _ in range(2):  # the first start fails, the second confirms: then calls fail at once
        with pytest.raises(libdsec.BackendError, match="busybox"):
            await pool.call(call("echo hi", language="bash", image="busybox"))
    with pytest.raises(libdsec.ImageNotFound):
        await pool.call(call("print(1)", image="no-such-image"))


async def test_the_c_loop_serves_and_the_python_loop_stands_in(make_pool, tmp_path, caplog):
    """The zygote serves with its C loop; where that cannot be loaded (say, an image whose libc
    is not glibc) its Python loop serves instead, and the worker's log says why."""
    pool = await make_pool()
    assert (await pool.call(call("print(1)"))).stdout == "1\n"
    assert pool.workers()[0].loop == "native"
    if "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert pool.workers()[0].code_on_huge_pages >= 2 << 20  # the image's python3.11, 4 MiB of it
    not_a_library = tmp_path / "not-a-library.so"
    not_a_library.write_bytes(b"\x7fELF, not really")
    caplog.set_level("WARNING", logger="dsec.fncall")
    pool = await make_pool(loop_library=not_a_library)
    r = await pool.call(call("import os\nprint(os.getuid() != 0)", fetch_files=["x"]))
    assert (r.stdout, r.file_errors) == ("True\n", {"x": "no such file"})
    assert pool.workers()[0].loop == "python"
    assert pool.workers()[0].code_on_huge_pages == 0
    for _ in range(50):  # the zygote's log is read by a task of its own
        if "the Python loop serves: cannot load /dev/.dsec-zygote.so" in caplog.text:
            break
        await asyncio.sleep(0.05)
    assert "the Python loop serves: cannot load /dev/.dsec-zygote.so" in caplog.text
