"""The parts of E2B's control-plane OpenAPI that DSec answers, as pydantic models (E2B's own
field names, camelCase). Requests ignore fields DSec has no use for; the ones it cannot honour
are refused by the routes, naming them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Answer(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout


class NetworkConfig(_Request):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    rules: dict | None = None
    egress_proxy: dict | None = Field(None, alias="egressProxy")


class NewSandbox(_Request):
    template_id: str = Field("base", alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(DEFAULT_TIMEOUT_S, ge=1)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    metadata: dict[str, str] = Field(default_factory=dict)
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    auto_pause: bool = Field(False, alias="autoPause")
    auto_resume: dict | bool | None = Field(None, alias="autoResume")
    mcp: dict | None = None
    iam: dict | None = None
    volume_mounts: list | None = Field(None, alias="volumeMounts")


class TimeoutRequest(_Request):
    timeout: int = Field(ge=0)


class ConnectRequest(_Request):
    timeout: int | None = Field(None, ge=1)


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


class SandboxDetail(ListedSandbox):
    envd_access_token: str = Field(alias="envdAccessToken")
    domain: str | None = None


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
