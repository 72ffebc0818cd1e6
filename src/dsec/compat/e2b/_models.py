"""The parts of E2B's control-plane OpenAPI that DSec answers, as pydantic models (E2B's own
field names, camelCase). Requests ignore fields DSec has no use for; the ones it cannot honour
are refused by the routes, naming them."""

from __future__ import annotations

import json
from datetime import datetime

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libdsec import InvalidRequest


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Answer(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


def parse(model: type[BaseModel], body: object):
    """``body`` as ``model``, or InvalidRequest naming the first field that is wrong."""
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        raise InvalidRequest(f"malformed request: {where}: {err.get('msg', 'invalid')}") from None


async def read_json(request: Request) -> object:
    raw = await request.body()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise InvalidRequest("malformed request: the body is not JSON") from None


DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout


class NetworkConfig(_Request):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    rules: dict | None = None
    egress_proxy: dict | None = Field(None, alias="egressProxy")
    mask_request_host: str | None = Field(None, alias="maskRequestHost")


class AutoResume(_Request):
    enabled: bool = False


class NewSandbox(_Request):
    template_id: str = Field("base", alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(DEFAULT_TIMEOUT_S, ge=1)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    metadata: dict[str, str] = Field(default_factory=dict)
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    # E2B's ``lifecycle``: ``on_timeout="pause"`` is ``autoPause``; ``autoPauseMemory`` false
    # asks for a filesystem-only pause; ``auto_resume`` is ``autoResume.enabled``.
    auto_pause: bool = Field(False, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    mcp: dict | None = None
    iam: dict | None = None
    volume_mounts: list | None = Field(None, alias="volumeMounts")


class PauseRequest(_Request):
    # False: a filesystem-only pause (its processes end; a resume boots it afresh).
    memory: bool | None = None


class TimeoutRequest(_Request):
    timeout: int = Field(ge=0)


class ForkRequest(_Request):
    """E2B's fork: ``count`` children (1 to 20), each with ``timeout`` seconds to live."""

    timeout: int = Field(15, ge=1)
    count: int = Field(1, ge=1, le=20)


class ConnectRequest(_Request):
    timeout: int | None = Field(None, ge=1)
    # False (``on_resume="reboot"``): a paused sandbox cold-boots from its files.
    memory: bool | None = None


class NetworkUpdate(_Request):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_internet_access: bool | None = None
    rules: dict | None = None


class Sandbox(_Answer):
    """What a create or a connect answers."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    alias: str | None = None
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    envd_access_token: str = Field(alias="envdAccessToken")
    traffic_access_token: str | None = Field(None, alias="trafficAccessToken")
    domain: str | None = None


class ListedSandbox(_Answer):
    template_id: str = Field(alias="templateID")
    alias: str | None = None
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    started_at: datetime = Field(alias="startedAt")
    end_at: datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    metadata: dict[str, str] = Field(default_factory=dict)
    state: str
    envd_version: str = Field(alias="envdVersion")


class Lifecycle(_Answer):
    on_timeout: str = Field(alias="onTimeout")  # "kill" or "pause"
    auto_resume: bool = Field(alias="autoResume")


class SandboxDetail(ListedSandbox):
    envd_access_token: str = Field(alias="envdAccessToken")
    domain: str | None = None
    lifecycle: Lifecycle | None = None
    # What its latest pause kept: ``full`` or ``filesystem`` (while it is paused).
    pause_mode: str | None = Field(None, alias="pauseMode")


class SandboxMetric(_Answer):
    timestamp: datetime
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(0, alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")


class Template(_Answer):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    aliases: list[str]
    names: list[str]
    public: bool = False
    cpu_count: int = Field(1, alias="cpuCount")
    memory_mb: int = Field(512, alias="memoryMB")
    disk_size_mb: int = Field(0, alias="diskSizeMB")
    envd_version: str = Field(alias="envdVersion")
    build_status: str = Field("ready", alias="buildStatus")


# -- templates (E2B's template builder: docs/COMPAT.md) -------------------------------------


class TemplateBuildRequest(_Request):
    """``POST /v3/templates`` (``name``; ``alias`` from older SDKs)."""

    name: str | None = None
    alias: str | None = None
    tags: list[str] | None = None
    cpu_count: int | None = Field(None, alias="cpuCount", ge=1)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=16)


class TemplateStep(_Request):
    type: str
    args: list[str] = Field(default_factory=list)
    force: bool | None = False
    files_hash: str | None = Field(None, alias="filesHash", pattern=r"^[0-9a-f]{64}$")
    force_upload: bool | None = Field(None, alias="forceUpload")


class TemplateBuildStart(_Request):
    """``POST /v2/templates/{templateID}/builds/{buildID}``: what to build."""

    from_image: str | None = Field(None, alias="fromImage")
    from_template: str | None = Field(None, alias="fromTemplate")
    from_image_registry: dict | None = Field(None, alias="fromImageRegistry")
    force: bool | None = False
    steps: list[TemplateStep] = Field(default_factory=list)
    start_cmd: str | None = Field(None, alias="startCmd")
    ready_cmd: str | None = Field(None, alias="readyCmd")


class TemplateBuildCreated(_Answer):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool = False
    names: list[str]
    tags: list[str]
    aliases: list[str]


class TemplateFileUpload(_Answer):
    present: bool
    url: str | None = None


class BuildLogEntry(_Answer):
    timestamp: datetime
    message: str
    level: str = "info"
    step: str | None = None


class BuildStatusReason(_Answer):
    message: str
    step: str | None = None
    log_entries: list[BuildLogEntry] = Field(default_factory=list, alias="logEntries")


class TemplateBuildInfo(_Answer):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: str
    logs: list[str] = Field(default_factory=list)
    log_entries: list[BuildLogEntry] = Field(default_factory=list, alias="logEntries")
    reason: BuildStatusReason | None = None


class TemplateAlias(_Answer):
    template_id: str = Field(alias="templateID")
    public: bool = False


class SnapshotRequest(_Request):
    """``POST /sandboxes/{id}/snapshots``: ``memory`` false is a filesystem-only snapshot."""

    name: str | None = None
    memory: bool | None = None


class SnapshotInfo(_Answer):
    snapshot_id: str = Field(alias="snapshotID")
    names: list[str] = Field(default_factory=list)
