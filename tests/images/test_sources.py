"""Layer sources: OCI archives (with whiteouts and opaque dirs), workspaces, compositions,
build steps, and the store staying unchanged when a source is bad."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from dsec.images.sources import import_oci
from dsec.images.store import LayerBuildError, LayerStore
from libdsec import DSecContainerRunArgs

DIR = "dir"


def layer(entries: dict[str, bytes | str | tuple]) -> bytes:
    """A layer tar: bytes = file, DIR = directory, ("link", target) = symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, value in entries.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if value == DIR:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(value, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, value[1]
                tar.addfile(info)
            else:
                info.size, info.mode = len(value), 0o644
                tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_archive(path: Path, layers: list[bytes], env=("PATH=/bin",), workdir="/") -> Path:
    config = json.dumps({"config": {"Env": list(env), "WorkingDir": workdir}}).encode()
    with tarfile.open(path, "w") as tar:
        names = []
        for i, data in enumerate(layers):
            names.append(f"l{i}/layer.tar")
            _add(tar, names[-1], data)
        _add(tar, "config.json", config)
        _add(tar, "manifest.json", json.dumps([{"Config": "config.json", "Layers": names}]).encode())
    return path


def oci_layout(path: Path, layers: list[bytes]) -> Path:
    def blob(data: bytes) -> tuple[str, str]:
        hexdigest = hashlib.sha256(data).hexdigest()
        return f"sha256:{hexdigest}", f"blobs/sha256/{hexdigest}"

    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        descs = []
        for data in layers:
            digest, name = blob(data)
            _add(tar, name, data)
            descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": len(data)})
        config = json.dumps({"config": {"Env": ["PATH=/bin", "FROM_OCI=1"]}}).encode()
        cdigest, cname = blob(config)
        _add(tar, cname, config)
        manifest = json.dumps({"schemaVersion": 2, "config": {"digest": cdigest, "size": len(config)}, "layers": descs}).encode()
        mdigest, mname = blob(manifest)
        _add(tar, mname, manifest)
        _add(tar, "index.json", json.dumps({"schemaVersion": 2, "manifests": [{"digest": mdigest, "size": len(manifest)}]}).encode())
    return path


BASE = {"etc": DIR, "etc/keep": b"keep\n", "etc/gone": b"gone\n", "data": DIR, "data/old": b"old\n", "data/sub": DIR,
        "data/sub/x": b"x\n"}
TOP = {"etc/.wh.gone": b"", "data/.wh..wh..opq": b"", "data/new": b"new\n", "etc/added": b"added\n"}


def _tree(store: LayerStore, image_name: str, tmp_path: Path) -> dict[str, str]:
    """What overlayfs shows for an image, read through real mounts of its layers."""
    from dsec import _sys

    image = store.get_image(image_name)
    mounts = []
    try:
        for i, digest in enumerate(image.layers):
            target = tmp_path / f"m{i}"
            target.mkdir()
            _sys.mount(str(store.layer_path(digest)), str(target), "erofs", _sys.MS_RDONLY)
            mounts.append(target)
        merged = tmp_path / "merged"
        merged.mkdir()
        empty = tmp_path / "empty"  # overlayfs wants two lower layers at least
        empty.mkdir()
        lower = ":".join(str(m) for m in [*reversed(mounts), empty])
        _sys.mount("overlay", str(merged), "overlay", _sys.MS_RDONLY, f"lowerdir={lower}")
        mounts.append(merged)
        found = {}
        for dirpath, _, files in os.walk(merged):
            for f in files:
                p = Path(dirpath, f)
                found[str(p.relative_to(merged))] = p.read_text() if p.is_file() else "<not a file>"
        return found
    finally:
        for m in reversed(mounts):
            _sys.umount(str(m))


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.parametrize("maker", [docker_archive, oci_layout])
@pytest.mark.parametrize("merge_below", [0, 1 << 30])
def test_import_applies_whiteouts_and_opaque_dirs(tmp_path, maker, merge_below):
    store = LayerStore(tmp_path / "store")
    archive = maker(tmp_path / "img.tar", [layer(BASE), layer(TOP)])
    image = import_oci(store, archive, "imported", merge_below=merge_below)
    assert len(image.layers) == (1 if merge_below else 2)
    assert image.env["PATH"] == "/bin"
    assert _tree(store, "imported", tmp_path) == {
        "etc/keep": "keep\n", "etc/added": "added\n", "data/new": "new\n",
    }


@pytest.mark.root
def test_a_bottom_layers_digest_does_not_depend_on_when_it_was_imported(tmp_path):
    """A bottom layer that holds deletion markers (a squashed base's leftovers) gives the same
    layer digest in every import: dropping its markers does not leave their directories the
    time of the import."""
    import time

    archive = docker_archive(tmp_path / "img.tar", [layer({**BASE, "etc/.wh.stale": b""})])
    first = import_oci(LayerStore(tmp_path / "one"), archive, "imported").layers
    time.sleep(1.1)
    again = import_oci(LayerStore(tmp_path / "two"), archive, "imported").layers
    assert first == again


@pytest.mark.parametrize(
    "bad_layers, message",
    [
        ([{"../escape": b"x"}], "escapes"),
        ([{"/abs": b"x"}], "escapes"),
        ([{"etc/.wh..." : b""}], "escapes|whiteout"),
        ([{"lnk": ("link", "/etc"), "lnk/passwd": b"x"}], "symlink"),
        ([{"dir": DIR}, {"dir/.wh..": b""}], "whiteout|escapes"),
    ],
)
def test_bad_layers_leave_the_store_unchanged(tmp_path, bad_layers, message):
    store = LayerStore(tmp_path / "store")
    archive = docker_archive(tmp_path / "bad.tar", [layer(entries) for entries in bad_layers])
    with pytest.raises(LayerBuildError, match=message):
        import_oci(store, archive, "bad")
    assert store.image_names() == [] and store.layer_digests() == []
    assert list(store.tmp_dir.iterdir()) == []


def test_corrupt_and_truncated_archives(tmp_path):
    store = LayerStore(tmp_path / "store")
    good = docker_archive(tmp_path / "good.tar", [layer(BASE)]).read_bytes()
    cases = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00not a tar at all" * 100,
        "no-manifest": layer({"a": b"x"}),
    }
    for label, data in cases.items():
        path = tmp_path / f"{label}.tar"
        path.write_bytes(data)
        with pytest.raises(LayerBuildError):
            import_oci(store, path, label)
    with pytest.raises(LayerBuildError, match="no image archive"):
        import_oci(store, tmp_path / "missing.tar", "missing")
    assert store.image_names() == [] and store.layer_digests() == []


@pytest.mark.slow
@pytest.mark.root
async def test_composition_of_base_workspace_and_toolkit(client, server, tmp_path):
    from dsec.images.sources import workspace_from_dir, workspace_from_git

    store = LayerStore(server.state_dir / "store")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "main.sh").write_text("echo from-repo\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "grade.sh").write_text("echo graded\n")
    ws = workspace_from_git(store, repo, "ws-compose-test")
    tk = workspace_from_dir(store, tools, "tk-compose-test", "/opt/harness", role="toolkit")
    try:
        args = DSecContainerRunArgs(container_image="busybox", workspace=ws.name, toolkits=[tk.name])
        async with await client.run_container(args) as sandbox:
            assert sandbox.info.image == "busybox+ws-compose-test+tk-compose-test"
            out = await sandbox.run_shell("sh /workspace/main.sh; sh /opt/harness/grade.sh; ls /bin/sh")
            assert out.stdout.split() == ["from-repo", "graded", "/bin/sh"]
        info = await client.inspect_image("busybox+ws-compose-test+tk-compose-test")
        assert info.roles == ["base", "workspace", "toolkit"]
    finally:
        store.remove_image(ws.name)
        store.remove_image(tk.name)


@pytest.mark.slow
@pytest.mark.root
async def test_build_steps(client, server):
    """Build steps run in a sandbox over the base; a failing step names itself."""
    from dsec.cli_images import _build_steps

    env = {"DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    store = LayerStore(server.state_dir / "store")
    try:
        name = await _build_steps("steps-test", "busybox", ["mkdir -p /opt/t", "echo built > /opt/t/out"], lambda m: None)
        assert store.get_image(name).roles[-1] == "step"
        async with await client.run_container(DSecContainerRunArgs(container_image=name)) as sandbox:
            assert (await sandbox.run_shell("cat /opt/t/out")).stdout == "built\n"
        with pytest.raises(Exception, match=r"step 2 .*exit code 3"):
            await _build_steps("steps-bad", "busybox", ["true", "exit 3"], lambda m: None)
        assert not store.has_image("steps-bad")
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if store.has_image("steps-test"):
            store.remove_image("steps-test")
