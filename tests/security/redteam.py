"""Shared bits of the red-team suite: mirror ports and the probe scripts agents would write."""

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
