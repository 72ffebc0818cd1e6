"""E2B's control plane (the REST API the e2b SDK calls at ``E2B_API_URL``), under ``/e2b``.

Each route parses E2B's request into one DSec call on the cluster and answers in E2B's shape:

- templates are DSec images (``base``: the image ``DSEC_E2B_BASE_IMAGE`` names, else ``e2b-base``,
  ``base`` or ``python``, the first the store has); one with a start command (an E2B template
  built with ``set_start_cmd``) runs it as a sandbox starts and the create answers once its
  ready command exits 0; ``templates`` builds them (E2B's template builder); a snapshot's id
  (or name) is a template too (``snapshots``: create, list and delete them);
- an E2B timeout is the sandbox's ``ttl_running_stop`` (DSec's TTL is idle time: a sandbox in
  use lives on; ``endAt`` is its last call plus the TTL); ``metadata`` is its ``labels``;
- ``lifecycle``: ``on_timeout="pause"`` (``autoPause``) is ``on_ttl="pause"``, and with
  ``mode="filesystem"`` (``autoPauseMemory`` false) ``on_ttl="pause_filesystem"``;
  ``auto_resume`` (``autoResume.enabled``) is ``auto_resume`` (unset: True, DSec's default);
- a pause with ``memory`` false is DSec's filesystem-only pause (``mode="filesystem"``: its
  processes end, its files stay, a connect or resume starts it afresh over them with a new
  boot id; traffic does not resume it); ``pauseMode`` says which a paused sandbox had. A
  connect with ``memory`` false (``on_resume="reboot"``) is a no-op for a running sandbox or
  one paused so, and refused for one paused whole (DSec does not reboot a frozen sandbox);
- ``network.allowOut`` names domains (a name with a dot, or an IPv4 address) and DSec's mirror
  services (a name without a dot) for its allowlist; ``denyOut`` is what DSec denies anyway;
- ``mcp`` is taken and left to the SDK, which starts E2B's MCP gateway in the sandbox itself
  (the template's ``mcp-gateway`` program; DSec ships none);
- a fork is DSec's ``fork`` with each child on its own (``all_or_none=False``), its ``timeout``
  the children's TTL; a child that carried only the filesystem (a container) runs its
  template's start command afresh.

Errors are E2B's ``{"code": STATUS, "message"}`` bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from libdsec import BackendError, DSecError, ImageNotFound, InvalidRequest, SandboxLost, SandboxNotFound, SandboxStateError
from libdsec._errors import error_from_wire
from libdsec.protocol import (
    DSecContainerRunArgs, ExecRequest, ForkChild, SandboxInfo, SandboxStatus, StartProcessRequest,
)

from ... import settings
from ...apiserver.auth import Authenticator, Caller
from ...apiserver.cluster import Cluster
from . import _models as m
from ._errors import api_error, error_body, status_of
from .envd import ENVD_VERSION, EnvdTokens
from .snapshots import add_snapshot_routes, start_of
from .templates import add_template_routes

BASE_TEMPLATE = "base"
_NO_REBOOT = ("on_resume='reboot' (connect with memory=false) of a sandbox paused with its memory is not supported by "
              "DSec's E2B API; resume it (its memory restored), or pause it with mode='filesystem' (docs/COMPAT.md)")
# The template a sandbox was asked for, where it is not its image's name (``base``): a label of
# DSec's own, not shown in E2B's ``metadata`` (which may not use the prefix).
TEMPLATE_LABEL = "dsec.e2b.template"
_OWN_LABELS = "dsec."
BASE_IMAGES = ("e2b-base", "base", "python")  # what ``base`` is, the first the store has
READY_TIMEOUT_S = 120.0
_STATES = {SandboxStatus.running: "running", SandboxStatus.paused: "paused"}


def network_rules(allow_out: list[str] | None, deny_out: list[str] | None) -> dict[str, bool | list[str]]:
    """E2B's egress options as DSec ``network_rules``; InvalidRequest for what DSec cannot give.

    E2B's ``allow_internet_access`` changes nothing: DSec has no open internet to give (e2b
    2.45 sends ``True`` with every create), and ``False`` is what it does anyway."""
    rules: dict[str, bool | list[str]] = {}
    domains: list[str] = []
    for entry in allow_out or []:
        entry = entry.strip()
        if "/" in entry:
            raise InvalidRequest(f"network.allowOut {entry!r}: DSec allowlists name domains, addresses and services, "
                                 "not address ranges")
        try:
            ipaddress.IPv4Address(entry)
            domains.append(entry)
            continue
        except ValueError:
            pass
        if not entry or entry.startswith("*"):
            raise InvalidRequest(f"network.allowOut {entry!r}: name a domain, an IPv4 address or a DSec service "
                                 "(wildcards are not supported)")
        if "." in entry:
            domains.append(entry)
        else:
            rules[entry] = True
    for entry in deny_out or []:
        if "/" not in entry and "." not in entry and entry.strip() and not entry.strip()[0].isdigit():
            rules.setdefault(entry.strip(), False)
        # Anything else (0.0.0.0/0, a range, a domain) is denied already: DSec allows only what is named.
    if domains:
        rules["domains"] = domains
    return rules


def _answers(route: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
    """DSec's errors in E2B's error bodies (the apiserver's own handlers answer DSec's shape)."""

    @functools.wraps(route)
    async def answer(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except DSecError as exc:
            return api_error(exc)

    return answer


def e2b_router(cluster: Cluster, authenticator: Authenticator, tokens: EnvdTokens) -> APIRouter:
    router = APIRouter(prefix="/e2b", include_in_schema=False)

    def caller_of(request: Request) -> Caller:
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key else request.headers.get("authorization", "")
        return authenticator.caller(authorization)

    async def visible(request: Request, sandbox_id: str) -> tuple[Caller, SandboxInfo]:
        """The caller's sandbox, running or paused; E2B's not-found for any other."""
        caller = caller_of(request)
        try:
            edge = await cluster.edge_for_caller(sandbox_id, caller)
        except InvalidRequest:  # not an id DSec makes: to E2B, a sandbox that is not there
            raise SandboxNotFound(f"sandbox {sandbox_id} not found") from None
        info = await edge.get(sandbox_id)
        if info.status not in _STATES:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found ({info.status.value})")
        return caller, info

    chosen_base = settings.current().e2b_base_image

    async def image_of(template: str) -> str:
        if template != BASE_TEMPLATE:
            return template
        if chosen_base:
            return chosen_base
        for name in BASE_IMAGES[:-1]:
            try:
                await cluster.any_edge().inspect_image(name)
                return name
            except ImageNotFound:
                pass
        return BASE_IMAGES[-1]

    async def started(info: SandboxInfo, template: str) -> None:
        """A template's start command started (in the background), then its ready command run
        until it exits 0; past ``READY_TIMEOUT_S`` the sandbox is stopped and the create fails."""
        edge = cluster.edge_for(info.id)
        image = await edge.inspect_image(info.image)
        if image.start_cmd:
            await edge.start_process(info.id, StartProcessRequest(command=image.start_cmd))
        if not image.ready_cmd:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            result = await edge.exec(info.id, ExecRequest(command=image.ready_cmd, timeout=max(1.0, min(30.0, left))))
            if result.exit_code == 0:
                return
            if left <= 0:  # (the create stops the sandbox)
                raise BackendError(f"template '{template}': its ready command ({image.ready_cmd!r}) did not succeed "
                                   f"within {READY_TIMEOUT_S:g} s (exit code {result.exit_code}: "
                                   f"{(result.stderr or result.stdout)[-500:]!r}); the sandbox was stopped")
            await asyncio.sleep(0.1)

    def created(info: SandboxInfo, template: str) -> m.Sandbox:
        return m.Sandbox(template_id=template, sandbox_id=info.id, alias=template, client_id=info.node,
                         envd_version=ENVD_VERSION, envd_access_token=tokens.token(info.id, info.init_user))

    def listed(info: SandboxInfo, cls: type[m.ListedSandbox] = m.ListedSandbox, **extra) -> m.ListedSandbox:
        end = info.last_active_at + timedelta(seconds=info.ttl_running_stop)
        template = info.labels.get(TEMPLATE_LABEL, info.image)
        metadata = {k: v for k, v in info.labels.items() if not k.startswith(_OWN_LABELS)}
        return cls(template_id=template, alias=template, sandbox_id=info.id, client_id=info.node,
                   started_at=info.created_at, end_at=end, cpu_count=max(1, round(info.cpu_cores_limit)),
                   memory_mb=info.memory_limit_mb, disk_size_mb=0, metadata=metadata,
                   state=_STATES.get(info.status, info.status.value), envd_version=ENVD_VERSION, **extra)

    @router.post("/sandboxes")
    @router.post("/v2/sandboxes")
    @_answers
    async def create(request: Request) -> JSONResponse:
        caller = caller_of(request)
        body = m.parse(m.NewSandbox, await m.read_json(request))
        # ``mcp`` needs nothing of the API: E2B's SDK starts the gateway itself, the template's
        # ``mcp-gateway`` program run in the sandbox once it is made (a template without one
        # fails that start, and the SDK kills the sandbox).
        for name, value in (("iam", body.iam), ("volumeMounts", body.volume_mounts)):
            if value:
                raise InvalidRequest(f"{name} is not supported by DSec's E2B API (docs/COMPAT.md)")
        filesystem_only = bool(body.auto_pause) and body.auto_pause_memory is False
        if filesystem_only and body.auto_resume is not None and body.auto_resume.enabled:
            raise InvalidRequest("autoResume cannot be combined with a filesystem-only autoPause (autoPauseMemory "
                                 "false): such a sandbox is resumed by a connect or resume only")
        network = body.network or m.NetworkConfig()
        if network.rules or network.egress_proxy or network.mask_request_host:
            raise InvalidRequest("network.rules, network.egressProxy and network.maskRequestHost are not supported by "
                                 "DSec's E2B API")
        rules = network_rules(network.allow_out, network.deny_out)
        if any(k.startswith(_OWN_LABELS) for k in body.metadata):
            raise InvalidRequest(f"metadata keys starting with {_OWN_LABELS!r} are DSec's own")
        snapshot = await start_of(cluster, body.template_id)
        image = "" if snapshot is not None else await image_of(body.template_id)
        labels = {**body.metadata, **({TEMPLATE_LABEL: body.template_id} if image != body.template_id else {})}
        try:
            args = DSecContainerRunArgs(container_image=image, ttl_running_stop=float(body.timeout),
                                        env=body.env_vars, labels=labels, network_rules=rules,
                                        on_ttl=("pause_filesystem" if filesystem_only else "pause") if body.auto_pause
                                        else "stop",
                                        auto_resume=True if body.auto_resume is None else body.auto_resume.enabled,
                                        snapshot=None if snapshot is None else snapshot.id)
        except ValidationError as exc:
            raise InvalidRequest(f"malformed request: {exc.errors()[0].get('msg')}") from None
        try:
            info = await cluster.create(args, caller.project)
        except ImageNotFound:
            raise ImageNotFound(f"template '{body.template_id}' not found") from None
        try:
            await started(info, body.template_id)
        except BaseException:
            with contextlib.suppress(DSecError):
                await cluster.stop(info.id, "its template's start failed")
            raise
        return JSONResponse(created(info, body.template_id).model_dump(mode="json"), status_code=201)

    @router.get("/sandboxes")
    @router.get("/v2/sandboxes")
    @_answers
    async def list_sandboxes(request: Request) -> JSONResponse:
        caller = caller_of(request)
        wanted = set(request.query_params.get("state", "running" if request.url.path.endswith("/e2b/sandboxes")
                                              else "running,paused").split(","))
        query = request.query_params
        metadata = dict(parse_qsl(query.get("metadata", ""), keep_blank_values=True))
        try:
            after = datetime.fromisoformat(query["startedAfter"]) if query.get("startedAfter") else None
            limit = int(query.get("limit") or 0) or None
            offset = int(query.get("nextToken") or 0)
        except ValueError as exc:
            raise InvalidRequest(f"malformed query: {exc}") from None
        if query.get("order", "desc") not in ("asc", "desc"):
            raise InvalidRequest("order is asc or desc")
        found = []
        for info in await cluster.list_sandboxes():
            item = listed(info)
            if (_STATES.get(info.status) in wanted and caller.sees(cluster.projects, info.project)
                    and all(item.metadata.get(k) == v for k, v in metadata.items())
                    and (after is None or info.created_at >= after)
                    and query.get("template") in (None, "", item.template_id)):
                found.append(item)
        found.sort(key=lambda s: s.started_at, reverse=query.get("order", "desc") == "desc")
        page = found[offset:offset + limit] if limit else found[offset:]
        headers = {"x-next-token": str(offset + len(page))} if limit and offset + len(page) < len(found) else {}
        return JSONResponse([s.model_dump(mode="json") for s in page], headers=headers)

    @router.get("/sandboxes/{sandbox_id}")
    @_answers
    async def get_sandbox(request: Request, sandbox_id: str) -> JSONResponse:
        _, info = await visible(request, sandbox_id)
        detail = listed(info, m.SandboxDetail, envd_access_token=tokens.token(info.id, info.init_user),
                        lifecycle=m.Lifecycle(on_timeout="kill" if info.on_ttl == "stop" else "pause",
                                              auto_resume=info.auto_resume and info.on_ttl != "pause_filesystem"),
                        pause_mode=info.pause_mode)
        return JSONResponse(detail.model_dump(mode="json", exclude={"pause_mode"} if info.pause_mode is None else None))

    @router.delete("/sandboxes/{sandbox_id}")
    @_answers
    async def kill(request: Request, sandbox_id: str) -> Response:
        try:
            await visible(request, sandbox_id)
        except SandboxLost as lost:  # (whose it is, its node checks when it is back)
            await cluster.keep_stop(sandbox_id, lost, "killed through the E2B API", caller_of(request))
        await cluster.stop(sandbox_id, "killed through the E2B API")
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout")
    @_answers
    async def set_timeout(request: Request, sandbox_id: str) -> Response:
        body = m.parse(m.TimeoutRequest, await m.read_json(request))
        await visible(request, sandbox_id)
        await cluster.edge_for(sandbox_id).set_ttl(sandbox_id, float(max(1, body.timeout)))
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/refreshes")
    @_answers
    async def refresh(request: Request, sandbox_id: str) -> Response:
        _, info = await visible(request, sandbox_id)
        body = await m.read_json(request) or {}
        duration = body.get("duration") if isinstance(body, dict) else None
        await cluster.edge_for(sandbox_id).set_ttl(sandbox_id, float(duration or info.ttl_running_stop))
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/fork")
    @_answers
    async def fork(request: Request, sandbox_id: str) -> JSONResponse:
        """E2B's fork: each child succeeds or fails on its own (DSec's ``all_or_none=False``);
        a child that forked the filesystem only runs its template's start command afresh."""
        body = m.parse(m.ForkRequest, await m.read_json(request) or {})
        _, info = await visible(request, sandbox_id)
        result = await cluster.fork(sandbox_id, body.count, False, float(body.timeout))
        template = info.labels.get(TEMPLATE_LABEL, info.image)

        async def answer(child: ForkChild) -> dict:
            if child.sandbox is None:
                error = child.error
                status = status_of(error_from_wire({"error": error.model_dump()}, 500)) if error else 500
                return {"error": {"code": status, "message": error.message if error else "the fork failed"}}
            try:
                if result.kind == "filesystem":
                    await started(child.sandbox, template)
            except DSecError as exc:
                with contextlib.suppress(DSecError):
                    await cluster.stop(child.sandbox.id, "its template's start failed")
                return {"error": {"code": status_of(exc), "message": exc.message}}
            return {"sandbox": created(child.sandbox, template).model_dump(mode="json")}

        answers = await asyncio.gather(*(answer(child) for child in result.children))
        return JSONResponse(list(answers), status_code=201)

    @router.post("/sandboxes/{sandbox_id}/pause")
    @_answers
    async def pause(request: Request, sandbox_id: str) -> Response:
        body = m.parse(m.PauseRequest, await m.read_json(request))
        _, info = await visible(request, sandbox_id)
        if info.status is SandboxStatus.paused:
            return error_body(409, f"sandbox {sandbox_id} is already paused")
        await cluster.edge_for(sandbox_id).pause(sandbox_id, "filesystem" if body.memory is False else "full")
        return Response(status_code=204)

    async def connect_to(request: Request, sandbox_id: str, resume_only: bool) -> JSONResponse:
        body = m.parse(m.ConnectRequest, await m.read_json(request))
        _, info = await visible(request, sandbox_id)
        edge = cluster.edge_for(sandbox_id)
        resumed = info.status is SandboxStatus.paused
        if resume_only and not resumed:
            raise SandboxStateError(f"sandbox {sandbox_id} is already running")
        if resumed and body.memory is False and info.pause_mode != "filesystem":
            raise InvalidRequest(_NO_REBOOT)
        if resumed:
            filesystem_only = info.pause_mode == "filesystem"
            info = await edge.resume(sandbox_id)
            if filesystem_only:  # started afresh: its template's start command too, as at its create
                await started(info, info.labels.get(TEMPLATE_LABEL, info.image))
        now = datetime.now(timezone.utc)
        ends = info.last_active_at + timedelta(seconds=info.ttl_running_stop)
        if body.timeout is not None and now + timedelta(seconds=body.timeout) > ends:  # E2B only extends
            info = await edge.set_ttl(sandbox_id, float(body.timeout))
        answer = created(info, info.labels.get(TEMPLATE_LABEL, info.image)).model_dump(mode="json")
        return JSONResponse(answer, status_code=201 if resumed else 200)

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    @_answers
    async def connect(request: Request, sandbox_id: str) -> JSONResponse:
        return await connect_to(request, sandbox_id, resume_only=False)

    @router.post("/sandboxes/{sandbox_id}/resume")
    @_answers
    async def resume(request: Request, sandbox_id: str) -> JSONResponse:
        return await connect_to(request, sandbox_id, resume_only=True)

    @router.put("/sandboxes/{sandbox_id}/network")
    @_answers
    async def update_network(request: Request, sandbox_id: str) -> Response:
        body = m.parse(m.NetworkUpdate, await m.read_json(request))
        if body.rules:
            raise InvalidRequest("network.rules is not supported by DSec's E2B API")
        await visible(request, sandbox_id)
        rules = network_rules(body.allow_out, body.deny_out)
        await cluster.edge_for(sandbox_id).set_network_rules(sandbox_id, rules)
        return Response(status_code=204)

    @router.get("/sandboxes/{sandbox_id}/metrics")
    @_answers
    async def metrics(request: Request, sandbox_id: str) -> JSONResponse:
        _, info = await visible(request, sandbox_id)
        try:
            start, end = (datetime.fromtimestamp(int(request.query_params[k]), timezone.utc)
                          if request.query_params.get(k) else None for k in ("start", "end"))
        except (ValueError, OverflowError):
            raise InvalidRequest("start and end are Unix times in seconds") from None
        sample = await _metrics(cluster, info)
        if (start and sample.timestamp < start - timedelta(seconds=1)) or (end and sample.timestamp > end + timedelta(seconds=1)):
            return JSONResponse([])  # the one sample DSec takes is now
        return JSONResponse([sample.model_dump(mode="json")])

    @router.get("/templates")
    @_answers
    async def templates(request: Request) -> JSONResponse:
        caller_of(request)
        images = await cluster.any_edge().list_images()
        names = [i.name for i in images] + ([BASE_TEMPLATE] if all(i.name != BASE_TEMPLATE for i in images) else [])
        return JSONResponse([m.Template(template_id=n, build_id=n, aliases=[n], names=[n],
                                        envd_version=ENVD_VERSION).model_dump(mode="json") for n in names])

    add_template_routes(router, cluster, caller_of, image_of, authenticator.root_token, _answers)
    add_snapshot_routes(router, cluster, caller_of, visible, _answers)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unsupported(request: Request, path: str) -> JSONResponse:
        caller_of(request)  # a bad key is told so first
        return error_body(404 if request.method == "GET" else 501,
                          f"{request.method} /{path} is not part of DSec's E2B API (docs/COMPAT.md)")

    return router


# One command in the sandbox reads its cgroup (v2 or v1) and its root filesystem's use.
_METRICS_SCRIPT = (
    "c=/sys/fs/cgroup; "
    "if [ -r $c/memory.current ]; then m=$(cat $c/memory.current); "
    "u=$(sed -n 's/^usage_usec //p' $c/cpu.stat); u=$((u*1000)); "
    "else m=$(cat $c/memory/memory.usage_in_bytes 2>/dev/null || echo 0); "
    "u=$(cat $c/cpuacct/cpuacct.usage 2>/dev/null || echo 0); fi; "
    "echo \"$m $u $(cut -d' ' -f1 /proc/uptime)\"; df -kP / | tail -n 1"
)


async def _metrics(cluster: Cluster, info: SandboxInfo) -> m.SandboxMetric:
    result = await cluster.exec(info.id, ExecRequest(command=_METRICS_SCRIPT, timeout=10))
    lines = result.stdout.split("\n")
    try:
        mem, cpu_ns, _uptime = lines[0].split()
        disk = lines[1].split()
        mem_used, disk_total, disk_used = int(mem), int(disk[1]) * 1024, int(disk[2]) * 1024
        cpu_ns_used = int(cpu_ns)
    except (ValueError, IndexError):
        raise DSecError(f"could not read the sandbox's metrics: {result.stdout[:200]!r} {result.stderr[:200]!r}") from None
    now = datetime.now(timezone.utc)
    lifetime_s = max((now - info.created_at).total_seconds(), 1e-3)
    cores = max(1, round(info.cpu_cores_limit))
    cpu_pct = min(100.0, 100.0 * cpu_ns_used / 1e9 / lifetime_s / cores)  # the mean since it started
    return m.SandboxMetric(timestamp=now, timestamp_unix=int(now.timestamp()), cpu_count=cores,
                           cpu_used_pct=round(cpu_pct, 2), mem_used=mem_used,
                           mem_total=info.memory_limit_mb * 1024 * 1024, disk_used=disk_used,
                           disk_total=disk_total)
