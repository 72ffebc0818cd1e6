"""VM sandboxes on QEMU: the layer both kinds share (QMP, guest agent, kernel and initramfs) and
the two backends, ``MicroVMBackend`` (kind ``microvm``) and ``FullVMBackend`` (kind ``fullvm``)."""

from __future__ import annotations

import os
from pathlib import Path

from ... import settings


def vm_backends(node_dir: Path, store, assets_dir: Path) -> list:
    """The VM backends for a node, or none where QEMU is not installed."""
    from .fullvm import FullVMBackend
    from .machine import QEMU
    from .microvm import MicroVMBackend

    if not os.path.exists(QEMU):
        return []
    # Tests and benchmarks share one kernel cache between their servers.
    config = settings.current()
    assets_dir = config.vm_assets or Path(assets_dir)
    templates = (config.vm_templates_dir or Path(node_dir) / "vm-templates") if config.vm_boot_templates else None
    return [MicroVMBackend(node_dir, store, assets_dir, templates_dir=templates), FullVMBackend(node_dir, store, assets_dir)]
