"""One exception tree for DSec, shared by the SDK and the server.

    DSecError
    ├── InvalidRequest (ValueError)          malformed request or argument
    │   ├── LimitOutOfRange                  memory / CPU / TTL / count outside what is allowed
    │   ├── KeyReused                        an idempotency key used before with other args (409)
    │   └── ImageBuildFailed                 a Dockerfile build failed: the step, and its log's end
    ├── Unauthenticated (PermissionError)    missing or wrong token
    ├── ImageNotFound (LookupError)          no image by that name
    ├── SnapshotNotFound (LookupError)       no snapshot by that id or name
    ├── SnapshotConflict                     a snapshot name taken, or a snapshot in use (409)
    ├── SandboxNotFound (LookupError)        no sandbox by that id (or it is gone)
    ├── SandboxStateError (RuntimeError)     the call does not fit the sandbox's state
    ├── SandboxLost (ConnectionError)        the node that held the sandbox is lost (died, unreachable)
    ├── SandboxFileNotFound (FileNotFoundError)
    ├── ProcessNotFound (LookupError)        no background process by that pid in the sandbox
    ├── SessionClosed (SandboxStateError)    the shell session ended (its shell died or was closed)
    ├── PortUnreachable (ConnectionError)    nothing answered on that port inside the sandbox (502)
    ├── DesktopUnavailable                   the sandbox has no desktop, or its X server is gone (409)
    ├── CommandTimeout (TimeoutError)        a command ran past its timeout and was killed
    ├── CapacityExceeded                     no node could admit the sandbox
    ├── QuotaExceeded                        the project's quota (or an ancestor's) is used up
    ├── Overloaded                           the node is busy: try again after ``retry_after`` s (429)
    ├── ProjectNotFound (LookupError)        no project by that name (or not visible to the token)
    ├── JobNotFound (LookupError)            no job log by that name (or it is another project's)
    ├── ReplayDiverged                       a resumed job's call differs from its log (409)
    │   └── ReplayIncomplete                 its log holds, at that place, a call it cannot answer (409)
    ├── BackendError                         the runtime (crun, mounts, …) failed
    │   └── StoreUnavailable                 the layer store cannot be read (its filesystem is away) (503)
    ├── ServerUnavailable (ConnectionError)  the SDK could not reach the server
    └── ServerError                          anything else the server reported

Errors cross the wire as ``{"error": {"code": CODE, "message": MSG}}`` (``Overloaded`` adds
``retry_after``, seconds) with the fixed list of
codes in ``ERROR_CODES``; each side maps them back with :func:`error_from_wire`.
"""

from __future__ import annotations


class DSecError(Exception):
    """Base of every DSec error. ``code`` is its wire code, ``status`` the HTTP status."""

    code = "internal"
    status = 500

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidRequest(DSecError, ValueError):
    """Malformed request or argument."""

    code = "invalid_request"
    status = 422


class LimitOutOfRange(InvalidRequest):
    """Memory / CPU / TTL / count outside what is allowed."""

    code = "limit_out_of_range"
    status = 422


class KeyReused(InvalidRequest):
    """A create's idempotency ``key`` was used before (in the project, or in the job) for a
    create with other arguments: the old sandbox is not returned."""

    code = "key_reused"
    status = 409


class ImageBuildFailed(InvalidRequest):
    """A Dockerfile cannot be built, or one of its steps failed: the message names the line
    and carries the end of the build's log."""

    code = "image_build_failed"
    status = 422


class Unauthenticated(DSecError, PermissionError):
    """Missing or wrong token."""

    code = "unauthenticated"
    status = 401


class ImageNotFound(DSecError, LookupError):
    """No image by that name."""

    code = "image_not_found"
    status = 404


class SnapshotNotFound(DSecError, LookupError):
    """No snapshot by that id or name (or it was removed)."""

    code = "snapshot_not_found"
    status = 404


class SnapshotConflict(DSecError):
    """A snapshot's name is taken already, or the snapshot cannot go while sandboxes started
    from it run: the message names the name or the sandboxes."""

    code = "snapshot_conflict"
    status = 409


class SandboxNotFound(DSecError, LookupError):
    """No sandbox by that id (or it is gone)."""

    code = "sandbox_not_found"
    status = 404


class SandboxStateError(DSecError, RuntimeError):
    """The call does not fit the sandbox's state."""

    code = "sandbox_state"
    status = 409


class SandboxLost(DSecError, ConnectionError):
    """The sandbox's node left the cluster or stopped answering: the call did not reach it.
    Not retried (the sandbox may come back with its node, or be gone for good)."""

    code = "sandbox_lost"
    status = 410


class SandboxFileNotFound(DSecError, FileNotFoundError):
    code = "file_not_found"
    status = 404


class ProcessNotFound(DSecError, LookupError):
    """No background process by that pid in the sandbox."""

    code = "process_not_found"
    status = 404


class SessionClosed(SandboxStateError):
    """The shell session ended (its shell died or was closed)."""

    code = "session_closed"
    status = 409


class PortUnreachable(DSecError, ConnectionError):
    """Nothing answered on that port inside the sandbox (502)."""

    code = "port_unreachable"
    status = 502


class DesktopUnavailable(DSecError):
    """The sandbox has no desktop (it was made without one), or its X server or desktop agent
    is gone (the message says which); the sandbox's other calls still work (409)."""

    code = "desktop_unavailable"
    status = 409


class CommandTimeout(DSecError, TimeoutError):
    """A command ran past its timeout and was killed."""

    code = "command_timeout"
    status = 408


class CapacityExceeded(DSecError):
    """No node could admit the sandbox."""

    code = "capacity_exceeded"
    status = 503


class QuotaExceeded(DSecError):
    """The project's quota (or an ancestor's) is used up."""

    code = "quota_exceeded"
    status = 429


class Overloaded(DSecError):
    """More creates or commands at once than the node takes, past its bounded queue: refused
    before any of the work began, so the same call may be sent again (the SDK does, with
    backoff) after ``retry_after`` seconds, also sent as the ``Retry-After`` header."""

    code = "overloaded"
    status = 429

    def __init__(self, message: str = "", retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = max(0.0, float(retry_after))

    def to_wire(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "retry_after": round(self.retry_after, 3)}}


class ProjectNotFound(DSecError, LookupError):
    """No project by that name (or not visible to the token)."""

    code = "project_not_found"
    status = 404


class JobNotFound(DSecError, LookupError):
    """No job log by that name (or it is another project's)."""

    code = "job_not_found"
    status = 404


class ReplayDiverged(DSecError):
    """A call of a resumed job (``DSecClient(job=…, resume=True)``) is not the one its log
    holds at that place: the message names both."""

    code = "replay_diverged"
    status = 409


class ReplayIncomplete(ReplayDiverged):
    """A resumed job cannot be fast-forwarded past this place: the call is of a kind a job log
    does not record with its result (a streamed command, a background process, a session, a
    PTY, a file-tree call, a snapshot) while the sandbox's log holds more, or the log's next
    entry on that sandbox is such a call (it was made, and may have changed the sandbox; running
    it again could do it twice)."""

    code = "replay_incomplete"


class BackendError(DSecError):
    """The runtime (crun, mounts, …) failed."""

    code = "backend_error"
    status = 500


class StoreUnavailable(BackendError):
    """The node cannot read its layer store (its filesystem unmounted, stopped or not
    answering): the message names the store and the node. Sandboxes of the node take calls
    again, and creates work, once the store answers again."""

    code = "store_unavailable"
    status = 503


class ServerUnavailable(DSecError, ConnectionError):
    """The SDK could not reach the server."""

    code = "server_unavailable"
    status = 503


class ServerError(DSecError):
    """Anything else the server reported."""

    code = "internal"
    status = 500


ERROR_CODES: dict[str, type[DSecError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        LimitOutOfRange,
        KeyReused,
        ImageBuildFailed,
        Unauthenticated,
        ImageNotFound,
        SnapshotNotFound,
        SnapshotConflict,
        SandboxNotFound,
        SandboxStateError,
        SandboxLost,
        SandboxFileNotFound,
        ProcessNotFound,
        SessionClosed,
        PortUnreachable,
        DesktopUnavailable,
        CommandTimeout,
        CapacityExceeded,
        QuotaExceeded,
        Overloaded,
        ProjectNotFound,
        JobNotFound,
        ReplayDiverged,
        ReplayIncomplete,
        BackendError,
        StoreUnavailable,
        ServerUnavailable,
        ServerError,
    )
}


def error_from_wire(body: object, status: int) -> DSecError:
    """Turn an error response body back into the matching exception."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        cls = ERROR_CODES.get(str(err.get("code")), ServerError)
        if cls is Overloaded:
            retry_after = err.get("retry_after")
            return Overloaded(str(err.get("message", "")),
                              retry_after if isinstance(retry_after, (int, float)) else 1.0)
        return cls(str(err.get("message", "")))
    return ServerError(f"HTTP {status}: {body!r}"[:500])
