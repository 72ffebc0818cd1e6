"""Images from where users keep them: an OCI registry (``pull``, through skopeo; many at once,
sharing layers, in ``pulls``) and a Dockerfile (``build_dockerfile``, through buildah, else
podman). A build ends as an OCI archive in the store's scratch space, imported by
``sources.import_oci`` (consecutive small layers merged, whiteouts applied) and removed.

Credentials are skopeo's and buildah's own: ``authfile`` if given, else the usual auth file
(``$REGISTRY_AUTH_FILE``, ``${XDG_RUNTIME_DIR}/containers/auth.json``, ``~/.docker/config.json``),
as ``skopeo login`` / ``docker login`` wrote it. ``insecure``: plain HTTP or a certificate not
checked (a registry on this machine). buildah runs with a storage of its own under the store's
scratch space (the vfs driver: no mounts left behind), removed after the build, so nothing
lands in the machine's container storage.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from .sources import DEFAULT_MERGE_BELOW, import_oci
from .store import Image, LayerBuildError, LayerStore

Log = Callable[[str], None]
# A reference as skopeo takes it after docker:// (registry/path[:tag][@digest]); no options.
_REFERENCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z")
PULL_TIMEOUT_S = 3600
BUILD_TIMEOUT_S = 4 * 3600


def _reference(ref: str) -> str:
    ref = ref.removeprefix("docker://")
    if not _REFERENCE.match(ref) or ".." in ref:
        raise LayerBuildError(f"invalid image reference {ref!r}: expected REGISTRY/NAME[:TAG][@DIGEST]")
    return ref


def _run(argv: list[str], what: str, timeout: float, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LayerBuildError(f"{what} took over {timeout:g} s") from None
    if proc.returncode != 0:
        raise LayerBuildError(f"{what} failed (exit code {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def pull(store: LayerStore, name: str, ref: str, *, authfile: Path | None = None, insecure: bool = False,
         merge_below: int = DEFAULT_MERGE_BELOW, log: Log | None = None) -> Image:
    """Image ``name`` from ``ref`` in a registry (linux/amd64 of a multi-arch image): a batch of
    one (``pulls.pull_many``), so it shares the layers earlier pulls converted."""
    from .pulls import pull_many

    def event(_name: str, stage: str, done: int, total: int) -> None:
        if log:
            log(f"{stage} {done}/{total}" if total else stage)

    [result] = pull_many(store, [(name, ref)], authfile=authfile, insecure=insecure, merge_below=merge_below,
                         concurrency=1, on_event=event)
    if isinstance(result, LayerBuildError):
        raise result
    return result


def build_dockerfile(store: LayerStore, name: str, dockerfile: Path, context: Path | None = None, *,
                     authfile: Path | None = None, insecure: bool = False, build_args: dict[str, str] | None = None,
                     merge_below: int = DEFAULT_MERGE_BELOW, log: Log | None = None) -> Image:
    """Image ``name`` built from ``dockerfile`` (``context``: its directory unless given)."""
    dockerfile = Path(dockerfile).resolve()
    if not dockerfile.is_file():
        raise LayerBuildError(f"no Dockerfile at {dockerfile}")
    context = Path(context).resolve() if context is not None else dockerfile.parent
    if not context.is_dir():
        raise LayerBuildError(f"the build context {context} is not a directory")
    tool = next((t for t in ("buildah", "podman") if shutil.which(t)), None)
    if tool is None:
        raise LayerBuildError("neither buildah nor podman found: install buildah (scripts/setup-host.sh does)")
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        # A container storage of its own, removed with this directory.
        storage = ["--root", f"{work}/root", "--runroot", f"{work}/run", "--storage-driver", "vfs"]
        tag = f"localhost/dsec-build/{name.lower()}:latest"
        argv = [tool, *storage, "build" if tool == "podman" else "bud", "--isolation", "chroot", "--layers=false",
                "-f", str(dockerfile), "-t", tag]
        if authfile is not None:
            argv += ["--authfile", str(authfile)]
        if insecure:
            argv.append("--tls-verify=false")
        for key, value in (build_args or {}).items():
            argv += ["--build-arg", f"{key}={value}"]
        if log:
            log(f"{tool} build -f {dockerfile} {context}")
        try:
            _run([*argv, str(context)], f"{tool} building {dockerfile}", BUILD_TIMEOUT_S, cwd=context)
            archive = Path(work, "image.tar")
            push = [tool, *storage, "push", tag, f"oci-archive:{archive}"]
            _run(push, f"{tool} exporting the image", PULL_TIMEOUT_S)
            if log:
                log("importing the layers")
            return import_oci(store, archive, name, merge_below=merge_below, log=log)
        finally:
            # What the build left in its storage (containers, images) before the directory goes.
            subprocess.run([tool, *storage, "rm", "--all"], capture_output=True, timeout=300)
            subprocess.run([tool, *storage, "rmi", "--all", "--force"], capture_output=True, timeout=300)
