"""What a clean copy carries and what counts as tampering (dsec.images.carry), on plain
directories standing in for an overlay upper and a sandbox's root; the edge's checks over the
fake backend. Whiteouts and overlay xattrs need root."""

from __future__ import annotations

import os
import stat

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.images import carry
from libdsec import InvalidRequest
from libdsec.protocol import DSecContainerRunArgs, DSecMicroVMRunArgs

OPAQUE = "trusted.overlay.opaque"


def test_keep_paths_are_normalized_and_checked():
    assert carry.normalize_paths(["/testbed//src/", "/testbed", "/a/./b", "/b"], "keep path") == [
        "/a/b", "/b", "/testbed"]
    for bad, message in (("rel", "not an absolute path"), ("/a/../etc", "contains '..'"), ("/a\0b", "absolute")):
        with pytest.raises(InvalidRequest, match=message):
            carry.normalize_paths([bad], "keep path")


def test_system_paths():
    for rel in ("bin/sh", "usr/bin/python3", "usr/local/bin/pytest", "lib/x86_64-linux-gnu/libc.so.6",
                "usr/lib64/ld-linux-x86-64.so.2", "sbin/init", "etc/ld.so.preload", "etc/ld.so.conf.d/x.conf",
                "etc/profile", "etc/profile.d/z.sh", "etc/bash.bashrc", "root/.bashrc", "home/agent/.profile",
                "usr/lib/python3/dist-packages/sitecustomize.py", "root/.local/lib/python3.11/site-packages/x.pth",
                "usr/local/lib/python3.11/site-packages/usercustomize.py"):
        assert carry.is_system_path(rel), rel
    for rel in ("testbed/bin/run", "root/notes.txt", "etc/hostname", "usr/share/doc/x", "home/agent/work/a.py",
                "var/log/x", "binary"):
        assert not carry.is_system_path(rel), rel


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_tampered_looks_only_where_it_counts(tmp_path):
    upper = tmp_path / "upper"
    _tree(upper, {"bin/sh": "x", "usr/local/bin/git": "x", "etc/hostname": "x", "root/.bashrc": "x",
                  "root/work/bin/sh": "x", "root/.local/lib/site-packages/evil.pth": "x", "testbed/a.py": "x",
                  "home/agent/.profile": "x", "home/agent/sub/.profile": "x"})
    assert carry.tampered(upper) == ["/bin/sh", "/home/agent/.profile", "/root/.bashrc",
                                     "/root/.local/lib/site-packages/evil.pth", "/usr/local/bin/git"]
    assert carry.tampered(tmp_path / "missing") == []


def test_system_files_from_names_match_the_walk(tmp_path):
    """What a VM's agent lists (``changed``: names relative to its upper) gets the rules
    ``tampered`` applies to a container's upper, home rules included."""
    names = ["bin/sh", "usr/local/bin/git", "etc/hostname", "root/.bashrc", "root/work/bin/sh", "root/work/x.pth",
             "root/.local/lib/site-packages/evil.pth", "root/.local/notes", "home/agent/.profile",
             "home/agent/sub/.profile", "usr/share/doc/hook.pth", "lib", "home/file", "root"]
    assert carry.system_files(names) == ["/bin/sh", "/home/agent/.profile", "/lib", "/root/.bashrc",
                                         "/root/.local/lib/site-packages/evil.pth", "/usr/local/bin/git",
                                         "/usr/share/doc/hook.pth"]
    upper = tmp_path / "upper"
    _tree(upper, {n: "x" for n in names if n not in ("lib", "home/file", "root")})
    assert carry.tampered(upper) == [p for p in carry.system_files(names) if p != "/lib"]
    assert carry.system_files(["usr/bin/a", "usr/bin/b"], limit=1) == ["/usr/bin/a"]


@pytest.mark.root
def test_carry_replays_changes_without_following_links(tmp_path):
    upper, root = tmp_path / "upper", tmp_path / "root"
    _tree(upper, {"testbed/a.py": "work", "testbed/new/b": "b", "etc/passwd": "forged", "tmp/junk": "x"})
    _tree(root, {"testbed/gone": "image", "testbed/old/keep": "image", "testbed/replaced/x": "image",
                 "etc/passwd": "image", "secret": "host"})
    os.symlink("/secret", upper / "testbed" / "link")
    os.mknod(upper / "testbed" / "gone", stat.S_IFCHR, 0)  # a whiteout: deleted by the agent
    (upper / "testbed" / "replaced").mkdir()
    os.setxattr(upper / "testbed" / "replaced", OPAQUE, b"y")
    (upper / "testbed" / "replaced" / "y").write_text("new")
    os.link(upper / "testbed" / "a.py", upper / "testbed" / "hard")
    os.chmod(upper / "testbed" / "new", 0o750)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        carried = carry.carry(upper, fd, ["/testbed", "/tmp"], lambda i: i)
    finally:
        os.close(fd)
    t = root / "testbed"
    assert sorted(os.listdir(t)) == ["a.py", "hard", "link", "new", "old", "replaced"]
    assert os.readlink(t / "link") == "/secret" and (root / "secret").read_text() == "host"
    assert os.listdir(t / "replaced") == ["y"]  # the image's x is gone: the directory was replaced
    assert (t / "old" / "keep").read_text() == "image"  # untouched where the agent did nothing
    assert os.stat(t / "a.py").st_ino == os.stat(t / "hard").st_ino
    assert stat.S_IMODE(os.stat(t / "new").st_mode) == 0o750
    assert (root / "etc" / "passwd").read_text() == "image"  # not kept
    assert carried.scrubbed == ["/tmp/junk"] and (carried.files, carried.bytes) == (5, 4 + 1 + 3)


@pytest.mark.root
def test_kept_layer_keeps_whiteouts_and_opaque_marks(tmp_path):
    upper, dest = tmp_path / "upper", tmp_path / "layer"
    dest.mkdir()
    _tree(upper, {"usr/sbin/only": "new", "usr/bin/x": "forged", "root/w/a": "a", "root/.ash_history": "h"})
    os.setxattr(upper / "usr" / "sbin", OPAQUE, b"y")
    os.mknod(upper / "root" / "w" / "gone", stat.S_IFCHR, 0)
    (upper / "srv").mkdir()
    os.setxattr(upper / "srv", OPAQUE, b"y")
    _tree(upper, {"srv/data/f": "1"})
    carried = carry.kept_layer(upper, dest, ["/usr/sbin", "/root/w", "/root/.ash_history", "/srv/data"])
    assert os.getxattr(dest / "usr" / "sbin", OPAQUE) == b"y" and os.listdir(dest / "usr") == ["sbin"]
    assert os.stat(dest / "root" / "w" / "gone").st_rdev == 0 and stat.S_ISCHR(os.stat(dest / "root" / "w" / "gone").st_mode)
    # Below an opaque directory, the kept path itself becomes opaque (its neighbours are not kept).
    assert os.getxattr(dest / "srv" / "data", OPAQUE) == b"y"
    with pytest.raises(OSError):
        os.getxattr(dest / "srv", OPAQUE)
    assert carried.scrubbed == ["/root/.ash_history"] and carried.files == 3


async def test_protected_paths_are_refused_where_they_cannot_hold(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), [FakeBackend(), FakeBackend("microvm")],
                store)
    await edge.start()
    try:
        with pytest.raises(InvalidRequest, match="a microvm sandbox on node n0 cannot protect paths"):
            await edge.create(DSecMicroVMRunArgs(container_image="tiny", protected_paths=["/usr"]), "microvm")
        info = await edge.create(DSecContainerRunArgs(container_image="tiny"))
        with pytest.raises(InvalidRequest, match="keep path '/' would carry all"):
            await edge.clean_copy(info.id, ["/"])
        await edge.stop(info.id)
    finally:
        await edge.close()
