"""DSec's errors in E2B's shapes: the control plane's ``{"code": STATUS, "message"}`` bodies and
envd's Connect codes (the ones the e2b SDK maps to its own exceptions)."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from fastapi.responses import JSONResponse

from libdsec import (
    CapacityExceeded,
    CommandTimeout,
    DSecError,
    ImageNotFound,
    InvalidRequest,
    ProcessNotFound,
    QuotaExceeded,
    SandboxFileNotFound,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SnapshotConflict,
    SnapshotNotFound,
    Unauthenticated,
)

# The e2b SDK reads a 400 as a bad argument, 404 as not found, 409 as a conflict (e.g. paused
# already), 401 as a bad key, 429 as a rate limit, 503 as busy.
_STATUS: list[tuple[type[DSecError], int]] = [
    (InvalidRequest, 400),
    (Unauthenticated, 401),
    (ImageNotFound, 404), (SandboxNotFound, 404), (SandboxFileNotFound, 404), (ProcessNotFound, 404),
    (SnapshotNotFound, 404),
    (SandboxStateError, 409), (SnapshotConflict, 409),
    (SandboxLost, 410),
    (CommandTimeout, 408),
    (QuotaExceeded, 429),
    (CapacityExceeded, 503),
]

_CODE: list[tuple[type[DSecError], Code]] = [
    (InvalidRequest, Code.INVALID_ARGUMENT),
    (Unauthenticated, Code.UNAUTHENTICATED),
    (ImageNotFound, Code.NOT_FOUND), (SandboxNotFound, Code.NOT_FOUND), (SandboxFileNotFound, Code.NOT_FOUND),
    (ProcessNotFound, Code.NOT_FOUND), (SnapshotNotFound, Code.NOT_FOUND),
    (SandboxStateError, Code.FAILED_PRECONDITION), (SnapshotConflict, Code.FAILED_PRECONDITION),
    (SandboxLost, Code.UNAVAILABLE),
    (CommandTimeout, Code.DEADLINE_EXCEEDED),
    (QuotaExceeded, Code.RESOURCE_EXHAUSTED), (CapacityExceeded, Code.RESOURCE_EXHAUSTED),
]


def status_of(exc: DSecError) -> int:
    return next((status for cls, status in _STATUS if isinstance(exc, cls)), 500)


def error_body(status: int, message: str) -> JSONResponse:
    """E2B's error answer (its OpenAPI ``Error``)."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def api_error(exc: DSecError) -> JSONResponse:
    return error_body(status_of(exc), exc.message or type(exc).__name__)


def rpc_error(exc: DSecError) -> ConnectError:
    code = next((code for cls, code in _CODE if isinstance(exc, cls)), Code.INTERNAL)
    return ConnectError(code, exc.message or type(exc).__name__)
