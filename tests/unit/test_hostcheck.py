"""Start-up checks and the choice of how layers are attached, on injected probe results (the
host itself is never broken: fake /proc files, a fake modprobe, a fake layer-stack probe)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dsec import hostcheck
from dsec.hostcheck import ProbeFailed, attach_setting, check_host, choose_attach
from dsec.images import loopdev
from libdsec import BackendError

BOTH = "nodev\tsysfs\nnodev\ttmpfs\n\text4\nnodev\toverlay\n\terofs\n"


@pytest.fixture
def host(tmp_path):
    """A host with everything, as files: tests take pieces away."""

    class Host:
        filesystems = tmp_path / "filesystems"
        user_ns = tmp_path / "ns-user"
        max_user_namespaces = tmp_path / "max_user_namespaces"
        loop_control = tmp_path / "loop-control"
        probed: list[tuple[str, bool]] = []
        loaded: list[str] = []
        probe_error: ProbeFailed | None = None
        modules_that_load: dict[str, str] = {}  # module -> the fs type it adds

        def load_module(self, module: str) -> bool:
            self.loaded.append(module)
            if module in self.modules_that_load:
                with open(self.filesystems, "a") as f:
                    f.write(f"\t{self.modules_that_load[module]}\n")
                return True
            if module == "loop" and "loop" in self.modules_that_load:
                return True
            return False

        def probe(self, attach: str, idmapped: bool) -> None:
            self.probed.append((attach, idmapped))
            if self.probe_error is not None:
                raise self.probe_error

        def check(self, **kw) -> list[str]:
            args = dict(attach="file", idmapped=True, filesystems_path=self.filesystems,
                        load_module=self.load_module, probe=self.probe, loop_control=self.loop_control,
                        user_ns=self.user_ns, max_user_namespaces=self.max_user_namespaces, mkfs="sh")
            return check_host(**{**args, **kw})

    h = Host()
    h.probed, h.loaded, h.modules_that_load = [], [], {}
    h.filesystems.write_text(BOTH)
    h.user_ns.write_text("")
    h.max_user_namespaces.write_text("63000\n")
    h.loop_control.write_text("")
    return h


# -- the choice -------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("file", "file"),
                                             ("LOOP", "loop"), (" loop ", "loop")])
def test_attach_setting_reads_the_environment(value, expected):
    env = {} if value is None else {hostcheck.ATTACH_ENV: value}
    assert attach_setting(env) == expected


def test_attach_setting_refuses_anything_else():
    with pytest.raises(BackendError, match="DSEC_LAYER_ATTACH='block': use auto, file or loop"):
        attach_setting({hostcheck.ATTACH_ENV: "block"})


def test_auto_asks_the_probe_and_forced_settings_do_not():
    asked = []

    def probe(answer: bool):
        return lambda: asked.append(answer) or answer

    assert choose_attach("auto", probe(True)) == "file"
    assert choose_attach("auto", probe(False)) == "loop"
    assert asked == [True, False]
    assert choose_attach("file", probe(False)) == "file"
    assert choose_attach("loop", probe(True)) == "loop"
    assert asked == [True, False]


def test_layer_attach_is_decided_once_a_process(monkeypatch):
    calls = []
    monkeypatch.setattr(hostcheck, "erofs_mounts_files", lambda: calls.append(1) or False)
    monkeypatch.delenv(hostcheck.ATTACH_ENV, raising=False)
    hostcheck.layer_attach.cache_clear()
    try:
        assert hostcheck.layer_attach() == "loop"
        monkeypatch.setenv(hostcheck.ATTACH_ENV, "file")
        assert hostcheck.layer_attach() == "loop"  # cached: the process keeps its first answer
        assert calls == [1]
    finally:
        hostcheck.layer_attach.cache_clear()


# -- the checks -------------------------------------------------------------------------------


def test_a_host_with_everything_passes_and_says_how_layers_attach(host, monkeypatch):
    monkeypatch.delenv(hostcheck.ATTACH_ENV, raising=False)
    notes = host.check()
    assert host.probed == [("file", True)]
    assert notes == ["layers: file-backed EROFS mounts (this kernel mounts EROFS files)"]
    notes = host.check(attach="loop")
    assert notes == ["layers: EROFS on read-only loop devices, one per layer "
                     "(this kernel cannot mount EROFS files: Linux < 6.12)"]
    monkeypatch.setenv(hostcheck.ATTACH_ENV, "loop")
    assert host.check(attach="loop") == ["layers: EROFS on read-only loop devices, one per layer (DSEC_LAYER_ATTACH=loop)"]
    assert not host.loaded


def test_no_erofs_names_the_module_and_the_kernel_option(host):
    host.filesystems.write_text("nodev\toverlay\n\text4\n")
    with pytest.raises(BackendError) as e:
        host.check()
    msg = str(e.value)
    assert msg.startswith("this host cannot run DSec sandboxes: the kernel has no EROFS")
    assert "`modprobe erofs`" in msg and "CONFIG_EROFS_FS" in msg
    assert host.loaded == ["erofs"]
    assert host.probed == []  # refused before the probe, which could only fail the same way


def test_no_overlayfs_names_the_module_and_the_kernel_option(host):
    host.filesystems.write_text("\terofs\n")
    with pytest.raises(BackendError, match=r"no overlayfs .*`modprobe overlay`.*CONFIG_OVERLAY_FS"):
        host.check()


def test_every_missing_piece_is_listed_at_once(host):
    host.filesystems.write_text("\text4\n")
    host.max_user_namespaces.write_text("0\n")
    with pytest.raises(BackendError) as e:
        host.check(mkfs="no-such-mkfs.erofs")
    lines = str(e.value).splitlines()
    assert lines[0] == "this host cannot run DSec sandboxes:"
    assert len(lines) == 5, lines
    assert "erofs-utils" in lines[1] and "EROFS" in lines[2] and "overlayfs" in lines[3]
    assert "user.max_user_namespaces" in lines[4]


def test_a_module_that_loads_is_a_note_not_a_problem(host):
    host.filesystems.write_text("nodev\toverlay\n")
    host.modules_that_load["erofs"] = "erofs"
    notes = host.check()
    assert "loaded the erofs kernel module" in notes
    assert host.probed == [("file", True)]


def test_no_user_namespaces_in_the_kernel(host):
    host.user_ns.unlink()
    with pytest.raises(BackendError, match=r"no user namespaces .*CONFIG_USER_NS=y; or set DSEC_USERNS=0"):
        host.check()


def test_user_namespaces_turned_off(host):
    host.max_user_namespaces.write_text("0\n")
    with pytest.raises(BackendError, match=r"sysctl -w user.max_user_namespaces=.*DSEC_USERNS=0"):
        host.check()


def test_without_user_namespaces_on_purpose_they_are_not_needed(host):
    host.user_ns.unlink()
    notes = host.check(idmapped=False)
    assert host.probed == [("file", False)]
    assert any("DSEC_USERNS=0" in n for n in notes)


def test_loop_path_without_loop_devices(host):
    host.loop_control.unlink()
    with pytest.raises(BackendError, match=r"no .*loop-control: `modprobe loop`.*CONFIG_BLK_DEV_LOOP"):
        host.check(attach="loop")
    assert host.loaded == ["loop"]
    host.modules_that_load["loop"] = "x"
    host.loop_control.write_text("")  # what loading the module makes
    host.check(attach="loop")


@pytest.mark.parametrize("attach, step, err, expected", [
    ("file", "mount", errno.ENOTBLK, r"cannot mount a layer file .*Linux 6\.12; set DSEC_LAYER_ATTACH=loop"),
    ("loop", "mount", errno.ENOTTY, r"loop device did not mount .*Linux 5\.8 .*`modprobe loop`"),
    ("file", "userns", None, r"no user namespace .*DSEC_USERNS=0"),
    ("file", "idmap", errno.EINVAL, r"cannot be idmapped .*Linux 5\.12, and EROFS .* 5\.19.*DSEC_USERNS=0"),
    ("loop", "overlay", errno.EINVAL, r"overlayfs does not take idmapped lower layers .*5\.19.*DSEC_USERNS=0"),
])
def test_each_probe_failure_names_the_feature_and_the_kernel(host, attach, step, err, expected):
    host.probe_error = ProbeFailed(step, err, f"{step} failed: {errno.errorcode.get(err, '')}")
    with pytest.raises(BackendError, match=expected):
        host.check(attach=attach)


def test_overlay_failure_without_idmapping_says_so(host):
    host.probe_error = ProbeFailed("overlay", errno.EINVAL, "mount overlay: Invalid argument")
    with pytest.raises(BackendError, match=r"overlayfs did not mount over an EROFS layer"):
        host.check(idmapped=False)


# -- loop devices, as sysfs shows them --------------------------------------------------------


def _fake_loop(sys_block: Path, name: str, backing: str | None) -> None:
    (sys_block / name).mkdir(parents=True)
    if backing is not None:
        (sys_block / name / "loop").mkdir()
        (sys_block / name / "loop" / "backing_file").write_text(backing + "\n")


def test_loop_devices_are_found_by_their_backing_file(tmp_path):
    sys_block = tmp_path / "block"
    layers = tmp_path / "store" / "layers"
    layers.mkdir(parents=True)
    _fake_loop(sys_block, "loop0", f"{layers}/sha256-aa.erofs")
    _fake_loop(sys_block, "loop1", f"{layers}/sha256-bb.erofs (deleted)")
    _fake_loop(sys_block, "loop2", None)  # free
    _fake_loop(sys_block, "loop3", f"{tmp_path}/store/layers-other/x.erofs")
    _fake_loop(sys_block, "vda", None)
    assert loopdev.backed_by(layers, sys_block) == {
        "loop0": f"{layers}/sha256-aa.erofs", "loop1": f"{layers}/sha256-bb.erofs"}
    assert loopdev.backing_file("loop2", sys_block) is None
    assert loopdev.backed_by(tmp_path / "nowhere", tmp_path / "no-sys-block") == {}
