"""Images built as one layer over another (``builders.derive``: apt-get in a chroot of the lower
image under an overlay, whose upper becomes the layer): the lower image's layers are shared as
they are, the new packages and account are there in a sandbox of it, what the lower image had
and the new one removed is gone (a whiteout), and a failed build says why and leaves nothing
mounted."""

from __future__ import annotations

import pytest

from dsec.images import builders
from dsec.images.store import LayerBuildError, LayerStore
from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _mounts_under(path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [t for line in f if (t := line.split()[4]).startswith(str(path))]


async def test_a_derived_image_runs_over_its_lower_images_layers(client, test_store, python_image):
    store = LayerStore(test_store)
    lower = store.get_image("python")
    image = builders.derive(store, "derive-test", "python", ("less",), account="someone", sudoer=False,
                            workdir="/home/someone", user="someone")
    try:
        assert image.layers[:-1] == lower.layers and len(image.layers) == len(lower.layers) + 1
        assert (image.parent, image.user, image.workdir, image.env) == ("python", "someone", "/home/someone", lower.env)
        assert _mounts_under(store.tmp_dir) == []
        async with await client.run_container(DSecContainerRunArgs(container_image="derive-test")) as sandbox:
            run = await sandbox.run_shell("command -v less; id -un; pwd; ls /home; grep -c ':1000:' /etc/passwd; "
                                    "ls /var/lib/apt/lists | wc -l; test -e /usr/sbin/policy-rc.d || echo no-policy")
            assert run.exit_code == 0, run
            assert run.stdout.split() == ["/usr/bin/less", "someone", "/home/someone", "someone", "1", "0", "no-policy"]
    finally:
        store.remove_image("derive-test")


def test_a_package_apt_does_not_know_fails_the_build_and_leaves_nothing(test_store, python_image):
    store = LayerStore(test_store)
    with pytest.raises(LayerBuildError, match="apt-get install no-such-package-here failed"):
        builders.derive(store, "derive-bad", "python", ("no-such-package-here",))
    assert not store.has_image("derive-bad")
    assert _mounts_under(store.tmp_dir) == []
    with pytest.raises(LayerBuildError, match="invalid package name"):
        builders.derive(store, "derive-bad", "python", ("less; rm -rf /",))
