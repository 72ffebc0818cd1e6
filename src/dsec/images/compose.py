"""Image composition as a plan: which shared layer mounts an image needs and the overlay on top.

``compose`` does no I/O beyond reading paths; the backend that runs the sandbox makes the mounts it plans
(the container backend, through the node's shared ``LayerMounts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .store import Image, LayerStore


@dataclass(frozen=True)
class LayerMount:
    digest: str
    source: Path  # the EROFS file
    target: Path  # where the node mounts it, shared by every sandbox


@dataclass(frozen=True)
class OverlayPlan:
    layers: tuple[LayerMount, ...]  # bottom first
    upper: Path
    work: Path
    target: Path

    @property
    def options(self) -> str:
        # overlayfs lists lower dirs top first.
        lower = ":".join(str(m.target) for m in reversed(self.layers))
        return f"lowerdir={lower},upperdir={self.upper},workdir={self.work}"


def compose(image: Image, store: LayerStore, layer_mount_dir: Path, sandbox_dir: Path) -> OverlayPlan:
    layers = tuple(
        LayerMount(digest=d, source=store.layer_path(d), target=layer_mount_dir / d) for d in image.layers
    )
    return OverlayPlan(
        layers=layers,
        upper=sandbox_dir / "upper",
        work=sandbox_dir / "work",
        target=sandbox_dir / "rootfs",
    )
