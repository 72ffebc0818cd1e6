"""E2B Desktop, unmodified (the ``e2b-desktop`` package, pinned in the ``test`` extra), against one
``dsec serve``: ``Sandbox.create()`` of its default template ``desktop`` (DSec's ``desktop``
image) starts Xvfb and xfce4 itself through envd, then its screenshot, pointer, keyboard and
window calls, each an ``xdotool`` / ``scrot`` / ``xrandr`` command it runs through envd."""

from __future__ import annotations

import socket
import struct
import time

import httpx
import pytest

pytest.importorskip("e2b_desktop")

from e2b import CommandExitException  # noqa: E402
from e2b_desktop import Sandbox  # noqa: E402
from websockets.sync.client import connect  # noqa: E402


pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def e2b(e2b_settings, desktop_image):
    """The e2b SDK pointed at the server, the desktop image in its store."""
    return e2b_settings


def _until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {check}")
        time.sleep(0.2)
    return found


def _windows(desktop: Sandbox, app: str) -> list[str]:
    try:
        return desktop.get_application_windows(app)
    except CommandExitException:  # (xdotool search finds none: exit 1)
        return []


def test_e2b_desktop_drives_a_dsec_desktop(e2b, server, monkeypatch):
    port = server.endpoint.rsplit(":", 1)[1]
    monkeypatch.setenv("E2B_DOMAIN", f"localhost:{port}")  # get_host: PORT-ID.localhost:PORT
    desktop = Sandbox.create()  # its default template: "desktop"
    try:
        assert desktop.get_screen_size() == (1024, 768)
        png = desktop.screenshot()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1024, 768)

        desktop.move_mouse(120, 240)
        assert desktop.get_cursor_position() == (120, 240)
        desktop.left_click(500, 400)
        assert desktop.get_cursor_position() == (500, 400)
        desktop.double_click()
        desktop.right_click()
        desktop.press("escape")
        desktop.scroll("down", 2)
        desktop.drag((200, 200), (260, 240))
        assert desktop.get_cursor_position() == (260, 240)

        # An editor, typed into with write and saved with press: the text in the file.
        desktop.files.write("/home/user/note.txt", "")
        desktop.commands.run("mousepad /home/user/note.txt", background=True)
        [editor] = _until(lambda: _windows(desktop, "mousepad"))
        assert "note.txt" in desktop.get_window_title(editor)
        desktop.commands.run(f"xdotool windowactivate --sync {editor}")
        desktop.write("typed by e2b_desktop", chunk_size=10, delay_in_ms=5)
        desktop.press(["ctrl", "s"])
        _until(lambda: desktop.files.read("/home/user/note.txt") == "typed by e2b_desktop")
        assert desktop.get_current_window_id() == editor

        # The stream: x11vnc and noVNC in the sandbox, its page and its VNC WebSocket reached
        # through the host name get_url gives (DSec's port proxy; a token is needed there).
        desktop.stream.start(require_auth=True)
        url = desktop.stream.get_url(auth_key=desktop.stream.get_auth_key())
        assert url.startswith(f"https://6080-{desktop.sandbox_id}.localhost:{port}/vnc.html?") and "password=" in url
        host = f"6080-{desktop.sandbox_id}.localhost:{port}"
        path = url.split(host, 1)[1]
        token = {"e2b-traffic-access-token": e2b["E2B_API_KEY"]}
        page = httpx.get(f"{server.endpoint}{path}", headers={"host": host, **token}, timeout=30)
        assert page.status_code == 200 and "noVNC" in page.text
        assert httpx.get(f"{server.endpoint}{path}", headers={"host": host}, timeout=30).status_code == 401
        with connect(f"ws://{host}/websockify", sock=socket.create_connection(("127.0.0.1", int(port))),
                     additional_headers=token, subprotocols=["binary"], open_timeout=30) as ws:
            assert ws.recv(timeout=30)[:4] == b"RFB "  # the VNC server's greeting
        desktop.stream.stop()
    finally:
        desktop.kill()
