"""``dsec-jail`` (``native/jail.c``) built for the host, and the seccomp profile as a BPF program for it.

The jail confines a command and execs it (Landlock filesystem rules and scopes, a pid namespace,
the capability set, no_new_privs, a seccomp program; see the source's header). It is a static
binary, so the same file runs on the host and inside a VM's guest; ``jail_binary`` builds it
(see ``dsec.native``).

``seccomp_bpf`` compiles ``profile.seccomp_profile()`` (the OCI section crun loads for
containers) into the classic BPF program that seccomp(2) takes, with libseccomp, the library crun
itself uses for it: the guest has no crun, so the host compiles the program and the guest's jail
loads it as is. A VM guest's profile lets ``syslog`` through: the kernel log a command reads
there (``dmesg``) is the guest's own, not the host's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from pathlib import Path

from libdsec import BackendError

from .. import native
from .profile import CAPABILITIES, seccomp_profile


# linux/capability.h
CAPABILITY_NUMBERS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
    "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_LINUX_IMMUTABLE": 9,
    "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11, "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13,
    "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17,
    "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23, "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25,
    "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27, "CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29,
    "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31, "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35, "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37,
    "CAP_PERFMON": 38, "CAP_BPF": 39, "CAP_CHECKPOINT_RESTORE": 40,
}


GUEST_ALSO_ALLOWED = ("syslog",)


def caps_argument(names: list[str] = CAPABILITIES) -> str:
    """``--caps``'s value for a list of capability names."""
    return ",".join(str(CAPABILITY_NUMBERS[n]) for n in names)


def source_digest() -> str:
    return native.digest("jail")


def jail_binary(cache_dir: Path) -> Path:
    """The static ``dsec-jail`` for the current source, compiled into ``cache_dir`` if needed."""
    return native.binary("jail", cache_dir)


# -- seccomp profile → BPF, with libseccomp -------------------------------------------------------

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_SCMP_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
             "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_ARCH_NAMES = {"SCMP_ARCH_X86_64": b"x86_64", "SCMP_ARCH_X86": b"x86", "SCMP_ARCH_X32": b"x32"}


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise BackendError(f"libseccomp not found ({exc}): install libseccomp2") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_exist.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def seccomp_bpf(profile: dict | None = None) -> bytes:
    """The classic BPF program for an OCI seccomp section (default: the sandbox profile)."""
    profile = profile or seccomp_profile()
    if profile["defaultAction"] != "SCMP_ACT_ALLOW":
        raise ValueError("only allow-by-default profiles are compiled here")
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise BackendError("seccomp_init failed")
    try:
        for arch in profile["architectures"]:
            token = lib.seccomp_arch_resolve_name(_ARCH_NAMES[arch])
            if lib.seccomp_arch_exist(ctx, token) != 0:
                rc = lib.seccomp_arch_add(ctx, token)
                if rc < 0:
                    raise BackendError(f"seccomp_arch_add({arch}): {os.strerror(-rc)}")
        for rule in profile["syscalls"]:
            if rule["action"] != "SCMP_ACT_ERRNO":
                raise ValueError(f"action {rule['action']} is not compiled here")
            action = _SCMP_ACT_ERRNO | (rule["errnoRet"] & 0xFFFF)
            args = rule.get("args", [])
            cmps = (_ArgCmp * max(1, len(args)))(*[
                _ArgCmp(a["index"], _SCMP_OPS[a["op"]], a["value"], a.get("valueTwo", 0)) for a in args])
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr < 0:
                    continue  # not a syscall of these architectures (as crun skips it)
                rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), cmps)
                if rc < 0:
                    raise BackendError(f"seccomp rule for {name}: {os.strerror(-rc)}")
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc < 0:
                raise BackendError(f"seccomp_export_bpf: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)
