"""Kernel same-page merging on the node: the settings DSec runs KSM with for its microVMs.

KSM merges identical pages of memory that asks for it; QEMU asks for the guest RAM of every
microVM with layers on pmem (``merge=on``). DAX shares the layers; KSM shares what the guests
hold alike besides (kernel text and data, identical heaps and page tables; ``use_zero_pages``
maps empty pages to the zero page without a merge tree). KSM is node-wide: ``enable`` sets the
scan rate below and starts it (the edge runs as root); a node without KSM, or where it cannot be
set, runs on without merging.

One full scan of N VMs of M MiB takes about N·M/4 KiB / (pages_to_scan / sleep) seconds: 20
guests of 256 MiB, 26 s at the rate below.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("dsec.resources.ksm")

KSM = Path("/sys/kernel/mm/ksm")
# 1000 pages every 20 ms: 50,000 pages (195 MiB) a second.
SETTINGS = {"pages_to_scan": "1000", "sleep_millisecs": "20", "use_zero_pages": "1"}
KEYS = ("run", *SETTINGS)
# The host's own settings while DSec runs KSM, kept where a reboot (which resets KSM) clears
# them too: a server or benchmark that dies with KSM on leaves them for the next one to put
# back, instead of the host scanning at DSec's rate for good.
SAVED = Path("/run/dsec/ksm-host.json")


def available() -> bool:
    return (KSM / "run").exists()


def read() -> dict[str, str]:
    """The node's KSM settings now (``run`` and the keys of ``SETTINGS``)."""
    return {k: (KSM / k).read_text().strip() for k in KEYS if (KSM / k).exists()}


def write(values: dict[str, str]) -> None:
    """Set ``values``; ``run`` last, so that a restart scans at the new rate."""
    for key in sorted(values, key=lambda k: k == "run"):
        (KSM / key).write_text(str(values[key]))


def enable(settings: dict[str, str] = SETTINGS) -> bool:
    """Run KSM at ``settings``; False (and a warning) where it cannot be."""
    if not available():
        log.warning("no KSM on this kernel: microVMs share their layers but not their other pages")
        return False
    try:
        # A kernel without a knob (use_zero_pages came in 4.14) runs without it.
        write({**{k: v for k, v in settings.items() if (KSM / k).exists()}, "run": "1"})
    except OSError as exc:
        log.warning("cannot set KSM (%s): microVMs share their layers but not their other pages", exc)
        return False
    return True


def take() -> dict[str, str]:
    """The host's settings, saved before DSec changes them: those an earlier run saved and
    did not give back, else the settings now."""
    try:
        saved = json.loads(SAVED.read_text())
        if isinstance(saved, dict) and saved:
            return {str(k): str(v) for k, v in saved.items()}
    except (OSError, ValueError):
        pass
    now = read()
    try:
        SAVED.parent.mkdir(parents=True, exist_ok=True)
        tmp = SAVED.with_suffix(".tmp")
        tmp.write_text(json.dumps(now))
        os.replace(tmp, SAVED)
    except OSError as exc:
        log.warning("cannot keep the host's KSM settings in %s: %s", SAVED, exc)
    return now


def give_back(settings: dict[str, str]) -> None:
    """Put the host's ``settings`` back and forget the saved copy."""
    write(settings)
    SAVED.unlink(missing_ok=True)


def full_scans() -> int:
    return int((KSM / "full_scans").read_text())


def stats() -> dict[str, int]:
    """Pages KSM shares now: ``pages_sharing`` (mappings saved) and ``ksm_zero_pages``."""
    out = {}
    for key in ("pages_shared", "pages_sharing", "ksm_zero_pages", "full_scans"):
        path = KSM / key
        if path.exists():
            out[key] = int(path.read_text())
    return out
