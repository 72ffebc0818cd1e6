"""Shared fixtures. Kernel-level tests (crun, mounts, cgroups) are marked ``slow`` and need root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# Layers are content-addressed, so one store can be shared by every test run on a machine; the
# python image (debootstrap, about a minute) is then built once.
# Harbor tasks are data (their tests run inside sandboxes), not this suite's tests.
collect_ignore = ["harbor_tasks"]
# A module whose own marks -m rules out is not imported (``make test-quick``: see module_marks).
pytest_plugins = ["module_marks"]

TEST_STORE = Path(os.environ.get("DSEC_TEST_STORE", "/var/lib/dsec-test/store"))
# Every test server shares one VM kernel cache (else each fresh state dir downloads a kernel
# and probes the accelerator in the background when its server starts).
os.environ.setdefault("DSEC_VM_ASSETS", str(TEST_STORE.parent / "vm"))
# KSM is a host-wide setting that a node with microVMs turns on: test servers leave it as the
# host has it (a test run must not change the host, and merging pages would move the memory
# figures the VM tests read). Its settings are tested against a stand-in sysfs (test_ksm.py).
os.environ.setdefault("DSEC_VM_KSM", "0")
# The run's servers share the microVM boot templates they keep (the first VM of an image and
# size boots, the rest restore its memory), in a dir of the run's own: every run boots each
# kind of VM once (its boot path tested), and none is left after it (``nothing_left_after_the_suite``).
_RUN_TEMPLATES = None
if "DSEC_VM_TEMPLATES_DIR" not in os.environ and os.geteuid() == 0:
    TEST_STORE.parent.mkdir(parents=True, exist_ok=True)
    _RUN_TEMPLATES = os.environ["DSEC_VM_TEMPLATES_DIR"] = tempfile.mkdtemp(prefix="vm-templates-", dir=TEST_STORE.parent)
# LiteLLM (which Harbor and the harnesses import) fetches its model price list from the
# internet at import unless told to use the copy it ships: every test's traffic stays here.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


# Every directory's conftest.py is imported as the module ``conftest`` and the last one wins
# sys.modules; a test that does ``from conftest import make_state_dir`` when it runs means this one.
_ROOT_CONFTEST = sys.modules[__name__]


def pytest_collection_finish(session):
    sys.modules["conftest"] = _ROOT_CONFTEST


def pytest_collection_modifyitems(config, items):
    # The hostvm tests last: they wait for the VMs that ``hostvm_background`` started at the first test.
    # After them only the tests that count the whole disk's writes: the VMs write to it all along.
    # The quick tests first: they need no image, so they run while ``images_ahead`` builds ``python``.
    items.sort(key=lambda item: 3 if item.get_closest_marker("disk_quiet") else
               2 if item.get_closest_marker("hostvm") else 1 if item.get_closest_marker("slow") else 0)
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (crun, mounts, cgroups)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def environment_kept():
    """Each test leaves ``os.environ`` as it found it: a benchmark's main run in-process sets its
    defaults there (``DSEC_VMS=0``, a guest kernel package that does not exist), and every server
    a later test started would inherit them. (A module's fixture that sets variables for its own
    servers is set up before this and restores them itself.)"""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def test_store() -> Path:
    from dsec.images.builders import build_busybox
    from dsec.images.store import LayerStore

    store = LayerStore(TEST_STORE)
    if not store.has_image("busybox"):
        build_busybox(store)
    return TEST_STORE


def _build_python(test_store: Path) -> str:
    from dsec.images.builders import build_python
    from dsec.images.store import LayerStore

    store = LayerStore(test_store)
    if not store.has_image("python"):
        build_python(store)
    return "python"


@pytest.fixture(scope="session")
def python_image(test_store: Path) -> str:
    _wait_ahead("python")
    return _build_python(test_store)


def _build_image(tmp_path_factory, store: Path, name: str) -> str:
    """Image ``name``, built as a user builds it (``dsec image build NAME``) when the store lacks it."""
    from dsec.images.store import LayerStore

    if not LayerStore(store).has_image(name):
        state = make_state_dir(tmp_path_factory, store, f"{name}-build")
        built = subprocess.run([sys.executable, "-m", "dsec", "image", "build", name, "--state-dir", str(state)],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stdout + built.stderr
    return name


# Images a selected test needs that take a minute on a fresh store, building in the background.
_AHEAD: dict[str, Future] = {}
_BUILT_AHEAD = {"desktop_image": "desktop"}


def _wait_ahead(name: str) -> None:
    """Until ``images_ahead``'s build of ``name`` is over, if it began one (its failure is the caller's)."""
    if (ahead := _AHEAD.get(name)) is not None and not ahead.cancelled():
        ahead.result()


@pytest.fixture(scope="session", autouse=True)
def images_ahead(request, tmp_path_factory, test_store, hostvm_background):
    """``python`` (the lower of them all, and in the hostvm guest's root: its runner, started
    before, waits for it) and the ``desktop`` image (``e2b-base`` and a layer over it: about a
    minute on a fresh store) build one after the other in a thread from the run's first test on,
    when a selected test needs them, beside the quick tests, which come first and need no image;
    ``python_image`` and ``desktop_image`` wait for those builds rather than making them."""
    wanted = {fixture for item in request.session.items for fixture in getattr(item, "fixturenames", ())}
    names = [image for fixture, image in _BUILT_AHEAD.items() if fixture in wanted]
    if os.geteuid() != 0 or not (names or hostvm_background is not None or "python_image" in wanted):
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="images-ahead") as pool:
        _AHEAD["python"] = pool.submit(_build_python, test_store)
        for name in names:
            _AHEAD[name] = pool.submit(_build_image, tmp_path_factory, test_store, name)
        yield
        for future in _AHEAD.values():
            future.cancel()


@pytest.fixture(scope="session")
def swe_agent_image(tmp_path_factory, test_store: Path) -> str:
    """The image SWE-agent's tasks assume (``python``, ``less``, ``git``), built as a user builds
    it (``dsec image build swe-agent``): a layer over ``python``'s, seconds once per store."""
    return _build_image(tmp_path_factory, test_store, "swe-agent")


@pytest.fixture(scope="session")
def desktop_image(tmp_path_factory, test_store: Path) -> str:
    """The ``desktop`` image (Xvfb, xfce4, xdotool, noVNC, …), built as a user builds it
    (``dsec image build desktop``): about a minute, once per store, begun by ``images_ahead``."""
    _wait_ahead("desktop")
    return _build_image(tmp_path_factory, test_store, "desktop")


def make_state_dir(tmp_path_factory: pytest.TempPathFactory, store: Path, name: str) -> Path:
    state = tmp_path_factory.mktemp(name)
    (state / "store").symlink_to(store)
    return state


@pytest.fixture(scope="session")
def new_state_dir(tmp_path_factory, test_store):
    """``new_state_dir(name)``: a fresh state dir on the shared test store (for tests that run
    servers of their own; ``from conftest import`` may find another directory's conftest)."""
    return lambda name: make_state_dir(tmp_path_factory, test_store, name)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_after_the_suite(tmp_path_factory):
    """After the whole run: no mounts, cgroups, crun state or processes (the init runs as
    ``/dev/.dsec-init``) of any state dir a test made, removed since or not."""
    made: list[Path] = []
    mktemp = tmp_path_factory.mktemp

    def recording_mktemp(*args, **kwargs):
        path = mktemp(*args, **kwargs)
        made.append(path.resolve())
        return path

    tmp_path_factory.mktemp = recording_mktemp
    yield
    tmp_path_factory.mktemp = mktemp
    if os.geteuid() != 0:
        return
    if _RUN_TEMPLATES is not None:
        shutil.rmtree(_RUN_TEMPLATES, ignore_errors=True)
    deadline = time.monotonic() + 10
    while (problems := suite_leftovers(tmp_path_factory.getbasetemp().resolve(), made)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not problems, "the test run left behind:\n" + "\n".join(problems)


def suite_leftovers(base: Path, state_dirs: list[Path]) -> list[str]:
    from dsec.local import leftovers
    from dsec.resources import cgroups

    problems = []
    for state in state_dirs:
        # A real container backend ran there (fake-backend tests leave plain files, no more).
        if (state / "node" / "layers").exists() or (state / "node" / "run").exists():
            problems += leftovers(state, settle_s=0)
    with open("/proc/self/mountinfo") as f:
        problems += [f"mount {t}" for line in f if (t := line.split()[4]).startswith(f"{base}/")]
    parents = {f"{cgroups.parent_for(d)}{kind}" for d in state_dirs for kind in ("", "-microvm", "-fullvm")}
    hierarchies = [cgroups.CGROUP_ROOT] if cgroups.is_v2() else list(cgroups.CGROUP_ROOT.iterdir())
    problems += [f"cgroup {h / p}" for h in hierarchies for p in parents if (h / p).is_dir()]
    vm_assets = os.environ["DSEC_VM_ASSETS"]
    for pid in os.listdir("/proc"):
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            root = os.readlink(f"/proc/{pid}/root")
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state == "Z" and ppid == str(os.getpid()):
            # Orphaned sandbox inits come to this process once a test made it a subreaper.
            try:
                os.waitpid(int(pid), os.WNOHANG)
            except ChildProcessError:
                pass
            continue
        if state == "Z" and ppid == "1":
            continue  # exited; the host's init reaps it (this machine's only now and then)
        names = {part for line in cgroup.splitlines() for part in line.split(":", 2)[-1].split("/")}
        # The VM assets cache is shared by the suite's servers: a QEMU on it (the accelerator
        # probe) outliving its server is a leftover too.
        if names & parents or root.startswith(f"{base}/") or f"{base}/" in cmdline or f"{vm_assets}/" in cmdline:
            problems.append(f"process {pid} {cmdline.strip()[:150]!r} (root {root})")
    return sorted(set(problems))


@pytest.fixture(scope="session", autouse=True)
def hostvm_background(request, nothing_left_after_the_suite):
    """The VMs of the run's ``hostvm`` tests (tests/hosts/test_debian12_vm.py: about 12 minutes of
    TCG), started at its first test and run in the background while the other tests run
    (``BackgroundRows``); those tests come last and wait for their row. None when the run has
    none (``-m "not hostvm"``, the quick set, not root). Whatever still runs at the end (a run
    stopped early) is stopped, its VM destroyed, before the suite's leftover check."""
    items = [item for item in request.session.items if item.get_closest_marker("hostvm")]
    if not items or os.geteuid() != 0:
        yield None
        return
    test_store = request.getfixturevalue("test_store")
    # (The guest's root holds the test images: the runner waits for ``python``, built meanwhile
    # at the first test by ``images_ahead``, once its own tree and the kernels are in.)
    rows = list(dict.fromkeys(item.callspec.params["row"] for item in items))
    background = items[0].module.BackgroundRows.start(rows, request.getfixturevalue("tmp_path_factory"), test_store)
    try:
        yield background
    finally:
        background.stop()


# DSEC_TEST_ONE_SERVER=1: the modules' tests share one server for the whole run (a slow guest,
# tests/hosts, where each start costs half a minute).
_SERVER_SCOPE = "session" if os.environ.get("DSEC_TEST_ONE_SERVER") == "1" else "module"


@pytest.fixture(scope=_SERVER_SCOPE)
def server(tmp_path_factory, test_store):
    """A ``dsec serve`` for the module's tests; checks on the way out that nothing was left."""
    from dsec.local import serving

    with serving(make_state_dir(tmp_path_factory, test_store, "dsec-state"), "--pool-max", "4") as srv:
        yield srv


@pytest.fixture
async def client(server):
    from libdsec import DSecClient

    async with DSecClient(server.endpoint, token=server.token) as c:
        yield c


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of the test run's own (``postgres_server``), stopped and removed at
    the end; ``postgres.new_database()`` is the URL of a fresh database on it."""
    from postgres_server import PostgresServer, find_postgres

    bin_dir = find_postgres()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb): scripts/setup-host.sh installs it")
    server = PostgresServer(bin_dir).start()
    yield server
    server.stop()
