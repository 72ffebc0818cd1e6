"""``dsec.edge.xattrs`` on the host's own files (the node's side, with no sandbox): one
namespace read and replaced, the bounds, and the namespaces it refuses."""

from __future__ import annotations

import os

import pytest

from dsec.edge import xattrs
from libdsec import InvalidRequest, SandboxFileNotFound


def opener(root):
    return lambda path: os.open(str(root) + path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)


def test_one_namespace_read_and_replaced(tmp_path):
    (tmp_path / "f").write_text("x")
    try:
        os.setxattr(tmp_path / "f", "user.other", b"kept")
    except OSError:
        pytest.skip("this filesystem keeps no user xattrs")
    xattrs.write(opener(tmp_path), "/f", "user.e2b.", {"author": "mish", "purpose": "up"})
    assert xattrs.read(opener(tmp_path), "/f", "user.e2b.") == {"author": "mish", "purpose": "up"}
    xattrs.write(opener(tmp_path), "/f", "user.e2b.", {"author": "again"})  # purpose goes
    assert xattrs.read(opener(tmp_path), "/f", "user.e2b.") == {"author": "again"}
    xattrs.write(opener(tmp_path), "/f", "user.e2b.", {})
    assert xattrs.read(opener(tmp_path), "/f", "user.e2b.") == {}
    assert os.getxattr(tmp_path / "f", "user.other") == b"kept"  # another namespace is left alone
    with pytest.raises(SandboxFileNotFound):
        xattrs.read(opener(tmp_path), "/missing", "user.e2b.")


def test_bounds_and_namespaces(tmp_path):
    (tmp_path / "f").write_text("x")
    for prefix in ("trusted.", "security.", "system.", "user", "user.a b", ""):
        with pytest.raises(InvalidRequest, match="namespace"):
            xattrs.check_prefix(prefix)
    assert xattrs.check_prefix("user.e2b.") == "user.e2b."
    with pytest.raises(InvalidRequest, match="at most"):
        xattrs.write(opener(tmp_path), "/f", "user.e2b.", {str(i): "v" for i in range(xattrs.MAX_KEYS + 1)})
    with pytest.raises(InvalidRequest, match="over"):
        xattrs.write(opener(tmp_path), "/f", "user.e2b.", {"big": "v" * (xattrs.MAX_VALUE + 1)})
    with pytest.raises(InvalidRequest, match="attribute name"):
        xattrs.write(opener(tmp_path), "/f", "user.e2b.", {"": "v"})
