"""A verdict the agent cannot forge (issue 17, part 1).

The hole: an agent that is root in its sandbox replaces ``/bin/sh`` (or plants a start-up hook),
and every later command of the trainer in that sandbox, the grader's included, prints what the
agent wants. The answer: grade in ``sandbox.clean_copy(keep=[...])``, a new sandbox from the
original image's layers plus only the agent's changes under the kept paths; and see the
tampering as ``file.tampered`` security events.
"""

from __future__ import annotations


import pytest
from pydantic import ValidationError

from libdsec import DSecContainerRunArgs, InvalidRequest, SandboxStateError

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.usefixtures("no_sandbox_outlives_the_test")]

# What an agent under RL pressure does instead of fixing the bug: the grader's shell, whatever
# it is asked, reports success.
PLANT_FORGED_SH = ("rm -f /bin/sh && printf '%s\\n' '#!/bin/busybox ash' \"echo '1 passed'\" 'exit 0' > /bin/sh"
                   " && chmod +x /bin/sh")


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})




async def plant_forged_shell(sandbox) -> None:
    # Through a copy of busybox: once /bin/sh is replaced, every command runs through it.
    r = await sandbox.run_shell(
        "mkdir -p /testbed && echo 'def test(): assert 1 == 2' > /testbed/test_x.py && " + PLANT_FORGED_SH)
    assert r.exit_code == 0, r


async def test_the_hole_the_agents_own_sandbox_forges_the_graders_run(client):
    """Reproduces the hole: the trainer's run_shell in the agent's sandbox prints the agent's
    verdict. (This stays true by design: grade in a clean copy.)"""
    async with await client.run_container(args()) as sandbox:
        await plant_forged_shell(sandbox)
        graded = await sandbox.run_shell("grep -q 'assert 1 == 2' /testbed/test_x.py && echo '1 failed' && exit 1")
        assert graded.exit_code == 0 and graded.stdout == "1 passed\n"  # forged


async def test_a_clean_copy_grades_truly_and_carries_only_the_kept_paths(client):
    async with await client.run_container(args()) as sandbox:
        # The agent's work, beneath the kept path: files, links (never followed), a deletion;
        # and elsewhere a planted loader preload and a note outside the kept path.
        await sandbox.write_file("/testbed/sub/data.txt", "agent work\n")
        await sandbox.write_file("/etc/ld.so.preload", "/lib/evil.so\n")
        await sandbox.write_file("/root/elsewhere.txt", "not kept\n")
        r = await sandbox.run_shell("set -e; ln -s /etc/shadow /testbed/link; ln /testbed/sub/data.txt /testbed/hard;"
                                    " echo x > /testbed/gone; rm /testbed/gone; chmod 0751 /testbed/sub")
        assert r.exit_code == 0, r
        await plant_forged_shell(sandbox)
        async with await sandbox.clean_copy(keep=["/testbed"]) as grader:
            result = grader.clean_copy_result
            assert result.source == sandbox.id and result.keep == ["/testbed"]
            assert "/bin/sh" in result.tampered and "/etc/ld.so.preload" in result.tampered
            assert result.files == 4 and result.bytes == 11 + len("def test(): assert 1 == 2\n")
            graded = await grader.run_shell("grep -q 'assert 1 == 2' /testbed/test_x.py && echo '1 failed' && exit 1")
            assert graded.exit_code == 1 and graded.stdout == "1 failed\n"  # the truth
            check = await grader.run_shell(
                "cat /testbed/sub/data.txt; readlink /testbed/link; test -e /etc/ld.so.preload || echo no-preload;"
                " test -e /root/elsewhere.txt || echo not-carried; stat -c %a /testbed/sub;"
                " stat -c %h /testbed/hard; ls -ld /testbed/sub | cut -c1-10")
            assert check.stdout.split() == ["agent", "work", "/etc/shadow", "no-preload", "not-carried", "751", "2",
                                            "drwxr-x--x"], check
            # The copy is a sandbox of its own: what it does leaves the source alone.
            await grader.run_shell("echo grader > /testbed/sub/data.txt")
        assert (await sandbox.read_file("/testbed/sub/data.txt")) == b"agent work\n"
        events = await sandbox.security_events()
        tampered = [e for e in events if e.kind == "file.tampered"]
        assert tampered and "/bin/sh" in tampered[0].detail and "/etc/ld.so.preload" in tampered[0].detail


async def test_deleted_and_replaced_directories_and_residue(client):
    async with await client.run_container(args()) as sandbox:
        # /etc/network exists in busybox? use a directory the image has: /etc
        r = await sandbox.run_shell(
            "set -e; mkdir -p /work/a /work/b; echo 1 > /work/a/f; echo 2 > /work/b/f;"
            "echo 'ls' > /work/.ash_history; mkdir -p /work/tmp; echo keep > /work/tmp/x")
        assert r.exit_code == 0, r
        snap = await sandbox.pack_diff()
    try:
        async with await client.run_container(args(container_image=snap.image)) as sandbox:
            r = await sandbox.run_shell("set -e; rm -rf /work/a; rm -rf /work/b; mkdir /work/b; echo 3 > /work/b/g;"
                                        "echo hist > /root/.ash_history")
            assert r.exit_code == 0, r
            async with await sandbox.clean_copy(keep=["/work", "/root"]) as grader:
                check = await grader.run_shell("ls /work; ls /work/b; cat /work/b/g; test -e /root/.ash_history || echo scrubbed")
                assert check.stdout.split() == ["b", "tmp", "g", "3", "scrubbed"], check
                assert "/root/.ash_history" in grader.clean_copy_result.scrubbed
    finally:
        await client.remove_image(snap.image)


async def test_bad_keep_paths_and_states_are_named(client):
    async with await client.run_container(args()) as sandbox:
        r = await sandbox.run_shell("set -e; mkdir -p /testbed/in; ln -s /etc /testbed/out; ln -s in /testbed/rel")
        assert r.exit_code == 0, r
        with pytest.raises(InvalidRequest, match="keep path '/nope' does not exist in the sandbox"):
            await sandbox.clean_copy(keep=["/nope"])
        with pytest.raises(InvalidRequest, match=r"keep path '/testbed/out/passwd' passes through the symbolic link "
                                                 r"/testbed/out -> /etc"):
            await sandbox.clean_copy(keep=["/testbed/out/passwd"])
        with pytest.raises(InvalidRequest, match="passes through the symbolic link /testbed/rel -> in"):
            await sandbox.clean_copy(keep=["/testbed/rel"])
        with pytest.raises(InvalidRequest, match="keep path 'testbed' is not an absolute path"):
            await sandbox.clean_copy(keep=["testbed"])
        with pytest.raises(InvalidRequest, match=r"keep path '/testbed/\.\./etc' contains '\.\.'"):
            await sandbox.clean_copy(keep=["/testbed/../etc"])
        with pytest.raises(InvalidRequest, match="keep path '/' would carry all"):
            await sandbox.clean_copy(keep=["/"])
        with pytest.raises(InvalidRequest):
            await sandbox.clean_copy(keep=[])
        await sandbox.pause()
        with pytest.raises(SandboxStateError, match=f"cannot make a clean copy of: sandbox {sandbox.id} is paused"):
            await sandbox.clean_copy(keep=["/testbed"])
        await sandbox.resume()
    with pytest.raises(SandboxStateError, match=f"cannot make a clean copy of: sandbox {sandbox.id} is stopped"):
        await sandbox.clean_copy(keep=["/testbed"])


async def test_tampering_is_recorded_at_stop_and_pack_diff(client):
    sandbox = await client.run_container(args())
    await sandbox.run_shell("mkdir -p /usr/lib/python3/site-packages; echo 'import os' > /usr/lib/python3/site-packages/sitecustomize.py;"
                            " echo x > /root/.profile;"
                            " echo x > /etc/profile; echo fine > /root/notes.txt")
    snap = await sandbox.pack_diff()
    await client.remove_image(snap.image)
    events = [e for e in await sandbox.security_events() if e.kind == "file.tampered"]
    assert [e.detail for e in events] == [
        "system files replaced or added: /etc/profile, /root/.profile, /usr/lib/python3/site-packages/sitecustomize.py"]
    await sandbox.run_shell("cp /bin/busybox /usr/bin/ls2")
    await sandbox.stop()
    events = [e for e in await sandbox.security_events() if e.kind == "file.tampered"]
    assert [e.detail for e in events][-1] == "system files replaced or added: /usr/bin/ls2"  # seen at stop


async def test_the_sync_twin(server):
    from libdsec import SyncDSecClient

    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            sandbox.write_file("/testbed/a", "work")
            with sandbox.clean_copy(["/testbed"]) as grader:
                assert grader.read_file("/testbed/a") == b"work"
                assert grader.clean_copy_result.files == 1


async def test_bad_protected_paths_over_http_name_the_problem(server):
    import httpx

    async with httpx.AsyncClient(base_url=server.endpoint, headers={"authorization": f"Bearer {server.token}"}) as http:
        for bad, said in ((["etc"], "protected path 'etc' is not an absolute path"),
                          (["/etc/../tmp"], "protected path '/etc/../tmp' contains '..'"),
                          (["/"], "protected path '/' would make the whole root read-only")):
            r = await http.post("/v1/sandboxes", json={"container_image": "busybox", "protected_paths": bad})
            assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
            assert said in r.json()["error"]["message"], r.text
        r = await http.post("/v1/sandboxes/n0-0123456789abcdef/clean_copy", json={"keep": ["rel"]})
        assert r.status_code == 422 and "keep path 'rel' is not an absolute path" in r.json()["error"]["message"]


async def test_protected_paths_hold_for_root_inside(client):
    with pytest.raises(ValidationError, match="protected path 'etc' is not an absolute path"):
        args(protected_paths=["etc"])
    with pytest.raises(ValidationError, match=r"contains '\.\.'"):
        args(protected_paths=["/etc/../tmp"])
    with pytest.raises(InvalidRequest, match="protected path '/nope' cannot be protected in image 'busybox'"):
        await client.run_container(args(protected_paths=["/nope"]))
    async with await client.run_container(args(protected_paths=["/bin", "/etc", "/usr/bin"])) as sandbox:
        before = await sandbox.read_file("/bin/sh")
        attempts = {
            "write": "echo x > /bin/sh", "remove": "rm -f /bin/sh", "add": "echo x > /bin/new",
            "chmod": "chmod 777 /bin/sh", "preload": "echo /x.so > /etc/ld.so.preload",
            "remount": "mount -o remount,rw /bin", "remount-bind": "mount -o remount,bind,rw /bin",
            "umount": "umount /bin", "lazy-umount": "umount -l /etc",
            "move-parent": "mkdir -p /x && mount --move /bin /x",
            "rename": "mv /bin /bin2", "over": "mount -t tmpfs tmpfs /bin",
            # The path, not only the directory: its parent cannot be moved away and remade.
            "rename-parent": "mv /usr /usr2 && mkdir -p /usr/bin && echo x > /usr/bin/forged",
            "remove-parent": "rm -rf /usr; mkdir -p /usr/bin && echo x > /usr/bin/forged",
        }
        for what, command in attempts.items():
            r = await sandbox.run_shell(f"/bin/busybox sh -c '{command}' 2>&1; echo rc=$?")
            assert "rc=0" not in r.stdout, (what, r)
        assert await sandbox.read_file("/bin/sh") == before
        check = await sandbox.run_shell("test -e /bin/new || echo no-new; test -e /etc/ld.so.preload || echo no-preload;"
                                        " test -e /usr/bin/forged || echo no-forged; test -e /usr/bin/env && echo env-kept;"
                                        " echo fine > /root/ok && cat /root/ok; grep -c ' /bin ' /proc/mounts")
        assert check.stdout.split() == ["no-new", "no-preload", "no-forged", "env-kept", "fine", "1"], check
        denied = " ".join(e.detail for e in await sandbox.security_events() if e.kind == "syscall.denied")
        assert "mount denied" in denied and "umount2 denied" in denied, denied
        # A clean copy keeps the protection: it has the source's run args.
        async with await sandbox.clean_copy(keep=["/root"]) as grader:
            r = await grader.run_shell("echo x > /bin/sh 2>&1; echo rc=$?; cat /root/ok")
            assert "rc=0" not in r.stdout and "fine" in r.stdout, r
