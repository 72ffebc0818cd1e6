"""The server, the subreaper of what crun leaves behind, reaps the orphan of a run even when
that orphan outlives the first look for it (on a slow machine, crun's forked process exited
after the look a tenth of a second on; no crun ran after it, and it stayed a zombie)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a process of its own: being a subreaper would hand the test runner every orphan after.
SCRIPT = textwrap.dedent("""
    import asyncio, os, shutil
    from dsec import _sys
    from dsec.backends.procs import spawn_wait

    def zombies():
        found = []
        for pid in os.listdir("/proc"):
            try:
                fields = _sys.proc_stat(int(pid))
            except (OSError, ValueError, IndexError):
                continue
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                found.append(pid)
        return found

    async def main():
        _sys.set_child_subreaper()
        # As crun run --detach does: a process in a session of its own forks one that
        # outlives it (and the crun we wait on), in that session's process group.
        rc = await spawn_wait([shutil.which("setsid"), "-w", "sh", "-c", "(sleep {delay}) & exit 0"], None, 1, 10,
                              orphans=1)
        assert rc == 0, rc
        await asyncio.sleep({delay} + 1.5)
        print(zombies())

    asyncio.run(main())
""")


def test_an_orphan_that_outlives_the_first_look_is_reaped():
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(delay=0.5)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
