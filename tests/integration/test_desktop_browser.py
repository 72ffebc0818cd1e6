"""A desktop's live view seen as a person sees it: ``sandbox.desktop.stream_url()`` opened in
Debian's headless Chromium, driven over the DevTools protocol on loopback. The page's canvas
shows the desktop's own screenshot; keys typed into the page reach the editor, which saves them
to its file (ctrl+s, read back from the sandbox)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from libdsec import DesktopSpec, DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

W, H = 1280, 800
CHROMIUM = "/usr/bin/chromium"


def _args(image: str) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=1024, desktop=DesktopSpec(width=W, height=H))


# -- Chromium over the DevTools protocol ----------------------------------------------------------

class Browser:
    """One headless Chromium (Debian's) and one page of it, driven over its DevTools WebSocket."""

    def __init__(self, process: subprocess.Popen, ws) -> None:
        self.process, self.ws, self.next_id = process, ws, 0

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while not (value := await self.js(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {timeout} s: {expression}")
            await asyncio.sleep(0.2)
        return value

    async def key(self, key: str, code: str, vk: int, text: str = "", modifiers: int = 0) -> None:
        down = {"type": "keyDown" if text else "rawKeyDown", "key": key, "code": code,
                "windowsVirtualKeyCode": vk, "modifiers": modifiers}
        if text:
            down["text"] = down["unmodifiedText"] = text
        await self.call("Input.dispatchKeyEvent", **down)
        await self.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=code, windowsVirtualKeyCode=vk,
                        modifiers=modifiers)


@asynccontextmanager
async def chromium(url: str):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM} (Debian's chromium package)")
    profile = tempfile.mkdtemp(prefix="dsec-chromium-")
    process = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         f"--window-size={W},{H}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert process.poll() is None and time.monotonic() < deadline, "chromium did not start"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with httpx.AsyncClient() as http:
            targets = (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        async with connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=30) as ws:
            browser = Browser(process, ws)
            await browser.call("Page.enable")
            await browser.call("Page.navigate", url=url)
            # noVNC connected: its canvas has the remote screen's size.
            await browser.until(f"(() => {{ const c = document.querySelector('#noVNC_container canvas'); "
                                f"return c && c.width === {W} && c.height === {H} && "
                                f"document.documentElement.classList.contains('noVNC_connected'); }})()")
            yield browser
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _rgb(png: bytes):
    import numpy
    from PIL import Image

    return numpy.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(numpy.int16)


async def test_chromium_shows_the_desktop(client, desktop_image, no_sandbox_outlives_the_test):
    import numpy

    async with await client.run_container(_args(desktop_image)) as sandbox:
        desktop = sandbox.desktop
        await desktop.launch("org.xfce.mousepad")
        await asyncio.sleep(2)
        async with chromium(await desktop.stream_url()) as browser:
            await desktop.move(W - 3, H - 3)  # the pointer out of the way, drawn by noVNC or not
            for _ in range(20):  # (the view follows the screen within a frame or two)
                await asyncio.sleep(0.5)
                data_url = await browser.js("document.querySelector('#noVNC_container canvas').toDataURL('image/png')")
                seen = _rgb(base64.b64decode(data_url.split(",", 1)[1]))
                own = _rgb(await desktop.screenshot())
                assert seen.shape == own.shape == (H, W, 3)
                differ = (numpy.abs(seen - own).max(axis=2) > 24).mean()
                if differ < 0.005:
                    break
            assert differ < 0.005, f"{differ:.2%} of the page's pixels differ from the desktop's screenshot"
            assert len(numpy.unique(own.reshape(-1, 3), axis=0)) > 20  # (not two blank screens alike)


async def test_typing_through_the_page_reaches_the_editor(client, desktop_image, no_sandbox_outlives_the_test):
    async with await client.run_container(_args(desktop_image)) as sandbox:
        desktop = sandbox.desktop
        await sandbox.run_shell(": > /home/user/note.txt")
        await desktop.launch("org.xfce.mousepad", "/home/user/note.txt")
        for _ in range(150):
            editors = [w for w in await desktop.windows() if w.app.lower() == "mousepad"]
            if editors:
                break
            await asyncio.sleep(0.2)
        editor = editors[0]
        async with chromium(await desktop.stream_url()) as browser:
            # A click into the editor's text, through the page (page coordinates of the canvas).
            rect = await browser.js("(() => { const r = document.querySelector('#noVNC_container canvas')"
                                    ".getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()")
            x, y = editor.x + editor.width // 2, editor.y + editor.height // 2
            px, py = rect[0] + x * rect[2] / W, rect[1] + y * rect[3] / H
            for kind in ("mousePressed", "mouseReleased"):
                await browser.call("Input.dispatchMouseEvent", type=kind, x=px, y=py, button="left", clickCount=1)
            await asyncio.sleep(0.5)
            for ch in "typed in Chromium":
                if ch == " ":
                    await browser.key(" ", "Space", 32, " ")
                else:
                    code = f"Key{ch.upper()}"
                    await browser.key(ch, code, ord(ch.upper()), ch, modifiers=8 if ch.isupper() else 0)
            await asyncio.sleep(0.5)
            await browser.call("Input.dispatchKeyEvent", type="rawKeyDown", key="Control", code="ControlLeft",
                               windowsVirtualKeyCode=17, modifiers=2)
            await browser.key("s", "KeyS", 83, modifiers=2)
            await browser.call("Input.dispatchKeyEvent", type="keyUp", key="Control", code="ControlLeft",
                               windowsVirtualKeyCode=17)
            for _ in range(100):
                if (await sandbox.read_file("/home/user/note.txt")) == b"typed in Chromium":
                    break
                await asyncio.sleep(0.2)
            assert (await sandbox.read_file("/home/user/note.txt")) == b"typed in Chromium"
