"""How the host tells a VM's opaque directories from the paths where the agent's probe showed."""

from __future__ import annotations

from dsec.backends.vm.pack import opaque_dirs

PROBE = ".dsec-probe-0123456789abcdef"


def test_opaque_dirs_are_those_hiding_the_probe_under_a_visible_parent(tmp_path):
    for d in ("etc", "etc/ssl", "srv/a/b", "usr/lib/x", "usr/lib/x/y"):
        (tmp_path / d).mkdir(parents=True)
    # The probe showed at the root, srv, srv/a, srv/a/b and usr: etc is opaque (so nothing is
    # seen below it, etc/ssl included), and so is usr/lib (x and x/y under it are not asked about).
    seen = [".", "srv", "srv/a", "srv/a/b", "usr"]
    visible = b"\0".join(f"./{p}/{PROBE}".replace("/./", "/").encode() for p in seen) + b"\0"
    assert opaque_dirs(tmp_path, PROBE, visible) == ["etc", "usr/lib"]


def test_nothing_opaque_when_the_probe_shows_everywhere(tmp_path):
    (tmp_path / "a b" / "c").mkdir(parents=True)
    (tmp_path / "to-host").symlink_to("/etc")  # a symlink is never a directory of the layer
    visible = b"\0".join(f"{p}/{PROBE}".encode() for p in (".", "./a b", "./a b/c"))
    assert opaque_dirs(tmp_path, PROBE, visible) == []
