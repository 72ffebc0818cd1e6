"""The node seam's own wire models: requests and answers of the calls an apiserver makes on a
node that no SDK call makes (``dsec.edge.ops`` names the operation each belongs to).

The seam's other models — ``ExecRequest``, ``PackDiffRequest``, the fncall models, and every
answer a client also sees — are the SDK's (``libdsec.protocol``). Like those, every model here
forbids unknown fields, and errors cross as ``ErrorResponse``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from libdsec.protocol import (
    MAX_SANDBOX_BATCH,
    BuildImageRequest,
    DSecContainerRunArgs,
    SandboxKind,
    run_args_of,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeCreateRequest(_Model):
    """Create one sandbox of ``kind`` for ``project`` (``args``: that kind's run args)."""

    kind: SandboxKind = SandboxKind.container
    project: str = "root"
    args: dict

    def run_args(self) -> DSecContainerRunArgs:
        return run_args_of(self.kind.value, self.args)


class NodeBuildRequest(_Model):
    """A Dockerfile build on a node, for ``project`` (its build sandbox counts there)."""

    project: str = "root"
    build: BuildImageRequest


class NodeBatchRequest(NodeCreateRequest):
    """Create ``count`` sandboxes, all or none; answered as an NDJSON stream of ``BatchEvent``
    (``created`` with the index within this request, then ``done`` or ``error``)."""

    count: int = Field(ge=1, le=MAX_SANDBOX_BATCH)
    # Held for this batch until committed (``POST /node/v1/batches/{batch}:commit``); none:
    # the node's stream ending whole is the commit.
    batch: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")


class NodeStopRequest(_Model):
    reason: str = Field(default="stopped by request", max_length=1000)


class LayerUse(_Model):
    """What a node's sandboxes (pooled ones included) hold of the layer store."""

    images: list[str] = Field(default_factory=list)
    layers: list[str] = Field(default_factory=list)


class ImageRemoveRequest(_Model):
    """Remove image ``name`` unless one of ``in_use`` (every node's image refs) holds it."""

    in_use: frozenset[str] = frozenset()


class SnapshotRemoveRequest(_Model):
    """Remove a snapshot unless sandboxes started from it run: ``users``, those the apiserver
    found on every node (the node adds its own)."""

    users: list[str] = Field(default_factory=list)


class LayerGCRequest(_Model):
    """Remove the layers no image names and no node holds (``in_use``: every node's digests)."""

    in_use: frozenset[str] = frozenset()


class LayerGCResult(_Model):
    removed: list[str]


MAX_XATTR_PATHS = 10_000


class GetXattrsRequest(_Model):
    """The attributes under ``prefix`` of each of ``paths`` (``dsec.edge.xattrs``)."""

    paths: list[str] = Field(max_length=MAX_XATTR_PATHS)
    prefix: str


class XattrsList(_Model):
    values: list[dict[str, str]]  # one a path, in order


class SetXattrsRequest(_Model):
    """Make ``values`` the attributes of ``path`` under ``prefix``."""

    path: str
    prefix: str
    values: dict[str, str]
