"""Trees and files streamed into and out of a microVM through the SDK (the guest agent feeds
the command's stdin from the host), and a session on it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_trees_files_and_a_session_on_a_microvm(tmp_path_factory, test_store, monkeypatch, tmp_path):
    from dsec.local import LocalServer
    from libdsec import DSecClient, DSecMicroVMRunArgs, InvalidRequest

    from conftest import make_state_dir

    monkeypatch.setenv("DSEC_VM_ASSETS", os.environ.get("DSEC_VM_ASSETS") or str(Path(test_store).parent / "vm"))
    monkeypatch.setenv("DSEC_VM_KSM", "0")
    state = make_state_dir(tmp_path_factory, test_store, "dsec-vm-streams")
    with LocalServer(state, extra_args=("--pool-max", "0")) as srv:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=256), timeout=120)
            try:
                src = tmp_path / "src"
                (src / "pkg").mkdir(parents=True)
                (src / "pkg" / "mod.py").write_text("x = 1\n")
                (src / "big.bin").write_bytes(os.urandom(3 << 20))  # (past the agent's queue of 1 MiB)
                os.symlink("pkg/mod.py", src / "link")
                await vm.files.upload_dir(src, "/tmp/up")
                assert (await vm.run_shell("cat /tmp/up/link; wc -c < /tmp/up/big.bin")).stdout == "x = 1\n3145728\n"
                out = tmp_path / "out"
                await vm.files.download_dir("/tmp/up", out)
                assert (out / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
                assert os.readlink(out / "link") == "pkg/mod.py"
                one = tmp_path / "one.bin"
                one.write_bytes(os.urandom(20 << 20))
                await vm.files.upload_file(one, "/tmp/f/one.bin", mode=0o600)
                back = tmp_path / "back.bin"
                await vm.files.download_file("/tmp/f/one.bin", back)
                assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(one.read_bytes()).digest()
                evil = tmp_path / "evil"
                evil.mkdir()
                os.symlink("/etc/passwd", evil / "out")
                with pytest.raises(InvalidRequest, match="AbsoluteLink"):
                    await vm.files.upload_dir(evil, "/tmp/evil")
                async with await vm.open_session() as session:
                    await session.run_shell("cd /tmp/up && export A=1")
                    assert (await session.run_shell("pwd; echo $A")).stdout == "/tmp/up\n1\n"
            finally:
                await vm.stop()
