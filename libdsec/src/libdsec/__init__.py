"""libdsec: the DSec SDK. ``DSecClient`` (async) and ``SyncDSecClient`` (its blocking twin)."""

from ._client import DSecClient, Sandbox, default_token
from ._process import Process, Session
from ._pty import Pty
from ._watch import DirWatch
from ._errors import (
    BackendError,
    CapacityExceeded,
    CommandTimeout,
    DesktopUnavailable,
    DSecError,
    ImageBuildFailed,
    ImageNotFound,
    InvalidRequest,
    JobNotFound,
    KeyReused,
    LimitOutOfRange,
    PortUnreachable,
    ProcessNotFound,
    ProjectNotFound,
    Overloaded,
    QuotaExceeded,
    ReplayDiverged,
    ReplayIncomplete,
    SandboxFileNotFound,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    ServerError,
    SessionClosed,
    ServerUnavailable,
    Unauthenticated,
)
from .protocol import SecurityEvent
from .protocol import ExecEvent, FileEntry, FsEvent, ProcessInfo
from .protocol import BuildResult, DSecContainerRunArgs, ExecResult, ImageInfo, PackDiffResult, PauseResult, SandboxInfo, SandboxStatus
from .protocol import DSecFullVMRunArgs, DSecMicroVMRunArgs, SnapshotInfo
from .protocol import DesktopInfo, DesktopSpec, DesktopWindow
from ._desktop import Desktop
from .protocol import DSecFnCallArgs, FnCallResult
from ._pausing import SandboxGroupResult, SandboxOutcome
from ._projects import ProjectInfo, ProjectQuota
from ._sync import SyncDSecClient, SyncDesktop, SyncProcess, SyncDirWatch, SyncPty, SyncSandbox, SyncSession

__all__ = [
    "BackendError",
    "BuildResult",
    "CapacityExceeded",
    "CommandTimeout",
    "DSecClient",
    "DSecContainerRunArgs",
    "DSecError",
    "DSecFnCallArgs",
    "DSecFullVMRunArgs",
    "DSecMicroVMRunArgs",
    "Desktop",
    "DesktopInfo",
    "DesktopSpec",
    "DesktopUnavailable",
    "DesktopWindow",
    "DirWatch",
    "ExecEvent",
    "ExecResult",
    "FileEntry",
    "FnCallResult",
    "FsEvent",
    "ImageBuildFailed",
    "ImageInfo",
    "ImageNotFound",
    "InvalidRequest",
    "JobNotFound",
    "KeyReused",
    "LimitOutOfRange",
    "Overloaded",
    "PackDiffResult",
    "PauseResult",
    "PortUnreachable",
    "Process",
    "ProcessInfo",
    "ProcessNotFound",
    "ProjectInfo",
    "ProjectNotFound",
    "ProjectQuota",
    "Pty",
    "QuotaExceeded",
    "ReplayDiverged",
    "ReplayIncomplete",
    "Sandbox",
    "SandboxFileNotFound",
    "SandboxGroupResult",
    "SandboxInfo",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxOutcome",
    "SandboxStateError",
    "SandboxStatus",
    "SecurityEvent",
    "ServerError",
    "ServerUnavailable",
    "Session",
    "SessionClosed",
    "SnapshotInfo",
    "SyncDSecClient",
    "SyncDesktop",
    "SyncDirWatch",
    "SyncProcess",
    "SyncPty",
    "SyncSandbox",
    "SyncSession",
    "Unauthenticated",
    "default_token",
]

__version__ = "0.1.0"
