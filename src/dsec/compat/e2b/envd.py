"""envd, E2B's in-sandbox daemon, as DSec's apiserver answers it at ``/e2b/envd``
(``E2B_SANDBOX_URL``): the Connect RPC services ``process.Process`` and
``filesystem.Filesystem`` (served by ``connectrpc`` with the e2b package's own generated
message classes) and envd's HTTP routes ``/files`` and ``/health``.

The SDK names the sandbox in the ``E2b-Sandbox-Id`` header and proves it may use it with
``X-Access-Token``: the ``envdAccessToken`` the control plane handed out with the sandbox, an
HMAC of the sandbox id under a key drawn from the apiserver's root token (so any apiserver of
the cluster checks it without a lookup, and it opens that one sandbox only). The user it acts
as comes in envd's ``Authorization: Basic`` header (or ``?username=`` on the file routes);
relative paths are taken from that user's home, as envd does.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import os
import posixpath
import re
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from libdsec import DSecError, InvalidRequest, SandboxFileNotFound, Unauthenticated
from libdsec.protocol import SandboxStatus

from ...apiserver.cluster import Cluster
from ...edge.api import EdgeAPI
from ._errors import status_of

# The envd protocol version DSec speaks: the SDK turns on its features by it (default user,
# stdin for commands, close_stdin, octet-stream uploads).
ENVD_VERSION = "0.6.4"
# A file's metadata (``files.write(…, metadata=)``, envd ≥ 0.6.2): extended attributes of this
# namespace (``dsec.edge.xattrs``), sent as ``X-Metadata-<key>`` headers.
METADATA_XATTRS = "user.e2b."
_METADATA_HEADER = "x-metadata-"
_METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")


class EnvdTokens:
    """``envdAccessToken``s: one sandbox each, checked without a lookup. A sandbox whose own
    user is not root has it named in its token (``USER.MAC``, the MAC over both), so envd's
    calls that name no user are taken from that user's home (``/home/user`` in E2B's base)."""

    def __init__(self, root_token: bytes) -> None:
        self._key = hashlib.sha256(b"dsec-e2b-envd\0" + root_token).digest()

    def token(self, sandbox_id: str, user: str = "root") -> str:
        if user == "root":
            return hmac.new(self._key, sandbox_id.encode(), hashlib.sha256).hexdigest()
        mac = hmac.new(self._key, f"{sandbox_id}\0{user}".encode(), hashlib.sha256).hexdigest()
        return f"{user}.{mac}"

    @staticmethod
    def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
        """A file URL's signature as the e2b SDK makes it (``e2b.sandbox.signature``): ``v1_``
        and the unpadded base64 of SHA-256 over the path, ``read`` or ``write``, the user ('' for
        the sandbox's own), the envd token and the expiration (when there is one)."""
        raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
        return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()

    def check(self, sandbox_id: str, given: str) -> str | None:
        """The sandbox's own user the token names (``root`` when none), or None: not its token."""
        user, _, _ = given.rpartition(".")
        user = user or "root"
        return user if hmac.compare_digest(self.token(sandbox_id, user).encode(), given.encode()) else None


@dataclass(frozen=True)
class Target:
    edge: EdgeAPI
    sandbox_id: str
    user: str | None  # None: the sandbox's own user
    own_user: str = "root"  # the sandbox's own user (its envd token names it)

    @property
    def home(self) -> str:
        user = self.user or self.own_user
        return "/root" if user == "root" else f"/home/{user.partition(':')[0]}"

    @property
    def cwd(self) -> str | None:
        """Where a command starts with no ``cwd``: the user's home; for the sandbox's own user,
        its working directory (an E2B template's, ``/home/user`` in ``base``)."""
        return None if self.user is None else self.home

    def path(self, path: str) -> str:
        """``path`` as an absolute path in the sandbox (a relative one from the user's home)."""
        if not path:
            return self.home
        if "\0" in path:
            raise InvalidRequest(f"path {path!r} contains a NUL byte")
        full = path if path.startswith("/") else posixpath.join(self.home, path)
        if ".." in full.split("/"):
            full = posixpath.normpath(full)
        return full


def _basic_user(authorization: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        user = base64.b64decode(value.strip()).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("the Authorization: Basic header is not base64 of 'user:'") from None
    return user or None


class EnvdContext:
    """What the services share: the cluster and the token check."""

    def __init__(self, cluster: Cluster, tokens: EnvdTokens) -> None:
        self.cluster = cluster
        self.tokens = tokens

    def resolve(self, headers, username: str | None = None) -> Target:
        sandbox_id = headers.get("e2b-sandbox-id", "")
        if not sandbox_id:
            raise InvalidRequest("no sandbox named: envd calls carry the E2b-Sandbox-Id header "
                                 "(E2B_SANDBOX_URL=<endpoint>/e2b/envd)")
        own_user = self.tokens.check(sandbox_id, headers.get("x-access-token", ""))
        if own_user is None:
            raise Unauthenticated(f"missing or wrong X-Access-Token for sandbox {sandbox_id}")
        user = username or _basic_user(headers.get("authorization", ""))
        return Target(self.cluster.edge_for(sandbox_id), sandbox_id, user, own_user)

    async def signed(self, request: Request) -> Target:
        """The sandbox and user of a signed file URL (``download_url`` / ``upload_url``), which
        needs no key: its ``signature`` is checked against the sandbox's envd token. The SDK
        joins ``/files`` to ``E2B_SANDBOX_URL`` (its path dropped), so the URL may name no
        sandbox: then it is the running sandbox whose token signed it."""
        query = request.query_params
        given, path, user = query.get("signature", ""), query.get("path", ""), query.get("username", "")
        expiration = query.get("signature_expiration")
        if expiration is not None:
            if not expiration.lstrip("-").isdigit():
                raise InvalidRequest(f"signature_expiration {expiration!r} is not a Unix time")
            if int(expiration) < time.time():
                raise Unauthenticated("signature is already expired")
        operation = "read" if request.method == "GET" else "write"
        named = request.headers.get("e2b-sandbox-id")
        if named:
            candidates = [await self.cluster.edge_for(named).get(named)]
        else:
            candidates = [info for info in await self.cluster.list_sandboxes() if info.status is SandboxStatus.running]
        for info in candidates:
            token = self.tokens.token(info.id, info.init_user)
            wanted = self.tokens.signature(path, operation, user, token, None if expiration is None else int(expiration))
            if hmac.compare_digest(wanted.encode(), given.encode()):
                return Target(self.cluster.edge_for(info.id), info.id, user or None, info.init_user)
        raise Unauthenticated("invalid signature")

    def target(self, ctx) -> Target:
        """For an RPC: its sandbox and user, or the Connect error that refuses it."""
        try:
            return self.resolve(ctx.request_headers)
        except DSecError as exc:
            from ._errors import rpc_error

            raise rpc_error(exc) from None


def _envd_error(exc: DSecError) -> JSONResponse:
    status = status_of(exc)
    return JSONResponse({"code": status, "message": exc.message}, status_code=status)


def _entry(path: str, metadata: dict[str, str]) -> dict:
    entry = {"name": posixpath.basename(path), "type": "file", "path": path}
    if metadata:
        entry["metadata"] = metadata
    return entry


def upload_metadata(headers) -> dict[str, str]:
    """The ``X-Metadata-<key>`` headers of an upload as {key: value} (keys lowercased, as
    envd's), or ``InvalidRequest`` naming the first that is not a header token or printable
    US-ASCII."""
    metadata = {}
    for name, value in headers.items():
        if name.lower().startswith(_METADATA_HEADER):
            key = name[len(_METADATA_HEADER):].lower()
            if not _METADATA_KEY.match(key) or not _METADATA_VALUE.match(value):
                raise InvalidRequest(f"invalid metadata {key!r}: keys are HTTP tokens, values printable US-ASCII")
            metadata[key] = value
    return metadata


async def set_metadata(target: Target, path: str, metadata: dict[str, str]) -> None:
    """Make ``metadata`` the file's (its old metadata goes). A VM's files have none: setting
    some there is refused, none is nothing to do."""
    try:
        await target.edge.set_xattrs(target.sandbox_id, path, METADATA_XATTRS, metadata)
    except InvalidRequest:
        if metadata:
            raise


class EnvdApp:
    """The ASGI app mounted at ``/e2b/envd``: Connect services by their path, HTTP routes by theirs."""

    def __init__(self, envd: EnvdContext, services: dict[str, object]) -> None:
        self.envd = envd
        self.services = services  # "/process.Process/" -> its ASGI app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        for prefix, app in self.services.items():
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
        request = Request(scope, receive)
        if path == "/health":
            response = await self._health(request)
        elif path == "/files" and request.method in ("GET", "POST"):
            response = await self._files(request)
        else:
            response = JSONResponse({"code": 404, "message": f"{request.method} {path} is not an envd route"},
                                    status_code=404)
        await response(scope, receive, send)

    async def _health(self, request: Request) -> Response:
        """204 while the sandbox runs; 502, as E2B's proxy answers, once it does not (paused, gone)."""
        try:
            target = self.envd.resolve(request.headers)
            info = await target.edge.get(target.sandbox_id)
        except Unauthenticated as exc:
            return _envd_error(exc)
        except DSecError as exc:
            return JSONResponse({"code": 502, "message": f"The sandbox was not found: {exc.message}"}, status_code=502)
        if info.status is not SandboxStatus.running:
            # (E2B's proxy words: the SDK tells a sandbox gone by "was not found")
            return JSONResponse({"code": 502, "message": f"The sandbox {info.id} was not found running: it is "
                                                         f"{info.status.value}"}, status_code=502)
        return Response(status_code=204)

    async def _files(self, request: Request) -> Response:
        try:
            if "signature" in request.query_params and "x-access-token" not in request.headers:
                target = await self.envd.signed(request)
            else:
                target = self.envd.resolve(request.headers, request.query_params.get("username") or None)
            if request.method == "GET":
                return await self._read(request, target)
            return await self._write(request, target)
        except DSecError as exc:
            return _envd_error(exc)

    async def signed_files(self, request: Request) -> Response:
        """``/files`` at the apiserver's root: where the SDK's signed file URLs land (see
        ``EnvdContext.signed``); a request with no signature is refused as envd refuses it."""
        if request.method not in ("GET", "POST"):
            return JSONResponse({"code": 405, "message": f"{request.method} /files: GET or POST"}, status_code=405)
        if "signature" not in request.query_params:
            return _envd_error(Unauthenticated("a file URL needs its signature (sandbox.download_url / upload_url), "
                                               "or envd's X-Access-Token and E2b-Sandbox-Id at /e2b/envd/files"))
        return await self._files(request)

    async def _read(self, request: Request, target: Target) -> Response:
        path = target.path(request.query_params.get("path", ""))
        try:
            data = await target.edge.read_file(target.sandbox_id, path)
        except SandboxFileNotFound:
            raise SandboxFileNotFound(f"path '{path}' does not exist") from None
        return Response(content=data, media_type="application/octet-stream")

    async def _write(self, request: Request, target: Target) -> Response:
        metadata = upload_metadata(request.headers)  # (checked before anything is written)
        content_type = request.headers.get("content-type", "")
        files: list[tuple[str, bytes]] = []
        if content_type.startswith("multipart/form-data"):
            form = await request.form()
            for name, part in form.multi_items():
                if name != "file" or isinstance(part, str):
                    continue
                given = request.query_params.get("path") if len(form.getlist("file")) == 1 else None
                files.append((given or part.filename or "", await part.read()))
        else:
            body = await request.body()
            if request.headers.get("content-encoding", "") == "gzip":
                try:
                    body = gzip.decompress(body)
                except (OSError, EOFError):
                    raise InvalidRequest("the body is not gzip, as its Content-Encoding says") from None
            files.append((request.query_params.get("path", ""), body))
        if not files or not all(path for path, _ in files):
            raise InvalidRequest("no file to write: give ?path= and the file's bytes")
        written = []
        for given, data in files:
            path = target.path(given)
            await self._write_one(target, path, data)
            await set_metadata(target, path, metadata)
            written.append(_entry(path, metadata))
        return JSONResponse(written)

    @staticmethod
    async def _write_one(target: Target, path: str, data: bytes) -> None:
        try:
            await target.edge.write_file(target.sandbox_id, path, data, 0o644)
        except SandboxFileNotFound:
            # envd makes the missing parents of a file it writes
            await target.edge.make_dir(target.sandbox_id, os.path.dirname(path) or "/")
            await target.edge.write_file(target.sandbox_id, path, data, 0o644)
