"""The server's settings from its environment: every ``DSEC_*`` variable the server reads,
declared once here (its field of ``Settings``: the variable, its default, what it means) and
read once, when a server starts (``load``, in ``dsec serve`` and a node daemon), so a value that
does not parse stops the start with a message naming it instead of failing the first call that
reads it.

The parts read ``current()``: the settings loaded at start or, in a process that loaded none (a
program using the parts as a library, a test), the environment as it is now. Variables of the
SDK (``DSEC_ENDPOINT``, ``DSEC_TOKEN``) and of the tests are not the server's and are not here.
``tests/unit/test_settings.py`` checks that every ``DSEC_*`` name the server's code reads is a
field here, and docs/OPERATIONS.md lists them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any


class SettingsError(ValueError):
    """A ``DSEC_*`` variable that does not parse; the message names each one and what it takes."""


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise ValueError("use 1 or 0")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in allowed:
            raise ValueError(f"use {', '.join(allowed[:-1])} or {allowed[-1]}")
        return text.lower()
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e10:
        raise ValueError("give a number of seconds (> 0)")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) <= 1000:
        raise ValueError("give a whole number from 1 to 1000")
    return int(text)


def _megabytes(text: str) -> int:
    if not text.isdigit():
        raise ValueError("give a whole number of MiB (0: off)")
    return int(text)


def _var(name: str, default: Any, parse: Callable[[str], Any], meaning: str) -> Any:
    return field(default=default, metadata={"env": name, "parse": parse, "meaning": meaning})


@dataclass(frozen=True)
class Settings:
    state_dir: Path = _var("DSEC_STATE_DIR", Path("/var/lib/dsec"), Path,
                           "the state dir of `dsec serve` and of the CLI's local server when none is given")
    vms: bool = _var("DSEC_VMS", True, _flag, "0: containers only (no VM backends, no guest kernel fetched at start)")
    vm_assets: Path | None = _var("DSEC_VM_ASSETS", None, Path,
                                  "the guest kernel and initramfs cache the VM backends share (default: the state dir's)")
    vm_accel: str | None = _var("DSEC_VM_ACCEL", None, _choice("kvm", "tcg"),
                                "kvm or tcg: skip the probe boot that picks QEMU's accelerator")
    vm_ksm: bool = _var("DSEC_VM_KSM", True, _flag, "0: leave the host's KSM settings alone (microVMs share less)")
    vm_boot_templates: bool = _var("DSEC_VM_BOOT_TEMPLATES", True, _flag,
                                   "0: every microVM boots its kernel (none restored from a booted VM's memory)")
    vm_templates_dir: Path | None = _var("DSEC_VM_TEMPLATES_DIR", None, Path,
                                         "where microVM boot templates are kept (default: STATE_DIR/node/vm-templates)")
    guest_kernel_package: str = _var("DSEC_GUEST_KERNEL_PACKAGE", "linux-image-cloud-amd64", str,
                                     "the Debian package the VMs' guest kernel comes from")
    userns: bool = _var("DSEC_USERNS", True, _flag,
                        "0: sandboxes without a user namespace (weaker: root inside is uid 0 outside)")
    idmap_clones: str = _var("DSEC_IDMAP_CLONES", "auto", _choice("auto", "attached", "detached"),
                             "how idmapped layer clones reach overlayfs (auto: detached from Linux 6.15)")
    layer_attach: str = _var("DSEC_LAYER_ATTACH", "auto", _choice("auto", "file", "loop"),
                             "how EROFS layers are mounted: from their files (Linux 6.12) or loop devices")
    layer_cache_mb: int = _var("DSEC_LAYER_CACHE_MB", 0, _megabytes,
                               "MiB of the node's disk for its cache of what it read of layers on a shared store (0: none)")
    layer_cache_dir: Path | None = _var("DSEC_LAYER_CACHE_DIR", None, Path,
                                        "where the node's layer cache is kept (default: STATE_DIR/node/layer-cache)")
    apparmor: bool = _var("DSEC_APPARMOR", True, _flag, "0: no AppArmor profile, even where the host has AppArmor")
    network_config: Path | None = _var("DSEC_NETWORK_CONFIG", None, Path,
                                       "the sandboxes' network settings file (default: STATE_DIR/network.json)")
    metrics: bool = _var("DSEC_METRICS", True, _flag, "0: no latency histograms or counters (/metrics is empty)")
    job_retention_s: float = _var("DSEC_JOB_RETENTION_S", 7 * 86400.0, _seconds,
                                  "seconds a job's log may stay idle before it is removed")
    e2b_base_image: str = _var("DSEC_E2B_BASE_IMAGE", "", str, "the image E2B's `base` template starts")
    native_cache: Path = _var("DSEC_NATIVE_CACHE", Path("/var/cache/dsec/bin"), Path,
                              "where the sandbox init, agent and jail binaries are built")
    tracemalloc: bool = _var("DSEC_TRACEMALLOC", False, _flag,
                             "1: trace the server's allocations (SIGUSR2 writes what grew)")
    tracemalloc_frames: int = _var("DSEC_TRACEMALLOC_FRAMES", 8, _count, "frames kept per traced allocation")
    debug: bool = _var("DSEC_DEBUG", False, _flag, "1: the CLI shows tracebacks")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Every variable parsed; ``SettingsError`` naming each one that does not parse. An
        empty variable is its default."""
        values, problems = {}, []
        for f in fields(cls):
            text = environ.get(f.metadata["env"], "").strip()
            if not text:
                continue
            try:
                values[f.name] = f.metadata["parse"](text)
            except ValueError as exc:
                problems.append(f"{f.metadata['env']}={text!r}: {exc}")
        if problems:
            raise SettingsError("; ".join(problems))
        return cls(**values)


def one(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """The setting ``name`` alone, from ``environ``: for a default read when a module is imported
    (the CLI's state dir), where another variable's bad value must not stop ``--help``."""
    f = next(f for f in fields(Settings) if f.name == name)
    text = environ.get(f.metadata["env"], "").strip()
    if not text:
        return f.default
    try:
        return f.metadata["parse"](text)
    except ValueError as exc:
        raise SettingsError(f"{f.metadata['env']}={text!r}: {exc}") from None


def variables() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of each setting, in order: for ``dsec`` docs and checks."""
    out = []
    for f in fields(Settings):
        default = "" if f.default is MISSING or f.default in (None, "") else str(f.default)
        out.append((f.metadata["env"], default, f.metadata["meaning"]))
    return out


_loaded: Settings | None = None


def load(environ: Mapping[str, str] = os.environ) -> Settings:
    """Read and check the settings once, as a server starts; ``current()`` is these from now on."""
    global _loaded
    _loaded = Settings.from_env(environ)
    return _loaded


def current() -> Settings:
    """The settings loaded at start, else (no server started in this process) the environment's now."""
    return _loaded if _loaded is not None else Settings.from_env()
