"""The default isolation profile of a container sandbox: capabilities and seccomp.

Capabilities: everything dropped but what a shell task as root inside its own rootfs needs
(ownership, permission overrides, setuid for su/sudo-less user switches, kill, chroot, low ports).
No CAP_SYS_ADMIN, CAP_NET_RAW, CAP_NET_ADMIN, CAP_SYS_PTRACE, CAP_MKNOD, CAP_SYS_MODULE, …

Seccomp: allow by default, and deny (EPERM) the kernel surface a sandbox never needs: module
loading, kexec, bpf, perf, keyrings, mounts and the new mount API, namespace creation and
joining, ptrace and cross-process memory access, reboot, swap, clock setting, io_uring, and the
ioctls the report saw abused (XFS_IOC_SWAPEXT) or that inject terminal input (TIOCSTI).
clone3 answers ENOSYS so libc falls back to clone, whose namespace flags are filtered. No
signal can be sent to pid 1, the sandbox's init (catatonit ends on SIGTERM, and the sandbox with
it), nor a pidfd opened for it.
"""

from __future__ import annotations

import errno

CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
]

DENIED_SYSCALLS = [
    "acct", "add_key", "bpf", "delete_module", "finit_module", "fsconfig", "fsmount", "fsopen",
    "fspick", "init_module", "io_uring_enter", "io_uring_register", "io_uring_setup", "kcmp",
    "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr",
    "move_mount", "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree",
    "perf_event_open", "pivot_root", "process_madvise", "process_vm_readv", "process_vm_writev",
    "ptrace", "quotactl", "reboot", "request_key", "setns", "swapoff", "swapon", "syslog",
    "umount", "umount2", "unshare", "uselib", "userfaultfd", "vhangup", "clock_adjtime",
    "clock_settime", "settimeofday", "adjtimex", "iopl", "ioperm", "create_module",
    "get_kernel_syms", "query_module", "fanotify_init", "pidfd_getfd", "quotactl_fd",
]

CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}

DENIED_IOCTLS = {
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
}
# Extent-swapping ioctls, matched on type and number only (the low 16 bits), so a caller cannot
# slip past with another struct size or direction: XFS_IOC_SWAPEXT is _IOWR('X', 109, struct
# xfs_swapext) = 0xC0C0586D, EXT4_IOC_MOVE_EXT is _IOWR('f', 15, struct move_extent) = 0xC028660F
# (both checked by compiling against xfsprogs' and the kernel's headers: struct sizes 192 and 40).
DENIED_IOCTL_TYPE_NR = {
    "XFS_IOC_SWAPEXT": 0x586D,
    "EXT4_IOC_MOVE_EXT": 0x660F,
}

# Syscalls that name a target process, and the arguments that name it: none may name pid 1 (the
# kernel reads a pid as a 32-bit int, so only the low 32 bits are compared).
SIGNAL_SYSCALLS_PID_ARGS = {
    "kill": (0,), "tkill": (0,), "tgkill": (0, 1), "rt_sigqueueinfo": (0,), "rt_tgsigqueueinfo": (0, 1),
    "pidfd_open": (0,),
}

ARCHES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]


def seccomp_profile(also_allowed: tuple[str, ...] = ()) -> dict:
    """The OCI ``linux.seccomp`` section (``also_allowed``: denied syscalls to let through)."""
    rules: list[dict] = [
        {"names": [n for n in DENIED_SYSCALLS if n not in also_allowed], "action": "SCMP_ACT_ERRNO",
         "errnoRet": errno.EPERM},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    for flag in CLONE_NEW_FLAGS.values():
        rules.append({
            "names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    for name, indexes in SIGNAL_SYSCALLS_PID_ARGS.items():
        for index in indexes:
            rules.append({
                "names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                "args": [{"index": index, "value": 0xFFFFFFFF, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}],
            })
    # The kernel reads an ioctl's command as a 32-bit int: compare only those bits, or a caller
    # sets bit 32 and up and gets past an exact 64-bit match.
    masked = [(0xFFFFFFFF, v) for v in DENIED_IOCTLS.values()] + [(0xFFFF, v) for v in DENIED_IOCTL_TYPE_NR.values()]
    for mask, value in masked:
        rules.append({
            "names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
            "args": [{"index": 1, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}],
        })
    # FLAG_LOG: the kernel writes each refusal (an ERRNO action) to its log as an audit record,
    # which the edge turns into ``syscall.denied`` security events (dsec.isolation.events).
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHES, "syscalls": rules,
            "flags": ["SECCOMP_FILTER_FLAG_LOG"]}


MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags", "/proc/kmsg", "/proc/kallsyms",
    "/proc/sysrq-trigger", "/proc/vmallocinfo", "/proc/slabinfo", "/sys/firmware",
    "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf",
]

READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]
