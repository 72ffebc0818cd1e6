"""E2B's template builder on DSec: ``Template().from_…().run_cmd(…).copy(…)`` and
``Template.build`` end as a DSec image built by the nodes' Dockerfile builds (``build_image``).

The SDK's calls, in its order:

1. ``POST /v3/templates`` names the template (its alias is the DSec image's name): a build id;
2. ``GET /templates/{id}/files/{hash}`` for each ``.copy``: present (uploaded before, by this
   project), else an upload link: a signed, single-use URL on this apiserver that expires
   (``PUT /e2b/template-files/{token}``, the tar the SDK makes);
3. ``POST /v2/templates/{id}/builds/{build}``: the steps, translated here into Dockerfile text
   and a build context (the uploaded tars), built by ``build_image`` in the background;
4. ``GET /templates/{id}/builds/{build}/status?logsOffset=N``: the state and the log from N.

The build is cached as every Dockerfile build is (the steps, the bytes of the copied files and
the base's layers): the same template again is answered at once. A step that fails ends the
build in ``error`` with E2B's reason, naming the step (its number, as the SDK counts them).

Builds and uploaded files live in this apiserver's memory (a cluster's other apiservers do not
know them): the last ``KEPT_BUILDS`` builds, uploads up to ``MAX_KEPT_FILES_BYTES``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
import json
import posixpath
import re
import secrets
import shlex
import tarfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from libdsec import DSecError, ImageNotFound, InvalidRequest, SandboxNotFound
from libdsec._errors import error_from_wire
from libdsec.protocol import MAX_BUILD_CONTEXT_BYTES, BuildImageRequest, BuildResult

from ...apiserver.auth import Caller
from ...apiserver.cluster import Cluster
from . import _models as m
from ._errors import error_body

UPLOAD_LINK_TTL_S = 900
MAX_KEPT_FILES_BYTES = 256 << 20
KEPT_BUILDS = 256
# E2B's own base image, as the SDK's ``from_base_image()`` and a ``Template()`` with no FROM name it.
E2B_BASE_IMAGES = frozenset({"e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base", "docker.io/e2bdev/base:latest"})
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}\Z")


class UploadLinks:
    """Upload tokens: the project, template and files hash, an expiry and a nonce, signed with a
    key drawn from the root token; each is taken once (the nonces seen are kept until expiry)."""

    def __init__(self, root_token: bytes) -> None:
        self._key = hashlib.sha256(b"dsec-e2b-template-files\0" + root_token).digest()
        self._used: dict[str, float] = {}

    def token(self, project: str, template: str, files_hash: str, now: float | None = None) -> str:
        claims = {"p": project, "t": template, "h": files_hash, "e": int((now or time.time()) + UPLOAD_LINK_TTL_S),
                  "n": secrets.token_hex(8)}
        payload = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":")).encode()).decode().rstrip("=")
        return f"{payload}.{self._sign(payload)}"

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def take(self, token: str, now: float | None = None) -> tuple[str, str, str]:
        """(project, template, files hash) of a valid link, used up; else ``LinkRefused``."""
        now = now or time.time()
        payload, _, signature = token.partition(".")
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()):
            raise LinkRefused(403, "not an upload link of this server")
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        if claims["e"] < now:
            raise LinkRefused(403, "the upload link has expired: ask for a new one (build again)")
        for nonce, expires in list(self._used.items()):
            if expires < now:
                del self._used[nonce]
        if claims["n"] in self._used:
            raise LinkRefused(403, "the upload link was used already: each link takes one upload")
        self._used[claims["n"]] = claims["e"]
        return claims["p"], claims["t"], claims["h"]


class LinkRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class TemplateFiles:
    """The tars uploaded for ``.copy`` steps, by project and files hash; the least recently
    used go first past ``MAX_KEPT_FILES_BYTES``."""

    def __init__(self, limit: int = MAX_KEPT_FILES_BYTES) -> None:
        self.limit = limit
        self._files: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def get(self, project: str, files_hash: str) -> bytes | None:
        data = self._files.get((project, files_hash))
        if data is not None:
            self._files.move_to_end((project, files_hash))
        return data

    def put(self, project: str, files_hash: str, data: bytes) -> None:
        self._files[(project, files_hash)] = data
        while sum(len(d) for d in self._files.values()) > self.limit and len(self._files) > 1:
            self._files.popitem(last=False)


@dataclass
class Build:
    template: str
    build_id: str
    project: str
    status: str = "waiting"  # → building → ready | error
    entries: list[m.BuildLogEntry] = field(default_factory=list)
    reason: m.BuildStatusReason | None = None
    task: asyncio.Task | None = None

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        self.entries.append(m.BuildLogEntry(timestamp=datetime.now(timezone.utc), message=message, level=level,
                                            step=step))

    def fail(self, message: str, step: str | None) -> None:
        self.log(message, "error", step)
        self.status = "error"
        self.reason = m.BuildStatusReason(message=message, step=step, log_entries=self.entries[-20:])


# -- E2B's steps as a Dockerfile -----------------------------------------------------------


@dataclass
class Translation:
    dockerfile: str
    context: bytes  # a tar: each .copy step's files under s<N>/
    steps: dict[int, str]  # Dockerfile line → E2B's step name ("base", "1", …)
    no_cache: bool


class StepRefused(InvalidRequest):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


def _json_words(words: list[str], literal_dollars: bool = True) -> str:
    """A Dockerfile exec form: one line (newlines escaped), no ``<<`` a heredoc check would see;
    ``literal_dollars``: ``$`` escaped for the instructions whose words DSec's Dockerfile
    builds substitute variables in (COPY, WORKDIR; not RUN's exec form)."""
    text = json.dumps(words).replace("<", "\\u003c")
    return text.replace("$", "\\$") if literal_dollars else text


# E2B's own user, which every template has (the SDK's steps end as it: ``set_user("user")``).
TEMPLATE_USER = "user"
_ADD_TEMPLATE_USER = (
    "grep -q '^user:' /etc/passwd || { "
    "grep -q '^user:' /etc/group || echo 'user:x:1000:' >> /etc/group; "
    "echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd; "
    "mkdir -p /home/user && chown 1000:1000 /home/user; }")


def translate(spec: m.TemplateBuildStart, base: str, base_user: str, base_workdir: str,
              files: Callable[[str], bytes | None]) -> Translation:
    """The Dockerfile of E2B's steps over ``base`` (its user and working directory to start
    from, as E2B's steps run), with the uploaded files as its context."""
    lines: list[tuple[str, str]] = []
    context = io.BytesIO()
    user, workdir = base_user or "root", base_workdir or "/"
    no_cache = bool(spec.force)

    def run(command: str, step: str, as_user: str) -> None:
        if as_user != user:
            lines.append((f"USER {as_user}", step))
        lines.append((f"RUN {_json_words(['/bin/sh', '-c', command], literal_dollars=False)}", step))
        if as_user != user:
            lines.append((f"USER {user}", step))

    lines.append((f"FROM {base}", "base"))
    if user != TEMPLATE_USER:
        # Every E2B template has E2B's user (their build system adds it to any image): an
        # image that lacks it gets it, made with nothing but a shell (no useradd needed).
        lines.append(("USER root", "base"))
        lines.append((f"RUN {_json_words(['/bin/sh', '-c', _ADD_TEMPLATE_USER], literal_dollars=False)}", "base"))
    lines.append((f"USER {user}", "base"))
    if workdir != "/":
        lines.append((f"WORKDIR {_json_words([workdir])[2:-2]}", "base"))
    with tarfile.open(fileobj=context, mode="w") as out:
        for n, step in enumerate(spec.steps, 1):
            name, args = str(n), step.args
            no_cache = no_cache or bool(step.force)
            kind = step.type.upper()
            if kind == "RUN":
                if not args or not args[0].strip():
                    raise StepRefused(name, f"step {n}: RUN has no command")
                run(args[0], name, args[1] if len(args) > 1 and args[1] else user)
            elif kind == "COPY":
                if len(args) < 2 or not step.files_hash:
                    raise StepRefused(name, f"step {n}: COPY takes a source, a destination and its files' hash")
                data = files(step.files_hash)
                if data is None:
                    raise StepRefused(name, f"step {n}: the files of COPY {args[0]} were not uploaded")
                copied = _add_files(out, f"s{n}", data, name)
                owner = args[2] if len(args) > 2 and args[2] else (user if user != "root" else "")
                chown = f"--chown={owner} " if owner else ""
                source = posixpath.normpath(args[0].lstrip("/")) or "."
                lines.append((f"COPY {chown}{_json_words([f's{n}/{source}', args[1]])}", name))
                if len(args) > 3 and args[3]:
                    targets = _copy_targets(copied, source, args[1], workdir)
                    if targets:
                        mode = args[3]
                        if not re.fullmatch(r"[0-7]{3,4}", mode):
                            raise StepRefused(name, f"step {n}: mode {mode!r} is not an octal mode")
                        run(f"chmod {mode} -- {shlex.join(targets)}", name, "root")
            elif kind == "ENV":
                if not args or len(args) % 2:
                    raise StepRefused(name, f"step {n}: ENV takes names and values in pairs")
                pairs = []
                for key, value in zip(args[::2], args[1::2], strict=True):
                    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or "\n" in value:
                        raise StepRefused(name, f"step {n}: ENV {key!r}: a name of letters, digits and _, "
                                                "and a value of one line")
                    # As E2B builds them (and as the SDK's from_dockerfile relies on, for
                    # `ENV PATH=/x:$PATH`): Docker's ENV, $NAME expanded, \$ a literal $.
                    pairs.append(f'{key}="{value.replace(chr(34), chr(92) + chr(34))}"')
                lines.append((f"ENV {' '.join(pairs)}", name))
            elif kind == "WORKDIR":
                if not args or not args[0] or "\n" in args[0]:
                    raise StepRefused(name, f"step {n}: WORKDIR takes a path")
                workdir = posixpath.normpath(posixpath.join(workdir, args[0]))
                lines.append((f"WORKDIR {_json_words([workdir])[2:-2]}", name))
            elif kind == "USER":
                if not args or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.:-]*", args[0]):
                    raise StepRefused(name, f"step {n}: USER takes one user[:group]")
                user = args[0]
                lines.append((f"USER {user}", name))
            else:
                raise StepRefused(name, f"step {n}: {step.type} is not a step DSec builds (RUN, COPY, ENV, "
                                        "WORKDIR, USER)")
    text = "".join(f"{line}\n" for line, _ in lines)
    return Translation(text, context.getvalue(), {i: step for i, (_, step) in enumerate(lines, 1)}, no_cache)


def _add_files(out: tarfile.TarFile, prefix: str, data: bytes, step: str) -> list[str]:
    """The uploaded tar's members into the context under ``prefix``; their paths (relative to
    the SDK's context directory). Absolute paths, ``..`` and devices are refused."""
    names = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # gzip or not
            for member in tar.getmembers():
                name = posixpath.normpath(member.name)
                if name.startswith("/") or name == ".." or name.startswith("../"):
                    raise StepRefused(step, f"step {step}: the uploaded files have {member.name!r}, outside the context")
                if not (member.isreg() or member.isdir() or member.issym()):
                    continue
                content = tar.extractfile(member) if member.isreg() else None
                member.name = f"{prefix}/{name}" if name != "." else prefix
                # (a pax header's path, there for a name that is not ASCII, wins over the name:
                # it would put the file back where it was)
                member.pax_headers.pop("path", None)
                out.addfile(member, content)
                names.append(name)
    except tarfile.TarError as exc:
        raise StepRefused(step, f"step {step}: the uploaded files are not a tar archive: {exc}") from None
    return names


def _copy_targets(copied: list[str], source: str, dest: str, workdir: str) -> list[str]:
    """Where a COPY puts the files it copies (Docker's rules), for a chmod of them."""
    target = posixpath.normpath(posixpath.join(workdir, dest))
    inside = source.rstrip("/") + "/"
    if any(n.startswith(inside) for n in copied):  # a directory: its contents
        return sorted({posixpath.join(target, n[len(inside):]) for n in copied if n.startswith(inside)})
    tops = [n for n in copied if posixpath.dirname(n) == posixpath.dirname(source)]
    if len(tops) == 1 and not dest.endswith("/"):
        return [target]
    return sorted(posixpath.join(target, posixpath.basename(n)) for n in tops)


def _failure(message: str, plan: Translation, spec: m.TemplateBuildStart) -> tuple[str, str]:
    """A Dockerfile build's error as E2B's: the step (as the SDK counts them) and what failed."""
    message = message.split("; the build's log ends")[0]
    where = re.search(r"\bline (\d+) \((.*?)\) (failed with exit code \S+|could not run: .*)$", message, re.S)
    step = plan.steps.get(int(where.group(1))) if where else None
    if where is None or step is None:
        return step or "finalize", message
    if step == "base":
        return step, f"the base image: {message}"
    given = spec.steps[int(step) - 1]
    words = given.args[:1] if given.type.upper() == "RUN" else given.args[:2]
    what = f"{given.type.upper()} {' '.join(words)}".strip()
    return step, f"build step {step} ({what[:200]!r}) {where.group(3)}"


# -- the routes ---------------------------------------------------------------------------


def add_template_routes(router: APIRouter, cluster: Cluster, caller_of: Callable[[Request], Caller],
                        image_of: Callable[[str], Awaitable[str]], root_token: bytes,
                        answers: Callable) -> None:
    links = UploadLinks(root_token)
    files = TemplateFiles()
    builds: OrderedDict[str, Build] = OrderedDict()

    def template_name(body: m.TemplateBuildRequest) -> str:
        name = body.name or body.alias
        if not name:
            raise InvalidRequest("name the template (Template.build(template, 'NAME'))")
        if ":" in name or body.tags:
            raise InvalidRequest("template tags are not supported by DSec's E2B API: build under a name without "
                                 "':TAG' (each name is one DSec image)")
        if not _NAME.match(name):
            raise InvalidRequest(f"template name {name!r}: DSec's image names are lowercase letters, digits, "
                                 "'.', '_' and '-' (at most 128), starting with a letter or digit")
        return name

    def build_of(caller: Caller, template: str, build_id: str) -> Build:
        build = builds.get(build_id)
        if build is None or build.template != template or not caller.sees(cluster.projects, build.project):
            raise SandboxNotFound(f"build {build_id} of template {template} not found")  # (E2B's 404)
        return build

    @router.post("/v3/templates")
    @router.post("/v2/templates")
    @answers
    async def request_build(request: Request) -> JSONResponse:
        caller = caller_of(request)
        body = m.parse(m.TemplateBuildRequest, await m.read_json(request))
        name = template_name(body)
        build = Build(template=name, build_id=str(uuid.uuid4()), project=caller.project)
        builds[build.build_id] = build
        while len(builds) > KEPT_BUILDS:
            oldest = next(iter(builds.values()))
            if oldest.status in ("waiting", "building"):
                break
            builds.popitem(last=False)
        answer = m.TemplateBuildCreated(template_id=name, build_id=build.build_id, names=[name], tags=["default"],
                                        aliases=[name])
        return JSONResponse(answer.model_dump(mode="json"), status_code=202)

    @router.get("/templates/aliases/{alias}")
    @answers
    async def alias(request: Request, alias: str) -> JSONResponse:
        caller_of(request)
        try:
            await cluster.any_edge().inspect_image(await image_of(alias))
        except (ImageNotFound, InvalidRequest):
            return error_body(404, f"template '{alias}' not found")
        return JSONResponse(m.TemplateAlias(template_id=alias, public=True).model_dump(mode="json"))

    @router.get("/templates/{template_id}/files/{files_hash}")
    @answers
    async def upload_link(request: Request, template_id: str, files_hash: str) -> JSONResponse:
        caller = caller_of(request)
        if not re.fullmatch(r"[0-9a-f]{64}", files_hash):
            raise InvalidRequest("the files hash is 64 hex digits (sha256)")
        if files.get(caller.project, files_hash) is not None:
            return JSONResponse(m.TemplateFileUpload(present=True).model_dump(mode="json", exclude_none=True),
                                status_code=201)
        url = f"{str(request.base_url).rstrip('/')}/e2b/template-files/" + links.token(caller.project, template_id,
                                                                                     files_hash)
        return JSONResponse(m.TemplateFileUpload(present=False, url=url).model_dump(mode="json"), status_code=201)

    @router.put("/template-files/{token}")
    async def upload(request: Request, token: str) -> Response:
        try:
            project, _template, files_hash = links.take(token)
        except LinkRefused as refused:
            return error_body(refused.status, refused.message)
        except (ValueError, KeyError, TypeError):
            return error_body(403, "not an upload link of this server")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BUILD_CONTEXT_BYTES:
                return error_body(413, f"the files are over {MAX_BUILD_CONTEXT_BYTES >> 20} MiB, the most a build "
                                       "context takes")
        files.put(project, files_hash, bytes(data))
        return Response(status_code=200)

    @router.post("/v2/templates/{template_id}/builds/{build_id}")
    @answers
    async def start_build(request: Request, template_id: str, build_id: str) -> Response:
        caller = caller_of(request)
        spec = m.parse(m.TemplateBuildStart, await m.read_json(request))
        build = build_of(caller, template_id, build_id)
        if build.status != "waiting":
            return error_body(409, f"build {build_id} was started already")
        build.status = "building"
        build.task = asyncio.get_running_loop().create_task(run_build(build, spec))
        return Response(status_code=202)

    @router.get("/templates/{template_id}/builds/{build_id}/status")
    @answers
    async def status(request: Request, template_id: str, build_id: str) -> JSONResponse:
        caller = caller_of(request)
        build = build_of(caller, template_id, build_id)
        try:
            offset = max(0, int(request.query_params.get("logsOffset") or 0))
            limit = min(100, max(0, int(request.query_params.get("limit") or 100)))
        except ValueError:
            raise InvalidRequest("logsOffset and limit are numbers") from None
        info = m.TemplateBuildInfo(template_id=build.template, build_id=build.build_id, status=build.status,
                                   log_entries=build.entries[offset:offset + limit], reason=build.reason)
        return JSONResponse(info.model_dump(mode="json", exclude_none=True))

    async def run_build(build: Build, spec: m.TemplateBuildStart) -> None:
        try:
            await _build(build, spec)
        except StepRefused as exc:
            build.fail(exc.message, exc.step)
        except DSecError as exc:
            build.fail(exc.message or type(exc).__name__, None)
        except Exception as exc:  # noqa: BLE001 - the build's caller polls for it: said there
            build.fail(f"the build failed: {exc}", None)

    async def _build(build: Build, spec: m.TemplateBuildStart) -> None:
        began = time.monotonic()
        if spec.from_image_registry:
            raise StepRefused("base", "registry credentials (fromImageRegistry) are not supported by DSec's E2B API: "
                                      "pull the image with `dsec image pull NAME REF --authfile F` and build "
                                      "from_template('NAME')")
        edge = cluster.any_edge()
        if spec.from_template:
            base = await image_of(spec.from_template)
        else:
            ref = spec.from_image or "e2bdev/base"
            base = await image_of("base") if ref in E2B_BASE_IMAGES else ref
        try:
            info = await edge.inspect_image(base)
            user, workdir = info.user, info.workdir
        except (ImageNotFound, InvalidRequest):
            if spec.from_template:
                raise StepRefused("base", f"template '{spec.from_template}' not found") from None
            user, workdir = "root", "/"  # a registry reference: the build pulls it
        plan = translate(spec, base, user, workdir, lambda h: files.get(build.project, h))
        build.log(f"building template {build.template} over {base} ({len(spec.steps)} steps)")
        request = BuildImageRequest(name=build.template, dockerfile=plan.dockerfile,
                                    context_b64=base64.b64encode(plan.context).decode(), no_cache=plan.no_cache,
                                    start_cmd=spec.start_cmd or None, ready_cmd=spec.ready_cmd or None)
        result: BuildResult | None = None
        async for event in edge.build_image(request, build.project):
            if event.event in ("stdout", "stderr") and event.data:
                for line in event.data.splitlines():
                    if line.strip():
                        build.log(line)
            elif event.event == "exit" and event.result is not None:
                result = BuildResult.model_validate_json(event.result.stdout)
            elif event.event == "error":
                error = error_from_wire({"error": event.error}, 500)
                raise StepRefused(*_failure(error.message or type(error).__name__, plan, spec))
        if result is None:
            raise StepRefused("finalize", "the build ended without a result")
        build.log(f"template {build.template} is ready ({'cached: nothing changed' if result.cached else 'built'} "
                  f"in {time.monotonic() - began:.2f} s)")
        build.status = "ready"
