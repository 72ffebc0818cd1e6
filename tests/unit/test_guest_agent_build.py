"""The VM guest agent (native/agent.c) builds as a static program, named by its source's digest
(the initramfs that ships it is named by the digest of what went in: tests/vm boot it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dsec import native

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


def test_agent_builds_static(tmp_path):
    agent = native.binary("agent", tmp_path)
    assert agent.name == f"dsec-agent-{native.digest('agent')}"
    assert native.binary("agent", tmp_path) == agent  # built once
    headers = subprocess.run(["readelf", "-l", str(agent)], capture_output=True, text=True).stdout
    assert "LOAD" in headers and "INTERP" not in headers, headers  # no dynamic loader: runs in any guest
