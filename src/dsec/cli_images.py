"""``dsec image …``: the layer store from the command line.

Most commands work on the local store directly (no server needed): ``STATE_DIR/store``, or the
one ``dsec image --store-dir DIR …`` names (a cluster's shared store). ``build --from … --run …``
runs its steps in a sandbox, so it needs ``dsec serve``. Removing an image or collecting layers
takes into account what the sandboxes (and warm pools) of the nodes under the state dir hold:
the embedded node's and a cluster's nodes on this machine; a cluster's other machines are seen
only through the server (``DSecClient.remove_image`` and ``gc_images`` ask every node).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, DSecError, InvalidRequest
from .cli_common import DEFAULT_STATE, StateDir, console, fail

image_app = typer.Typer(help="Build, import and manage images (layers in the local store).", no_args_is_help=True)
_store_dir: Path | None = None


@image_app.callback()
def _options(store_dir: Annotated[Optional[Path], typer.Option(
        "--store-dir", help="The layer store (default: STATE_DIR/store), e.g. a cluster's shared one.")] = None) -> None:
    global _store_dir
    _store_dir = store_dir


def _store(state_dir: Path):
    from .images.store import LayerStore

    return LayerStore(_store_dir or state_dir / "store")


def node_usage(state_dir: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(image refs, layer digests) the sandboxes of the nodes under ``state_dir`` hold (the
    embedded node's, ``node/``, and a cluster's on this machine, ``nodes/NAME/node/``), read
    from their records and their layer mounts (which the warm pools hold too)."""
    from .edge import journal

    refs, layers = set(), set()
    for node in [state_dir / "node", *sorted((state_dir / "nodes").glob("*/node"))]:
        for text in journal.read(node / "run" / "records").values():
            try:
                image = json.loads(text)["image"]
            except (ValueError, KeyError, TypeError):
                continue
            refs.add(image["name"])
            layers.update(image["layers"])
        mounts = node / "layers"
        if mounts.is_dir():
            layers.update(p.name for p in mounts.iterdir())
    return frozenset(refs), frozenset(layers)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def parse_filters(filters: list[str]) -> dict[str, str]:
    """``--filter name=PREFIX`` / ``--filter role=ROLE`` as keyword arguments of the index's
    ``names`` (``prefix``, ``role``)."""
    from .images.store import ROLES

    out: dict[str, str] = {}
    for f in filters:
        key, sep, value = f.partition("=")
        if not sep or key not in ("name", "role") or not value:
            raise InvalidRequest(f"bad --filter {f!r}: use name=PREFIX or role=ROLE")
        if key == "role" and value not in ROLES:
            raise InvalidRequest(f"bad --filter {f!r}: a role is one of {', '.join(ROLES)}")
        out["prefix" if key == "name" else "role"] = value
    return out


@image_app.command("ls")
def image_ls(
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many images (a page).")] = 1000,
    after: Annotated[Optional[str], typer.Option("--after", help="Start after this name (the last of the previous page).")] = None,
    filters: Annotated[Optional[list[str]], typer.Option(
        "--filter", help="name=PREFIX or role=ROLE (the role of the top layer: base, workspace, toolkit, step, "
                         "snapshot); repeatable.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="The store's totals: images, distinct layers, bytes stored "
                                        "and bytes the images refer to (what sharing layers saves).")] = False,
    reindex: Annotated[bool, typer.Option("--reindex", help="Rebuild the store's index from its files first.")] = False,
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """List images, a page at a time, in name order (the next page: --after the last name shown)."""
    store = _store(state_dir)
    if reindex:
        store.index.rebuild()
    if stats:
        st = store.index.stats()
        table = Table("IMAGES", "DISTINCT LAYERS", "LAYER FILES", "STORED", "REFERENCED", "SAVED")
        saved = 1 - st.stored_bytes / st.referenced_bytes if st.referenced_bytes else 0.0
        table.add_row(str(st.images), str(st.distinct_layers), str(st.stored_layers), _size(st.stored_bytes),
                      _size(st.referenced_bytes), f"{saved:.0%}")
        console.print(table)
        return
    try:
        names = store.index.names(limit=limit + 1, after=after, **parse_filters(filters or []))
    except DSecError as exc:
        fail(exc)
    table = Table("NAME", "LAYERS", "ROLES", "SIZE")
    for name in names[:limit]:
        try:
            info = store.describe(store.get_image(name))
        except (DSecError, OSError):
            continue  # removed while listing
        table.add_row(name, str(len(info.layers)), ",".join(info.roles), _size(info.size_bytes))
    console.print(table)
    if len(names) > limit:
        console.print(f"more: dsec image ls --after {names[limit - 1]}", markup=False)


@image_app.command("inspect")
def image_inspect(ref: Annotated[str, typer.Argument(help="Image name or composition a+b+c.")],
                  state_dir: StateDir = DEFAULT_STATE) -> None:
    """Show an image's layers (bottom first) with their roles, digests and sizes."""
    store = _store(state_dir)
    try:
        info = store.describe(store.resolve(ref))
    except DSecError as exc:
        fail(exc)
    table = Table("#", "ROLE", "DIGEST", "SIZE", title=f"{info.name}  ({_size(info.size_bytes)})")
    for i, (digest, role, size) in enumerate(zip(info.layers, info.roles, info.layer_sizes)):
        table.add_row(str(i), role, digest, _size(size))
    console.print(table)
    console.print(f"env: {info.env}\nworkdir: {info.workdir}\nuser: {info.user}" + (f"\nparent: {info.parent}" if info.parent else "")
                  + ("\nsetuid: yes (sudo works in its container sandboxes)" if info.setuid else "")
                  + (f"\nstart command: {info.start_cmd}" if info.start_cmd else "")
                  + (f"\nready command: {info.ready_cmd}" if info.ready_cmd else ""), markup=False)


@image_app.command("build")
def image_build(
    name: Annotated[str, typer.Argument(help="Image name; busybox, python, swe-agent, lang-cpp, lang-nodejs, lang-go, lang-java have built-in recipes.")],
    from_dir: Annotated[Optional[Path], typer.Option("--from-dir", help="A base layer from a directory.")] = None,
    from_tar: Annotated[Optional[Path], typer.Option("--from-tar", help="A base layer from a tar archive.")] = None,
    debian: Annotated[Optional[str], typer.Option("--debian", help="A Debian base by debootstrap: the suite.")] = None,
    packages: Annotated[str, typer.Option("--packages", help="With --debian: packages to include, comma-separated.")] = "",
    workspace_dir: Annotated[Optional[Path], typer.Option("--workspace-dir", help="A workspace layer from a directory.")] = None,
    workspace_git: Annotated[Optional[str], typer.Option("--workspace-git", help="A workspace layer from a local git repository: PATH\\[@REF].")] = None,
    toolkit_dir: Annotated[Optional[Path], typer.Option("--toolkit-dir", help="A toolkit layer from a directory.")] = None,
    prefix: Annotated[str, typer.Option("--prefix", help="Where a workspace or toolkit lands in the sandbox.")] = "",
    base: Annotated[Optional[str], typer.Option("--from", help="With --run: the image the steps run on.")] = None,
    run: Annotated[Optional[list[str]], typer.Option("--run", help="A build step (shell command); repeatable; needs dsec serve.")] = None,
    dockerfile: Annotated[Optional[Path], typer.Option("--dockerfile", help="Build from a Dockerfile (buildah, else podman).")] = None,
    context: Annotated[Optional[Path], typer.Option("--context", help="With --dockerfile: the build context (default: its directory).")] = None,
    build_arg: Annotated[Optional[list[str]], typer.Option("--build-arg", help="With --dockerfile: KEY=VALUE; repeatable.")] = None,
    authfile: Annotated[Optional[Path], typer.Option("--authfile", help="With --dockerfile: registry credentials (default: the usual auth file).")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="With --dockerfile: plain HTTP / unchecked TLS to registries.")] = False,
    merge_below_mb: Annotated[int, typer.Option(help="With --dockerfile: merge consecutive layers while under this size.")] = 64,
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """Build an image from a recipe, a directory, a tar, debootstrap, a workspace, build steps or a Dockerfile."""
    from .images import builders, registry, sources
    from .images.store import Image

    store = _store(state_dir)
    try:
        with console.status(f"building {name} …") as status:
            log = lambda msg: status.update(f"building {name}: {msg}")  # noqa: E731
            if dockerfile is not None:
                args = dict(a.partition("=")[::2] for a in build_arg or [])
                if any(not k for k in args) or any("=" not in a for a in build_arg or []):
                    raise InvalidRequest("--build-arg takes KEY=VALUE")
                image = registry.build_dockerfile(store, name, dockerfile, context, authfile=authfile, insecure=insecure,
                                                  build_args=args, merge_below=merge_below_mb << 20, log=log)
            elif context is not None:
                raise InvalidRequest("--context goes with --dockerfile")
            elif run:
                if not base:
                    raise InvalidRequest("--run needs --from IMAGE: the image the steps run on")
                image_name = asyncio.run(_build_steps(name, base, run, log))
                image = store.get_image(image_name)
            elif from_dir is not None or from_tar is not None:
                digest = store.add_dir(from_dir) if from_dir is not None else store.add_tar(from_tar)
                image = store.put_image(Image(name=name, layers=(digest,), env={"PATH": builders.DEFAULT_PATH}))
            elif debian:
                image = builders.build_debian(store, name, debian, tuple(p for p in packages.split(",") if p), log=log)
            elif workspace_dir is not None:
                image = sources.workspace_from_dir(store, workspace_dir, name, prefix or "/workspace")
            elif workspace_git:
                repo, _, ref = workspace_git.partition("@")
                image = sources.workspace_from_git(store, Path(repo), name, ref or "HEAD", prefix or "/workspace")
            elif toolkit_dir is not None:
                image = sources.workspace_from_dir(store, toolkit_dir, name, prefix or f"/opt/{name}", role="toolkit")
            elif name in builders.BUILDERS:
                image = builders.BUILDERS[name](store)
            else:
                raise InvalidRequest(f"no recipe for {name!r}: give a source (see --help)")
    except (DSecError, OSError) as exc:
        fail(exc)
    console.print(f"built {image.name}: " + ", ".join(f"{r} {d[:19]}" for r, d in zip(image.roles, image.layers)))


async def _build_steps(name: str, base: str, steps: list[str], log) -> str:
    """Run each step in a sandbox over ``base``; its changes become the new image's top layer."""
    async with DSecClient() as client:
        async with await client.run_container(DSecContainerRunArgs(container_image=base, memory_limit_mb=2048)) as sandbox:
            for i, step in enumerate(steps, 1):
                log(f"step {i}/{len(steps)}: {step}")
                result = await sandbox.run_shell(step, timeout=3600)
                if result.exit_code != 0:
                    raise InvalidRequest(
                        f"build step {i} ({step!r}) failed with exit code {result.exit_code}: {result.stderr[-1000:]}"
                    )
            log("packing")
            return (await sandbox.pack_diff(name=name, role="step")).image


@image_app.command("import")
def image_import(
    name: Annotated[str, typer.Argument(help="Name for the imported image.")],
    archive: Annotated[Path, typer.Argument(help="A docker-archive or oci-layout tarball (docker save, skopeo copy).")],
    merge_below_mb: Annotated[int, typer.Option(help="Merge consecutive layers while under this size.")] = 64,
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """Import an OCI image archive as EROFS layers (whiteouts and opaque dirs applied)."""
    from .images.sources import import_oci

    store = _store(state_dir)
    try:
        with console.status(f"importing {archive} …") as status:
            image = import_oci(store, archive, name, merge_below=merge_below_mb << 20,
                               log=lambda msg: status.update(f"importing {archive}: {msg}"))
    except DSecError as exc:
        fail(exc)
    console.print(f"imported {image.name}: {len(image.layers)} layer(s), {_size(store.image_size(image))}")


@image_app.command("pull")
def image_pull(
    name: Annotated[Optional[str], typer.Argument(help="Name for the image in DSec.")] = None,
    ref: Annotated[Optional[str], typer.Argument(help="The image in a registry: REGISTRY/NAME:TAG or REGISTRY/NAME@DIGEST.")] = None,
    many: Annotated[Optional[Path], typer.Option("--many", help="Pull many at once: a file of 'NAME REF' lines ('#' comments); shared layers are fetched and converted once.")] = None,
    concurrency: Annotated[int, typer.Option(help="Images fetched, and layers converted, at a time.")] = 4,
    authfile: Annotated[Optional[Path], typer.Option("--authfile", help="Registry credentials (default: the usual auth file).")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Plain HTTP / unchecked TLS (a registry on this machine).")] = False,
    merge_below_mb: Annotated[int, typer.Option(help="Merge consecutive layers while under this size.")] = 64,
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """Pull images from an OCI registry (skopeo) into EROFS layers: one (NAME REF), or many (--many FILE)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .images.pulls import pull_many

    if (many is None) == (name is None or ref is None) or (many is not None and (name or ref)):
        fail("give NAME REF, or --many FILE (not both)")
    wanted = _pull_list(many) if many is not None else [(name, ref)]
    store = _store(state_dir)
    columns = (TextColumn("{task.fields[image]}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=len(wanted) == 1) as progress:
        tasks = {n: progress.add_task("waiting", total=None, image=n) for n, _ in wanted}

        def event(image: str, stage: str, done: int, total: int) -> None:
            progress.update(tasks[image], description=stage, completed=done, total=total or None)

        try:
            results = pull_many(store, wanted, authfile=authfile, insecure=insecure, merge_below=merge_below_mb << 20,
                                concurrency=concurrency, on_event=event, processes=True)
        except DSecError as exc:
            fail(exc)
    failed = 0
    for (n, r), result in zip(wanted, results):
        if isinstance(result, DSecError):
            failed += 1
            console.print(f"[red]error:[/red] {n}: {result}")
        else:
            console.print(f"pulled {result.name}: {len(result.layers)} layer(s), {_size(store.image_size(result))}")
    if failed:
        raise typer.Exit(1)


def _pull_list(path: Path) -> list[tuple[str, str]]:
    """'NAME REF' lines of ``path`` ('#' starts a comment), or a clear error naming the line."""
    try:
        text = path.read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    wanted = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            fail(f"{path}:{number}: expected 'NAME REF', got {line!r}")
        wanted.append((parts[0], parts[1]))
    if not wanted:
        fail(f"{path} names no image to pull")
    return wanted


@image_app.command("verify")
def image_verify(refs: Annotated[Optional[list[str]], typer.Argument(
                     help="Images (or compositions a+b+c) whose layers to check; none: every layer of the store.")] = None,
                 state_dir: StateDir = DEFAULT_STATE) -> None:
    """Read layers whole against the sums the store took when it placed them, and name each
    damaged one (a file cut short or changed, a damaged sums file). Exits 1 if any is."""
    from rich.progress import Progress

    store = _store(state_dir)
    try:
        digests = sorted({d for ref in refs for d in store.resolve(ref).layers}) if refs else store.layer_digests()
    except DSecError as exc:
        fail(exc)
    problems: list[str] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying layers", total=len(digests))
        for digest in digests:
            try:
                problems += store.verify_layer(digest)
            except (DSecError, OSError) as exc:
                problems.append(f"layer {digest}: {exc}")
            progress.advance(task)
    for problem in problems:
        console.print(problem, markup=False)
    if problems:
        fail(f"{len(problems)} problem(s) in {len(digests)} layer(s): build, import or pull their images again")
    from .images import sums

    unchecked = sum(not sums.path_of(store.layer_path(d)).exists() for d in digests)
    console.print(f"{len(digests) - unchecked} layer(s) intact"
                  + (f"; {unchecked} without sums (placed before the store kept them): not checked" if unchecked else ""))


@image_app.command("rm")
def image_rm(name: str, state_dir: StateDir = DEFAULT_STATE) -> None:
    """Remove an image (refused while a sandbox uses it; its layers stay until `gc`)."""
    try:
        _store(state_dir).remove_image(name, in_use=node_usage(state_dir)[0])
    except DSecError as exc:
        fail(exc)
    console.print(f"removed {name}")


@image_app.command("gc")
def image_gc(state_dir: StateDir = DEFAULT_STATE) -> None:
    """Remove layers that no image refers to and no sandbox holds."""
    store = _store(state_dir)
    removed = store.gc(in_use=node_usage(state_dir)[1])
    for digest in removed:
        console.print(f"removed layer {digest}")
    console.print(f"{len(removed)} layer(s) removed")
