"""Shared bits of the red-team suite: mirror ports, the probe scripts agents would write, and
reading a sandbox's security events."""

import asyncio

MIRROR_PORT = 8080  # what the allowlist opens
OTHER_PORT = 9090  # also served by the mirror, never allowed

FETCH = ("import sys, urllib.request\n"
         "try:\n"
         "    print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())\n"
         "except Exception as exc:\n"
         "    print('FAILED', type(exc).__name__, exc); sys.exit(3)\n")

CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]) if len(sys.argv) > 3 else 2).close(); print('CONNECTED')\n"
           "except Exception as exc:\n"
           "    print('FAILED', type(exc).__name__, exc); sys.exit(3)\n")


async def event_kinds(sandbox) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in await sandbox.security_events():
        out.setdefault(e.kind, []).append(e.detail)
    return out


async def denied_syscalls(sandbox, *names: str) -> list[str]:
    """The sandbox's syscall.denied events, once every one of ``names`` is among them."""
    denied: list[str] = []
    for _ in range(40):
        denied = (await event_kinds(sandbox)).get("syscall.denied", [])
        if all(any(d.startswith(n + " ") for d in denied) for n in names):
            return denied
        await asyncio.sleep(0.05)
    raise AssertionError(f"no syscall.denied event for {names}: {denied}")
