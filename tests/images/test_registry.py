"""``dsec image pull`` from an OCI registry and ``dsec image build --dockerfile``, against a
registry served on loopback by Debian's docker-registry (started and stopped here, with
htpasswd credentials); the images are then run in sandboxes of a real ``dsec serve``."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import bcrypt
import httpx
import pytest

from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

USER, PASSWORD = "dsec", "s3cret-pw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A docker-registry on 127.0.0.1 with htpasswd auth; yields its host:port."""
    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.fail("docker-registry and skopeo are needed: scripts/setup-host.sh installs them")
    work = tmp_path_factory.mktemp("registry")
    port = free_port()
    (work / "htpasswd").write_text(f"{USER}:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}\n")
    (work / "config.yml").write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(work / "data")}},
        "http": {"addr": f"127.0.0.1:{port}"},
        "auth": {"htpasswd": {"realm": "test", "path": str(work / "htpasswd")}},
    }))
    log = open(work / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(work / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 401:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not come up: {(work / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _layer(files: dict[str, bytes | None], dirs: tuple[str, ...] = ()) -> bytes:
    """A gzipped layer tar: ``None`` content is a whiteout of that path."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, data in files.items():
            if data is None:
                head, _, base = path.rpartition("/")
                path, data = f"{head}/.wh.{base}" if head else f".wh.{base}", b""
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755 if path.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def push_layers(layout: Path, layers: list[bytes], cfg: dict, ref: str) -> str:
    """gzip ``layers`` (bottom first) and config ``cfg`` as one image in an OCI layout at
    ``layout``, pushed to ``ref`` (registry/name:tag) with the test's credentials; ``ref``."""
    blobs = layout / "blobs/sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    diff_ids = [f"sha256:{hashlib.sha256(gzip.decompress(layer)).hexdigest()}" for layer in layers]
    config = {"architecture": "amd64", "os": "linux", "config": cfg, "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(json.dumps(config).encode())},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob(layer)} for layer in layers]}
    m = json.dumps(manifest).encode()
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(m),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", f"{USER}:{PASSWORD}",
                    f"oci:{layout}:v1", f"docker://{ref}"], check=True, capture_output=True)
    return ref


def push_base_image(registry: str, tmp: Path) -> str:
    """A two-layer image (busybox, then a file and a whiteout) pushed as test/base:v1."""
    busybox = Path("/bin/busybox").read_bytes()
    base = _layer({"bin/busybox": busybox, "bin/sh": busybox, "bin/cat": busybox, "bin/ls": busybox,
                   "etc/hostname": b"old\n", "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n"},
                  dirs=("bin", "etc", "tmp", "root"))
    top = _layer({"hello.txt": b"hello from the registry\n", "etc/hostname": None})
    return push_layers(tmp / "layout", [base, top],
                       {"Env": ["PATH=/bin", "FROM_IMAGE=yes"], "WorkingDir": "/root", "Cmd": ["/bin/sh"]},
                       f"{registry}/test/base:v1")


@pytest.fixture(scope="module")
def base_image(registry, tmp_path_factory) -> str:
    return push_base_image(registry, tmp_path_factory.mktemp("base"))


def auth_file(tmp: Path, registry: str) -> Path:
    path = tmp / "auth.json"
    path.write_text(json.dumps({"auths": {registry: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    return path


def dsec_image(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsec", "image", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture
def names(test_store):
    """Unique image names in the shared test store, removed afterwards."""
    from dsec.images.store import LayerStore

    made: list[str] = []

    def name(kind: str) -> str:
        made.append(f"test-{kind}-{secrets.token_hex(4)}")
        return made[-1]

    yield name
    store = LayerStore(test_store)
    for n in made:
        if store.has_image(n):
            store.remove_image(n, in_use=frozenset())


async def test_pull_with_credentials_merges_layers_and_runs(registry, base_image, tmp_path, server, client, names,
                                                           monkeypatch):
    from dsec.images.registry import pull
    from dsec.images.store import LayerBuildError, LayerStore

    ref, state = base_image, server.state_dir
    store = LayerStore(state / "store")
    merged, split = names("pulled"), names("pulled-split")

    # No credentials: the registry's refusal, named.
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(LayerBuildError, match="(?i)unauthorized"):
        pull(store, merged, ref, insecure=True)
    monkeypatch.undo()

    # The CLI with the usual auth file (REGISTRY_AUTH_FILE, as `skopeo login` writes it): the
    # two small layers merged into one.
    r = dsec_image("pull", merged, ref, "--insecure", "--state-dir", str(state),
                   env={"REGISTRY_AUTH_FILE": str(auth_file(tmp_path, registry))})
    assert r.returncode == 0 and "1 layer(s)" in r.stdout, r
    # --authfile, layers kept apart.
    image = pull(store, split, ref, insecure=True, merge_below=0, authfile=auth_file(tmp_path, registry))
    assert len(image.layers) == 2
    assert store.get_image(merged).env["FROM_IMAGE"] == "yes" and store.get_image(merged).workdir == "/root"

    for image in (merged, split):
        async with await client.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=64)) as sb:
            out = await sb.run_shell("cat /hello.txt; ls /etc; echo $FROM_IMAGE")
            assert out.stdout == "hello from the registry\npasswd\nyes\n", (image, out)

    with pytest.raises(LayerBuildError, match="pulling .*no-such"):
        pull(store, names("x"), f"{registry}/test/no-such:v1", insecure=True, authfile=auth_file(tmp_path, registry))
    with pytest.raises(LayerBuildError, match="invalid image reference"):
        pull(store, names("x"), "-bad ref!")


async def test_build_from_a_dockerfile(registry, base_image, tmp_path, server, client, names):
    from dsec.images.registry import build_dockerfile
    from dsec.images.store import LayerBuildError, LayerStore

    ref = base_image
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "ctx.txt").write_text("from the context\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {ref}\nARG GREETING=none\nRUN echo built $GREETING > /built.txt && "
                          "/bin/busybox rm /hello.txt\nCOPY ctx.txt /srv/ctx.txt\nENV FOO=bar\nWORKDIR /srv\n")
    name = names("built")
    r = dsec_image("build", name, "--dockerfile", str(dockerfile), "--context", str(context), "--insecure",
                   "--build-arg", "GREETING=hi", "--authfile", str(auth_file(tmp_path, registry)),
                   "--state-dir", str(server.state_dir))
    assert r.returncode == 0 and "built" in r.stdout, r
    async with await client.run_container(DSecContainerRunArgs(container_image=name, memory_limit_mb=64)) as sb:
        out = await sb.run_shell("cat /built.txt /srv/ctx.txt; ls /hello.txt 2>&1; echo $FOO $FROM_IMAGE")
        assert out.stdout.splitlines()[:2] == ["built hi", "from the context"], out
        assert "No such file" in out.stdout and out.stdout.splitlines()[-1] == "bar yes", out
    assert LayerStore(server.state_dir / "store").get_image(name).workdir == "/srv"

    store = LayerStore(server.state_dir / "store")
    dockerfile.write_text(f"FROM {ref}\nRUN exit 7\n")
    with pytest.raises(LayerBuildError, match="building .* failed"):
        build_dockerfile(store, names("broken"), dockerfile, insecure=True, authfile=auth_file(tmp_path, registry))
    with pytest.raises(LayerBuildError, match="no Dockerfile"):
        build_dockerfile(store, names("x"), tmp_path / "missing")


async def test_a_dockerfile_built_by_dsec_from_a_registry_image(registry, base_image, tmp_path, client, new_state_dir,
                                                                names):
    """``client.build_image`` with ``FROM`` a registry reference: pulled by the node (plain HTTP
    to a registry on its loopback) with the server's usual auth file, kept in the store for the
    next build; without credentials the registry's refusal is named."""
    from dsec.local import LocalServer
    from libdsec import DSecClient, ImageNotFound

    dockerfile = f"FROM {base_image}\nRUN cat /hello.txt > /copied && echo $FROM_IMAGE >> /copied\n"
    with pytest.raises(ImageNotFound, match=rf"FROM {base_image}: .*(?i:unauthorized)"):
        await client.build_image(names("nocreds"), dockerfile_text=dockerfile)
    server = LocalServer(new_state_dir("dsec-creds"), extra_args=("--pool-max", "2"),
                         env={"REGISTRY_AUTH_FILE": str(auth_file(tmp_path, registry))}).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as creds:
            name = names("from-registry")
            built = await creds.build_image(name, dockerfile_text=dockerfile)
            assert not built.cached
            async with await creds.run_container(DSecContainerRunArgs(container_image=name, memory_limit_mb=64)) as sb:
                assert (await sb.run_shell("cat /copied")).stdout == "hello from the registry\nyes\n"
            again = await creds.build_image(names("from-registry-again"), dockerfile_text=dockerfile)
            assert again.cached and again.key == built.key
            await creds.remove_image(f"dockerfile-{built.key[:32]}")
            await creds.remove_image(f"from-{hashlib.sha256(base_image.encode()).hexdigest()[:24]}")  # the pulled base
    finally:
        server.stop()


def push_task_images(registry: str, tmp: Path, count: int, tag: str) -> list[str]:
    """``count`` images over one two-layer base (busybox, then a shared file), each with a small
    layer of its own, pushed as test/task-N:TAG; their references."""
    busybox = Path("/bin/busybox").read_bytes()
    # The tag in the base too: the store (the tests' own, kept between runs) remembers every
    # group it converted, and this test counts what one run converts.
    base = [_layer({"bin/busybox": busybox, "bin/sh": busybox, "bin/cat": busybox, "etc/tag": tag.encode()},
                   dirs=("bin", "etc", "tmp", "root")),
            _layer({"etc/shared.txt": b"one base for all\n"}, dirs=("etc",))]
    return [push_layers(tmp / f"layout-{tag}-{i}", [*base, _layer({"task.txt": f"task {i} of {tag}\n".encode()})],
                        {"Env": ["PATH=/bin", f"TASK={i}"]}, f"{registry}/test/task-{i}:{tag}")
            for i in range(count)]


async def test_many_images_pulled_at_once_share_their_base(registry, tmp_path, server, client, names):
    from dsec.images.pulls import pull_many
    from dsec.images.store import LayerBuildError, LayerStore

    store = LayerStore(server.state_dir / "store")
    auth = auth_file(tmp_path, registry)
    tag = secrets.token_hex(3)
    refs = push_task_images(registry, tmp_path, 5, tag)
    before = set(store.layer_digests())

    # One pull, then a batch. The single pull merges its base with its own layer (three small
    # layers: one group); the batch parts that group where its images part ways: the base once,
    # then each image's own layer.
    first = pull_many(store, [(names("task"), refs[0])], insecure=True, authfile=auth)[0]
    assert len(first.layers) == 1
    wanted = [(names("task"), ref) for ref in refs[1:4]]
    wanted.append((names("task"), f"{registry}/test/no-such:{tag}"))
    events: list[tuple[str, str]] = []
    results = pull_many(store, wanted, insecure=True, authfile=auth, concurrency=3,
                        on_event=lambda n, stage, done, total: events.append((n, stage)))
    images, failure = results[:3], results[3]
    assert isinstance(failure, LayerBuildError) and "no-such" in str(failure)
    assert all(len(i.layers) == 2 for i in images), images
    assert len({i.layers[0] for i in images}) == 1, "the base was converted more than once"
    assert len({i.layers[1] for i in images}) == 3
    new = set(store.layer_digests()) - before
    assert len(new) == 1 + 1 + 3, "each group is converted once: the first pull's, the base, 3 own layers"
    assert {stage for n, stage in events if n == wanted[0][0]} >= {"fetching", "converting", "done"}
    assert (wanted[3][0], "failed") in events

    # A later pull reuses the base the batch converted.
    later = pull_many(store, [(names("task"), refs[4])], insecure=True, authfile=auth)[0]
    assert later.layers[0] == images[0].layers[0]

    for image, i in ((first, 0), (images[1], 2), (later, 4)):
        async with await client.run_container(DSecContainerRunArgs(container_image=image.name, memory_limit_mb=64)) as sb:
            out = await sb.run_shell("cat /etc/shared.txt /task.txt; echo $TASK")
            assert out.stdout == f"one base for all\ntask {i} of {tag}\n{i}\n", (image, out)

    # Bad input: a name twice, a bad name, a bad reference (each named), and the CLI's list file.
    with pytest.raises(LayerBuildError, match="asked for twice"):
        pull_many(store, [("same", refs[0]), ("same", refs[1])], insecure=True, authfile=auth)
    bad = pull_many(store, [("Bad Name", refs[0]), (names("x"), "-bad ref!")], insecure=True, authfile=auth)
    assert "Bad Name" in str(bad[0]) and "invalid image reference" in str(bad[1])
    listing = tmp_path / "pulls.txt"
    listing.write_text(f"# tasks\n{names('cli')} {refs[1]}\n{names('cli')} {refs[2]}  # two\n")
    r = dsec_image("pull", "--many", str(listing), "--insecure", "--authfile", str(auth),
                   "--state-dir", str(server.state_dir))
    assert r.returncode == 0 and r.stdout.count("2 layer(s)") == 2, r
    listing.write_text("just-a-name\n")
    r = dsec_image("pull", "--many", str(listing), "--state-dir", str(server.state_dir))
    assert r.returncode == 1 and "pulls.txt:1: expected 'NAME REF'" in " ".join(r.stderr.split()), r
