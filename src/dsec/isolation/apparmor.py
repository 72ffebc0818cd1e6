"""AppArmor for container sandboxes, where the host has it (Debian and Ubuntu turn it on).

``dsec serve`` loads one profile, ``dsec-sandbox`` (``profile_text``), with ``apparmor_parser``
at start (``ensure_loaded``), and names it in every container's OCI config
(``process.apparmorProfile``): crun puts the sandbox's init under it as it execs it, and every
process inside inherits it. AppArmor applies to root as to any other uid, also inside the
sandbox's user namespace, so these rules hold whatever the capabilities allow:

- no mount, remount, bind, move or pivot_root (seccomp refuses the syscalls too: this holds if a
  new syscall or a profile change lets one through);
- nothing written under ``/proc`` but a process's own files (``/proc/sys``, ``sysrq-trigger``,
  the kernel's knobs), nothing written under ``/sys``;
- nothing read from what the red-team saw crash a kernel or leak (``/proc/kpage*``, ``kcore``,
  ``kmsg``, ``/sys/kernel/{security,debug,tracing}``, ``/sys/firmware``, ``/sys/fs/bpf``), even
  where the mask over it were lifted;
- the platform's init (``/dev/.dsec-init``) cannot be written, linked or replaced;
- ptrace and signals only within the profile (no process outside the sandboxes, or unconfined,
  can be traced or signalled from inside; the edge, unconfined, signals in).

Everything else (files of its own root, its network, unix sockets) is left to the other layers.

Every deny rule is an ``audit deny`` (AppArmor does not log plain deny rules): a refusal is an audit record (``type=1400 … apparmor="DENIED" … profile="dsec-sandbox"``);
``parse_denial`` reads one, and the edge turns it into a security event ``apparmor.denied``
against the sandbox that holds the process (``dsec.edge.security``).

``status()`` says what a host has, for ``dsec info``: ``enforce`` once the profile is loaded and
enforcing, else ``unsupported: <why>`` (no AppArmor in the kernel, not enabled, no parser).
A host whose AppArmor runs in complain mode (``/sys/module/apparmor/parameters/mode``), or where
the loaded profile came out in complain mode, refuses to start: denials would only be logged.
``DSEC_APPARMOR=0`` turns the profile off (``dsec info`` then says so).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import settings

PROFILE_NAME = "dsec-sandbox"
SECURITYFS = Path("/sys/kernel/security")
_PARAMETERS = Path("/sys/module/apparmor/parameters")
_INIT_PATH = "/dev/.dsec-init"

# Files under /proc and /sys that nothing inside reads (the masks hide them already).
_NEVER_READ = (
    "@{PROC}/kcore", "@{PROC}/kmsg", "@{PROC}/kpagecgroup", "@{PROC}/kpagecount", "@{PROC}/kpageflags",
    "@{PROC}/kpageidle", "@{PROC}/sysrq-trigger", "@{PROC}/kallsyms", "@{PROC}/timer_list",
    "@{PROC}/sched_debug", "@{PROC}/keys", "@{PROC}/key-users",
    "/sys/firmware/**", "/sys/kernel/security/**", "/sys/kernel/debug/**", "/sys/kernel/tracing/**",
    "/sys/fs/bpf/**",
)

_loaded: str | None = None
_status = "unknown"


class AppArmorError(RuntimeError):
    """The host's AppArmor cannot hold the sandboxes (complain mode, a profile that will not load)."""


def profile_text(name: str = PROFILE_NAME) -> str:
    """The profile as ``apparmor_parser`` reads it (self-contained: no includes, so it loads
    the same with any ``/etc/apparmor.d``)."""
    never_read = "".join(f"  audit deny {path} rwklx,\n" for path in _NEVER_READ)
    return f"""\
# Written by DSec (dsec.isolation.apparmor): the profile of every container sandbox.
@{{PROC}}=/proc/

profile {name} flags=(attach_disconnected,mediate_deleted) {{
  # What the sandbox's own capabilities, seccomp and namespaces allow, as without the profile …
  file,
  network,
  capability,
  unix,
  umount,
  signal (send, receive) peer={name},
  signal (receive) peer=unconfined,
  ptrace (trace, read, tracedby, readby) peer={name},

  # … but no mount of any kind, whatever a capability or a seccomp gap would let through.
  audit deny mount,
  audit deny remount,
  audit deny pivot_root,

  # The kernel's knobs and files: no writes under /proc but a process's own, none under /sys.
  audit deny @{{PROC}}/* w,
  audit deny @{{PROC}}/{{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9/]*}}/** w,
  audit deny @{{PROC}}/sys/** w,
  audit deny @{{PROC}}/sysrq-trigger rwklx,
  audit deny /sys/** wkl,
{never_read}
  # The platform's init: run, never replaced.
  audit deny {_INIT_PATH} wkl,
}}
"""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def kernel_support() -> str | None:
    """None if the kernel has AppArmor enabled, else why not."""
    if _read(_PARAMETERS / "enabled") != "Y":
        return "the kernel has no AppArmor, or it is not enabled (apparmor=1 security=apparmor)"
    lsm = _read(SECURITYFS / "lsm")
    if lsm is not None and "apparmor" not in lsm.split(","):
        return f"AppArmor is not among the kernel's active security modules ({lsm})"
    if not (SECURITYFS / "apparmor").is_dir():
        return f"securityfs is not mounted at {SECURITYFS}"
    return None


def _profile_mode(name: str) -> str | None:
    """``enforce``/``complain``/… of a loaded profile, None if it is not loaded."""
    text = _read(SECURITYFS / "apparmor" / "profiles") or ""
    for line in text.splitlines():
        m = re.fullmatch(r"(.+) \((\w+)\)", line.strip())
        if m and m.group(1) == name:
            return m.group(2)
    return None


def ensure_loaded() -> str:
    """Load (or replace) the profile where the host has AppArmor; returns the line for the log.
    Raises ``AppArmorError`` on a host whose AppArmor would only log (complain mode), or when
    the profile does not load."""
    global _loaded, _status
    _loaded = None
    if not settings.current().apparmor:
        _status = "unsupported: turned off (DSEC_APPARMOR=0)"
        return f"AppArmor: {_status}"
    why = kernel_support()
    if why is None and shutil.which("apparmor_parser") is None:
        why = "apparmor_parser not found (install the apparmor package)"
    if why is not None:
        _status = f"unsupported: {why}"
        return f"AppArmor: {_status}; container sandboxes run without a profile"
    mode = _read(_PARAMETERS / "mode")
    if mode is not None and mode != "enforce":
        raise AppArmorError(
            f"AppArmor runs in {mode} mode on this host (/sys/module/apparmor/parameters/mode): the "
            f"{PROFILE_NAME} profile would only log what it should refuse. Boot with apparmor mode "
            "enforce (or `echo enforce > /sys/module/apparmor/parameters/mode`), or set DSEC_APPARMOR=0 "
            "to run the sandboxes without AppArmor")
    proc = subprocess.run(["apparmor_parser", "--replace", "--skip-cache"], input=profile_text(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AppArmorError(f"apparmor_parser could not load the {PROFILE_NAME} profile: "
                            f"{(proc.stdout + proc.stderr).strip()[-600:]}")
    loaded_mode = _profile_mode(PROFILE_NAME)
    if loaded_mode != "enforce":
        raise AppArmorError(
            f"the {PROFILE_NAME} profile loaded in {loaded_mode or 'no'} mode, not enforce (is the host's "
            "AppArmor set to complain, e.g. by aa-complain or a policy of its own?): sandboxes would only "
            "be logged; set it to enforce, or DSEC_APPARMOR=0 to run without AppArmor")
    _loaded, _status = PROFILE_NAME, "enforce"
    return f"AppArmor: profile {PROFILE_NAME} loaded (enforce)"


def loaded_profile() -> str | None:
    """The profile to name in each container's config, once ``ensure_loaded`` loaded it."""
    return _loaded


def status() -> str:
    """For ``dsec info``: ``enforce`` or ``unsupported: <why>`` (``unknown`` before the check)."""
    if _status == "unknown":
        why = kernel_support()
        return "unknown" if why is None else f"unsupported: {why}"
    return _status


@dataclass(frozen=True)
class Denial:
    operation: str
    name: str
    requested: str
    pid: int
    comm: str
    fsuid: int | None


_FIELD = re.compile(r'(\w+)=("([^"]*)"|\S+)')


def parse_denial(line: str, profile: str = PROFILE_NAME) -> Denial | None:
    """An AppArmor refusal of ``profile`` in one audit record (netlink or kernel log), or None."""
    if 'apparmor="DENIED"' not in line:
        return None
    fields = {m.group(1): m.group(3) if m.group(3) is not None else m.group(2) for m in _FIELD.finditer(line)}
    if fields.get("profile") != profile:
        return None
    try:
        pid = int(fields.get("pid", "0"))
    except ValueError:
        pid = 0
    fsuid = fields.get("fsuid")
    return Denial(
        operation=fields.get("operation", "?"),
        name=fields.get("name", fields.get("peer", "")),
        requested=fields.get("requested_mask", fields.get("flags", "")),
        pid=pid,
        comm=fields.get("comm", "?"),
        fsuid=int(fsuid) if fsuid is not None and fsuid.isdigit() else None,
    )


def describe(denial: Denial) -> str:
    """The event's detail: what was refused to whom."""
    what = f"{denial.operation} {denial.name}".strip()
    mask = f" ({denial.requested})" if denial.requested else ""
    return f"{what}{mask} denied to {denial.comm!r}"[:300]
