"""Desktops: ``Desktops``, the part of ``dsec.edge.edge.Edge`` that starts a sandbox's desktop
and drives it (screenshots, mouse, keyboard, windows, applications).

A sandbox made with ``desktop=DesktopSpec(...)`` gets, as its create's last step, the desktop
agent (``dsec/native/desktop_agent.py``, run by the image's python3 with python3-xlib): it starts
Xvfb and the session and keeps one X connection, and it listens on ``AGENT_PORT`` on the
sandbox's loopback. The node keeps one TCP connection to it (``connect_port``, into the
sandbox's network namespace), so a screenshot or a click is one request on an open connection
to a process that holds an open X connection: no command started per action. The create returns
once the agent answers (the X server up, the window manager managing); a desktop that does not
come up fails the create, and the sandbox is removed.

Every kind whose backend declares ``Capability.DESKTOP`` runs the same agent, Xvfb and session
from the same image: containers, and microVMs and full VMs, whose guest agent starts the agent
and carries ``connect_port`` to it. (Xvfb in guests too, not Xorg with the dummy driver: the image
has Xvfb, and neither gives a guest emulated by TCG a GPU; a screenshot is a GetImage either
way.) A VM's start is slower under TCG (``VM_START_TIMEOUT_S``), and its memory is the guest's
whole memory, so a desktop needs at least ``VM_DESKTOP_MIN_MEMORY_MB`` of it.

The live view (``desktop_stream``): x11vnc on the desktop's display and noVNC's page with its
WebSocket proxy (websockify, the image's ``/opt/noVNC/utils/novnc_proxy``) on ``STREAM_PORT``,
the ports and programs E2B Desktop's ``stream.start()`` uses, so either way of starting it finds
the other's running; the apiserver serves that port to a browser (``dsec.apiserver.streams``).

The connection is the edge's (an edge restarted under the sandbox connects again on the next
call). A call on a sandbox without a desktop, or whose X server or agent died, is
``DesktopUnavailable`` naming which; the sandbox's other calls go on working.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import struct
import time
from pathlib import Path

from libdsec import (DesktopUnavailable, DSecError, InvalidRequest, LimitOutOfRange, PortUnreachable,
                     SandboxStateError)
from libdsec.protocol import (
    DesktopAccessibilityTree,
    DesktopInfo,
    DesktopInput,
    DesktopLaunchRequest,
    DesktopWindow,
    DSecContainerRunArgs,
    ExecRequest,
    ProcessInfo,
    SandboxKind,
    StartProcessRequest,
)

from ..backends.base import Capability
from .lifecycle import Action, Record
from .table import SandboxTable

log = logging.getLogger("dsec.edge")

AGENT_PORT = 49990  # the desktop agent's, on the sandbox's loopback
DISPLAY = ":0"
AGENT_SOURCE = (Path(__file__).resolve().parent.parent / "native" / "desktop_agent.py").read_text()
START_TIMEOUT_S = 30.0
# A VM's desktop starts in a guest that may be emulated (TCG: Xvfb and xfce4 take about 20 s on
# this 2-core machine where a container's take 1), and its memory is the guest's whole memory
# (kernel, page cache, a microVM's writable layer): a desktop needs this much of it (xfce4 and
# the agent use about 95 MB of a 512 MB microVM right after the start; applications more).
VM_START_TIMEOUT_S = 180.0
VM_DESKTOP_MIN_MEMORY_MB = 384
_VM_KINDS = (SandboxKind.microvm, SandboxKind.fullvm)
AGENT_MMAP_THRESHOLD = 262144
# The live view: x11vnc's port and noVNC's (page and WebSocket), as E2B Desktop's stream has them.
VNC_PORT = 5900
STREAM_PORT = 6080
_VNC = (f"pgrep -x x11vnc >/dev/null || x11vnc -bg -display {DISPLAY} -forever -wait 50 -shared -localhost "
        f"-rfbport {VNC_PORT} -nopw -o /tmp/.dsec-x11vnc.log >/dev/null 2>&1; pgrep -x x11vnc >/dev/null || "
        f"{{ echo 'x11vnc did not start:'; tail -c 600 /tmp/.dsec-x11vnc.log; exit 1; }}")
_NOVNC = (f"exec /opt/noVNC/utils/novnc_proxy --vnc localhost:{VNC_PORT} --listen {STREAM_PORT} --web /opt/noVNC "
          f">/tmp/.dsec-novnc.log 2>&1")
# What the image must have: checked before the agent starts, for an error that names it.
_NEEDS = ('command -v Xvfb >/dev/null || { echo "no Xvfb"; exit 1; }; '
          'python3 -c "import Xlib" 2>/dev/null || { echo "no python3 with python3-xlib"; exit 1; }')
_SESSION_NEEDS = {"xfce4": "xfce4-session", "wm": "xfwm4", "none": None}


# A file opened with the application its type's default names (its desktop entry, through
# gtk-launch: xfce4's exo-open fails on files here), a URL or anything else with xdg-open.
_OPEN = r'''t=TARGET
case "$t" in *://*) exec xdg-open "$t";; esac
m=$(python3 -c 'import mimetypes, sys; print(mimetypes.guess_type(sys.argv[1])[0] or "")' "$t")
a=$(xdg-mime query default "${m:-application/octet-stream}" 2>/dev/null)
[ -n "$a" ] && exec gtk-launch "${a%.desktop}" "$t"
exec xdg-open "$t"
'''


# What is left of a dead desktop, killed before it starts again (the agent by its source's first
# line, which its command line holds; the bracket keeps this command itself out of the match; the
# AT-SPI bus launcher by its process name, cut at 15 characters, as the agent starts one again).
_KILL_DESKTOP = ("pkill -KILL -f 'The desktop [a]gent: run inside' ; pkill -KILL -x Xvfb ; "
                 "pkill -KILL -x at-spi-bus-laun ; true")


class _Agent:
    """One open connection to a sandbox's desktop agent; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.lock = asyncio.Lock()

    async def call(self, request: dict) -> tuple[dict, bytes]:
        body = json.dumps(request).encode()
        async with self.lock:
            self.writer.write(struct.pack(">I", len(body)) + body)
            await self.writer.drain()
            size = struct.unpack(">I", await self.reader.readexactly(4))[0]
            header = json.loads(await self.reader.readexactly(size))
            payload = await self.reader.readexactly(header["size"]) if header.get("size") else b""
        return header, payload

    def close(self) -> None:
        self.writer.close()


class Desktops(SandboxTable):
    """Desktops in sandboxes (see the module)."""

    # Made by Edge.__init__: sandbox id -> the open connection to its desktop agent, and the
    # restarts under way of desktops found dead.
    _desktops: dict[str, _Agent]
    _desktop_restarts: dict[str, asyncio.Task]
    _desktop_connects: dict[str, asyncio.Lock]

    def _check_desktop(self, args: DSecContainerRunArgs, kind: SandboxKind) -> None:
        """A create asking for a desktop of a kind this node cannot give one (before anything is made)."""
        if getattr(args, "desktop", None) is None:
            return
        if Capability.DESKTOP not in self._backend(kind).capabilities:
            can = [k for k, b in self.backends.items() if Capability.DESKTOP in b.capabilities]
            raise InvalidRequest(f"a {kind.value} sandbox on node {self.node} cannot have a desktop "
                                 f"(desktops here: {', '.join(k.value for k in can) or 'none'})")
        if kind in _VM_KINDS and args.memory_limit_mb < VM_DESKTOP_MIN_MEMORY_MB:
            raise LimitOutOfRange(f"memory_limit_mb={args.memory_limit_mb} is too small for a {kind.value} with a "
                                  f"desktop: at least {VM_DESKTOP_MIN_MEMORY_MB} MB (the guest's whole memory)")

    def _start_timeout(self, rec: Record) -> float:
        return VM_START_TIMEOUT_S if rec.kind in _VM_KINDS else START_TIMEOUT_S

    async def _start_desktop(self, rec: Record) -> None:
        """Start the desktop of a new sandbox and wait until its agent answers."""
        spec = rec.args.desktop
        needs = _NEEDS
        if program := _SESSION_NEEDS[spec.session]:
            needs += f'; command -v {program} >/dev/null || {{ echo "no {program} (session {spec.session})"; exit 1; }}'
        checked = await self.exec(rec.id, ExecRequest(command=needs, timeout=30.0))
        if checked.exit_code != 0:
            raise InvalidRequest(f"image {rec.image.name!r} cannot run a desktop: {checked.stdout.strip()} "
                                 f"(the `desktop` image can: dsec image build desktop)")
        # A screenshot's buffers (megabytes) mapped and given back when freed: with glibc's sliding
        # threshold they stay in the agent's heap after the first one (8 MiB in every idle desktop).
        command = (f'MALLOC_MMAP_THRESHOLD_={AGENT_MMAP_THRESHOLD} exec python3 -c "$DESKTOP_AGENT_PY" '
                   f'{spec.width} {spec.height} {spec.dpi} {AGENT_PORT} {DISPLAY} {shlex.quote(spec.session)}')
        process = await self.start_process(rec.id, StartProcessRequest(
            command=command, env={"DESKTOP_AGENT_PY": AGENT_SOURCE, "DISPLAY": DISPLAY}))
        deadline = time.monotonic() + self._start_timeout(rec)
        while True:
            try:
                agent = await self._connect_agent(rec)
                await agent.call({"op": "info"})
                break
            except (PortUnreachable, ConnectionError, asyncio.IncompleteReadError):
                pass
            info = await self.get_process(rec.id, process.pid)
            if not info.running or time.monotonic() > deadline:
                tail = await self.exec(rec.id, ExecRequest(
                    command=f"tail -c 800 /tmp/.dsec-proc/{process.pid}/err; tail -c 400 /tmp/.dsec-xvfb.log",
                    timeout=10.0))
                why = f"its agent exited ({info.exit_code})" if not info.running else \
                    f"not answering after {self._start_timeout(rec):.0f} s"
                raise DesktopUnavailable(f"the desktop of sandbox {rec.id} did not start: {why}: "
                                         f"{tail.stdout.strip()[-1000:]}")
            await asyncio.sleep(0.02)
        self._desktops[rec.id] = agent
        self._sweep_desktops()

    def _sweep_desktops(self) -> None:
        for sandbox_id in [s for s in self._desktops if s not in self._records]:
            self._desktops.pop(sandbox_id).close()
        for sandbox_id in [s for s in self._desktop_connects if s not in self._records]:
            del self._desktop_connects[sandbox_id]

    def _restart_desktop(self, rec: Record) -> None:
        """Start again, in the background, a desktop found dead (its X server or agent gone):
        what is left of it killed first; one restart at a time per sandbox."""
        if rec.id in self._desktop_restarts or rec.id not in self._records:
            return

        async def restart() -> None:
            try:
                await self.exec(rec.id, ExecRequest(command=_KILL_DESKTOP, user="root", timeout=10.0))
                await self._start_desktop(rec)
            except (DSecError, OSError) as exc:
                log.warning("could not start the desktop of sandbox %s again: %s", rec.id, exc)
            finally:
                self._desktop_restarts.pop(rec.id, None)

        self._desktop_restarts[rec.id] = asyncio.get_running_loop().create_task(restart())

    async def desktop_stream(self, sandbox_id: str) -> None:
        """Start the live view if it is not running (x11vnc again if the X server was restarted
        under it) and return once noVNC answers on ``STREAM_PORT``."""
        rec = await self._ready(sandbox_id, Action.exec)
        if getattr(rec.args, "desktop", None) is None:
            raise DesktopUnavailable(f"sandbox {sandbox_id} has no desktop: create it with desktop=DesktopSpec(...)")
        vnc = await self.exec(sandbox_id, ExecRequest(command=_VNC, env={"DISPLAY": DISPLAY}, timeout=30.0))
        if vnc.exit_code != 0:
            raise DesktopUnavailable(f"the live view of sandbox {sandbox_id}'s desktop did not start: "
                                     f"{(vnc.stdout + vnc.stderr).strip()[-800:]}")
        if await self._stream_answers(rec):
            return
        process = await self.start_process(sandbox_id, StartProcessRequest(command=_NOVNC))
        deadline = time.monotonic() + self._start_timeout(rec)
        while not await self._stream_answers(rec):
            info = await self.get_process(sandbox_id, process.pid)
            if not info.running and await self._stream_answers(rec):
                return  # (another call's noVNC took the port first)
            if not info.running or time.monotonic() > deadline:
                tail = await self.exec(sandbox_id, ExecRequest(command="tail -c 800 /tmp/.dsec-novnc.log", timeout=10.0))
                raise DesktopUnavailable(f"the live view of sandbox {sandbox_id}'s desktop did not start: noVNC "
                                         f"{'exited' if not info.running else 'is not answering'}: "
                                         f"{tail.stdout.strip()}")
            await asyncio.sleep(0.05)

    async def _stream_answers(self, rec: Record) -> bool:
        try:
            _, writer = await self.backends[rec.kind].connect_port(rec.handle, STREAM_PORT)
        except (PortUnreachable, OSError):
            return False
        writer.close()
        return True

    def close_desktops(self) -> None:
        for task in self._desktop_restarts.values():
            task.cancel()
        for agent in self._desktops.values():
            agent.close()
        self._desktops.clear()

    async def _reconnect_agent(self, rec: Record) -> _Agent:
        """The connection to a desktop agent this edge holds none of, made by one call while the
        others wait for it: the agent serves one connection at a time."""
        async with self._desktop_connects.setdefault(rec.id, asyncio.Lock()):
            agent = self._desktops.get(rec.id)
            if agent is None:
                agent = self._desktops[rec.id] = await self._connect_agent(rec)
            return agent

    async def _connect_agent(self, rec: Record) -> _Agent:
        reader, writer = await self.backends[rec.kind].connect_port(rec.handle, AGENT_PORT)
        return _Agent(reader, writer)

    async def _desktop_call(self, sandbox_id: str, request: dict) -> tuple[Record, dict, bytes]:
        rec = await self._ready(sandbox_id, Action.exec)
        if getattr(rec.args, "desktop", None) is None:
            raise DesktopUnavailable(f"sandbox {sandbox_id} has no desktop: create it with "
                                     f"desktop=DesktopSpec(...)")
        return rec, *await self._call(rec, self._agent_call(rec, request))

    async def _agent_call(self, rec: Record, request: dict) -> tuple[dict, bytes]:
        agent = self._desktops.get(rec.id)
        if agent is None and rec.id in self._desktop_restarts:
            # (the restart makes the connection: the agent serves one at a time, so one made
            # here beside it would wait for ever, or leave the restart waiting for ever)
            raise DesktopUnavailable(f"the desktop of sandbox {rec.id} is being started again; the sandbox's "
                                     f"other calls still work")
        try:
            if agent is None:  # an edge restarted under the sandbox: connect again, once
                agent = await self._reconnect_agent(rec)
            header, payload = await agent.call(request)
        except (PortUnreachable, ConnectionError, asyncio.IncompleteReadError) as exc:
            if self._desktops.get(rec.id) is agent and agent is not None:
                self._desktops.pop(rec.id).close()
            self._restart_desktop(rec)
            raise DesktopUnavailable(f"the desktop of sandbox {rec.id} is gone: its desktop agent does not answer "
                                     f"({type(exc).__name__}); it is being started again, and the sandbox's other "
                                     f"calls still work") from None
        except SandboxStateError:
            raise
        except DSecError as exc:
            raise DesktopUnavailable(f"the desktop of sandbox {rec.id} cannot be reached: {exc}") from None
        if not header["ok"]:
            if header["error"] == "invalid":
                raise InvalidRequest(header["message"])
            if header["error"] == "a11y_down":
                raise DesktopUnavailable(f"the accessibility (AT-SPI) bus of sandbox {rec.id}'s desktop is down: "
                                         f"{header['message']}; the desktop's other calls still work")
            self._desktops.pop(rec.id, None)
            agent.close()
            self._restart_desktop(rec)
            raise DesktopUnavailable(f"the X server of sandbox {rec.id}'s desktop died ({header['message']}); it is "
                                     f"being started again, and the sandbox's other calls still work")
        return header, payload

    # -- the calls ------------------------------------------------------------------------------

    async def desktop_screenshot(self, sandbox_id: str, format: str = "png") -> bytes:
        if format not in ("png", "raw"):
            raise InvalidRequest(f"screenshot format {format!r}: png or raw (BGRX pixels, 4 bytes each)")
        _, _, payload = await self._desktop_call(sandbox_id, {"op": "screenshot", "format": format})
        return payload

    def _info(self, rec: Record, header: dict) -> DesktopInfo:
        spec = rec.args.desktop
        return DesktopInfo(width=spec.width, height=spec.height, dpi=spec.dpi, display=DISPLAY,
                           cursor_x=header["x"], cursor_y=header["y"])

    async def desktop_info(self, sandbox_id: str) -> DesktopInfo:
        rec, header, _ = await self._desktop_call(sandbox_id, {"op": "info"})
        return self._info(rec, header)

    async def desktop_input(self, sandbox_id: str, request: DesktopInput) -> DesktopInfo:
        fields = request.model_dump(exclude_none=True)
        action = fields.pop("action")
        need = {"move": ("x", "y"), "drag": ("x", "y", "to_x", "to_y"), "type": ("text",), "press": ("keys",)}
        missing = [f for f in need.get(action, ()) if f not in fields]
        if missing:
            raise InvalidRequest(f"desktop action {action!r} needs {', '.join(missing)}")
        if ("x" in fields) != ("y" in fields):
            raise InvalidRequest(f"desktop action {action!r}: give both x and y, or neither")
        rec, header, _ = await self._desktop_call(sandbox_id, {"op": action, **fields})
        return self._info(rec, header)

    async def desktop_windows(self, sandbox_id: str) -> list[DesktopWindow]:
        _, header, _ = await self._desktop_call(sandbox_id, {"op": "windows"})
        return [DesktopWindow.model_validate(w) for w in header["windows"]]

    async def desktop_accessibility_tree(self, sandbox_id: str, max_chars: int = 100_000) -> DesktopAccessibilityTree:
        _, header, payload = await self._desktop_call(sandbox_id, {"op": "accessibility_tree", "max_chars": max_chars})
        return DesktopAccessibilityTree(tree=payload.decode("utf-8", "replace"), count=header["count"],
                                        truncated=header["truncated"])

    async def desktop_focus(self, sandbox_id: str, window: int) -> None:
        await self._desktop_call(sandbox_id, {"op": "focus", "window": window})

    async def desktop_launch(self, sandbox_id: str, request: DesktopLaunchRequest) -> ProcessInfo:
        if (request.app is None) == (request.open is None):
            raise InvalidRequest("launch needs one of app (a desktop entry's name) and open (a file or URL)")
        rec = await self._ready(sandbox_id, Action.exec)
        if getattr(rec.args, "desktop", None) is None:
            raise DesktopUnavailable(f"sandbox {sandbox_id} has no desktop: create it with desktop=DesktopSpec(...)")
        if request.app is not None:
            command = f"exec gtk-launch {shlex.quote(request.app)}" + (
                f" {shlex.quote(request.uri)}" if request.uri else "")
        else:
            command = _OPEN.replace("TARGET", shlex.quote(request.open))
        env = {"DISPLAY": DISPLAY, **({"XDG_CURRENT_DESKTOP": "XFCE"} if rec.args.desktop.session == "xfce4" else {})}
        return await self.start_process(sandbox_id, StartProcessRequest(command=command, env=env))
