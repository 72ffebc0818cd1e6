"""The older kernels' paths of dsec.isolation.userns: the shifted copy that stands in for an
idmapped view of a tmpfs before Linux 6.3, and the choice of attached idmapped clones before
6.15 (both run for real inside the Debian 12 VM, tests/hosts)."""

from __future__ import annotations

import os
import stat

import pytest

from dsec.isolation import userns


@pytest.mark.skipif(os.geteuid() != 0, reason="chown and mknod need root")
def test_shifted_copy_shifts_ids_back_and_keeps_overlay_markers(tmp_path):
    idmap = userns.IdMap()
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc/passwd").write_text("root\n")
    os.chown(upper / "etc/passwd", idmap.base + 1000, idmap.base + 1000)
    os.chown(upper / "etc", idmap.base, idmap.base)
    os.mknod(upper / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a whiteout
    os.chown(upper / "gone", idmap.base, idmap.base)
    os.setxattr(upper / "etc", "trusted.overlay.opaque", b"y")
    (upper / "suid").write_text("")
    os.chown(upper / "suid", idmap.base, idmap.base)
    os.chmod(upper / "suid", 0o4755)
    with userns._shifted_copy(idmap, upper, tmp_path / "copies") as copy:
        assert (copy / "etc/passwd").read_text() == "root\n"
        assert (copy / "etc/passwd").stat().st_uid == 1000 and (copy / "etc").stat().st_gid == 0
        gone = (copy / "gone").lstat()
        assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0 and gone.st_uid == 0
        assert os.getxattr(copy / "etc", "trusted.overlay.opaque") == b"y"
        assert stat.S_IMODE((copy / "suid").stat().st_mode) == 0o4755
    assert not copy.exists()
    assert (upper / "etc/passwd").stat().st_uid == idmap.base + 1000  # the original is untouched


def test_detached_layers_by_kernel_and_setting(monkeypatch):
    for setting, kernel, expected in (("auto", (6, 1), False), ("auto", (6, 15), True), ("auto", (6, 18), True),
                                      ("attached", (6, 18), False), ("detached", (6, 1), True)):
        monkeypatch.setenv("DSEC_IDMAP_CLONES", setting)
        monkeypatch.setattr(userns, "_kernel_version", lambda k=kernel: k)
        userns.detached_layers.cache_clear()
        assert userns.detached_layers() is expected, (setting, kernel)
    userns.detached_layers.cache_clear()
