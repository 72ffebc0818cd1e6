"""A sandbox's desktop through a real ``dsec serve``: the ``desktop`` image, Xvfb and xfce4 in a
crun container, driven by ``sandbox.desktop`` (screenshots, the pointer, typing into an editor
and saving the file, windows and focus), and its errors."""

from __future__ import annotations

import asyncio
import struct
import zlib

import httpx
import pytest

from libdsec import (DesktopSpec, DesktopUnavailable, DSecContainerRunArgs, DSecMicroVMRunArgs, InvalidRequest,
                     LimitOutOfRange)

pytestmark = [pytest.mark.slow, pytest.mark.root]

W, H = 1280, 800


def _desktop_args(image: str, **spec) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=1024,
                                desktop=DesktopSpec(width=W, height=H, dpi=96, **spec))


def _png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of a PNG of 8-bit RGB whose rows are unfiltered (the agent's)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, color = struct.unpack(">IIBB", png[16:26])
    assert (depth, color) == (8, 2)
    data, at = b"", 8
    while at < len(png):
        size, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"IDAT":
            data += png[at + 8:at + 8 + size]
        at += 12 + size
    rows = zlib.decompress(data)
    stride = width * 3 + 1
    assert all(rows[i * stride] == 0 for i in range(height))
    return width, height, b"".join(rows[i * stride + 1:(i + 1) * stride] for i in range(height))


async def _window(sandbox, app: str, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = [w for w in await sandbox.desktop.windows() if w.app.lower() == app]
        if found:
            return found[0]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no {app} window: {await sandbox.desktop.windows()}")
        await asyncio.sleep(0.2)


async def _edited(sandbox) -> bool:
    """Whether mousepad's title marks its text changed (``*note.txt - Mousepad``)."""
    return (await _window(sandbox, "mousepad")).title.startswith("*")


async def _until(check, within_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def test_a_desktop_is_ready_when_create_returns_and_takes_input(client, server, desktop_image,
                                                                     no_sandbox_outlives_the_test):
    async with await client.run_container(_desktop_args(desktop_image)) as sandbox:
        desktop = sandbox.desktop
        assert await desktop.size() == (W, H)
        # The X server the agent drives is the one the sandbox's own commands see.
        probe = await sandbox.run_shell("xdpyinfo | grep dimensions; pgrep -x xfwm4 >/dev/null && echo wm")
        assert f"{W}x{H} pixels" in probe.stdout and "wm" in probe.stdout, probe

        for _ in range(100):  # the session paints its backdrop and panel soon after the window manager is up
            width, height, rgb = _png_pixels(await desktop.screenshot())
            if len(set(rgb[i:i + 3] for i in range(0, len(rgb), 3 * 997))) > 3:
                break
            await asyncio.sleep(0.1)
        assert (width, height) == (W, H)
        assert len(set(rgb[i:i + 3] for i in range(0, len(rgb), 3 * 997))) > 3, "the screen stayed blank"
        # Raw pixels (BGRX) are the same screen as the PNG's RGB.
        for _ in range(3):  # (twice in a row: unless the panel's clock turned a minute in between)
            raw = await desktop.screenshot(format="raw")
            _, _, again = _png_pixels(await desktop.screenshot())
            if raw[2::4] == again[0::3] and raw[1::4] == again[1::3] and raw[0::4] == again[2::3]:
                break
        else:
            raise AssertionError("the raw screenshot is not the PNG's screen")
        assert len(raw) == W * H * 4

        # The pointer: where the agent put it, as xdotool (another X client) sees it.
        moved = await desktop.move(321, 123)
        assert (moved.cursor_x, moved.cursor_y) == (321, 123)
        assert (await sandbox.run_shell("xdotool getmouselocation --shell")).stdout.startswith("X=321\nY=123\n")
        assert (await desktop.drag(100, 100, 220, 160)).cursor_x == 220 and await desktop.cursor() == (220, 160)
        await desktop.click(640, 400, button="left", count=2)
        assert await desktop.cursor() == (640, 400)
        await desktop.mouse_down("right", x=30, y=40)
        await desktop.mouse_up("right")
        await desktop.press("Escape")
        assert await desktop.cursor() == (30, 40)
        await desktop.scroll(3, x=600, y=300)
        await desktop.scroll(-2, dx=1)

        # An editor: typed into, saved with ctrl+s, the text in the file.
        await sandbox.run_shell(": > /home/user/note.txt")
        started = await desktop.launch("org.xfce.mousepad", "/home/user/note.txt")
        assert started.pid > 0
        editor = await _window(sandbox, "mousepad")
        assert "note.txt" in editor.title and editor.width > 0 and editor.height > 0
        await desktop.focus(editor)
        # The editor takes keys once it has the focus and its text view is up, which can be a
        # while after its window is listed (under load, all but the last key of a line typed at
        # once were lost): a key until its title says the text changed, then all of it over that.
        for _ in range(40):
            await desktop.type("x")
            if await _until(lambda: _edited(sandbox), 1.0):
                break
        else:
            raise AssertionError(f"the editor took no key: {await _window(sandbox, 'mousepad')}")
        await desktop.press("ctrl+a")
        text = "Hello, desktop! {x} = 1 ü"
        await desktop.type(text)
        await desktop.press("ctrl+s")
        for _ in range(50):
            if (await sandbox.read_file("/home/user/note.txt")).decode() == text:
                break
            await asyncio.sleep(0.1)
        assert (await sandbox.read_file("/home/user/note.txt")).decode() == text
        _, _, after = _png_pixels(await desktop.screenshot())
        assert after != rgb  # the editor's window is on the screen now

        # A file opened with its default application (xdg-open): a window of its own.
        await sandbox.write_file("/home/user/other.txt", b"other")
        await desktop.open("/home/user/other.txt")
        for _ in range(150):
            titles = [w.title for w in await desktop.windows()]
            if any("other.txt" in t for t in titles):
                break
            await asyncio.sleep(0.2)
        assert any("other.txt" in t for t in titles), titles

        # Bad input: each refused with its reason, the desktop still answering.
        with pytest.raises(InvalidRequest, match="outside the 1280x800 screen"):
            await desktop.click(5000, 10)
        with pytest.raises(InvalidRequest, match="unknown key name 'notakey'"):
            await desktop.press("ctrl+notakey")
        with pytest.raises(ValueError, match="at most 65536 characters"):
            await desktop.type("x" * (1 << 20))
        path = f"{server.endpoint}/v1/sandboxes/{sandbox.id}/desktop/input"
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {server.token}"}, timeout=60) as http:
            answer = await http.post(path, json={"action": "type", "text": "x" * (1 << 20)})
            assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_request"
            answer = await http.post(path, json={"action": "move", "x": 1})
            assert answer.status_code == 422 and "needs y" in answer.json()["error"]["message"]
        assert await desktop.size() == (W, H)

        # The X server killed: a typed error naming it; the sandbox's commands still run.
        await sandbox.run_shell("pkill -x Xvfb", user="root")
        await asyncio.sleep(0.3)
        with pytest.raises(DesktopUnavailable, match="X server|desktop agent"):
            await desktop.screenshot()
        assert (await sandbox.run_shell("echo alive")).stdout == "alive\n"
        # ... and the desktop is started again: a later call finds it back. Calls made all
        # through the restart, four at a time, each answer at once (the agent serves one
        # connection: a call that made one of its own beside the restart's waited for ever).
        async def screenshot() -> bytes | None:
            try:
                return await asyncio.wait_for(desktop.screenshot(), 20)
            except DesktopUnavailable as exc:
                assert "started again" in str(exc)
                return None

        shot = None
        for _ in range(3000):
            shot = next((s for s in await asyncio.gather(*(screenshot() for _ in range(4))) if s), None)
            if shot:
                break
        assert shot and _png_pixels(shot)[:2] == (W, H)
        assert _png_pixels(await asyncio.wait_for(desktop.screenshot(), 20))[:2] == (W, H)
        assert (await sandbox.run_shell("pgrep -c -x Xvfb")).stdout == "1\n"


async def test_desktop_asked_where_none_can_be(client, server, python_image, desktop_image,
                                               no_sandbox_outlives_the_test):
    # An image without an X server: refused at create, naming what it lacks; nothing left.
    with pytest.raises(InvalidRequest, match="cannot run a desktop: no Xvfb"):
        await client.run_container(_desktop_args(python_image))
    # A VM too small for one (its memory is all its guest has): refused before it boots. (Kinds
    # that cannot have a desktop at all: tests/unit/test_backend_capabilities.py.)
    with pytest.raises(LimitOutOfRange, match="memory_limit_mb=256 is too small for a microvm with a desktop: "
                                              "at least 384 MB"):
        await client.run_microvm(DSecMicroVMRunArgs(container_image=desktop_image, memory_limit_mb=256,
                                                    desktop=DesktopSpec()))
    # A sandbox made without one.
    async with await client.run_container(DSecContainerRunArgs(container_image=python_image)) as sandbox:
        with pytest.raises(DesktopUnavailable, match="has no desktop"):
            await sandbox.desktop.screenshot()


@pytest.mark.parametrize("session", ["wm", "none"])
async def test_lighter_sessions(client, desktop_image, session, no_sandbox_outlives_the_test):
    async with await client.run_container(_desktop_args(desktop_image, session=session)) as sandbox:
        running = (await sandbox.run_shell("pgrep -x xfwm4 >/dev/null && echo wm; pgrep -x xfce4-session || true")).stdout
        assert running == ("wm\n" if session == "wm" else "")
        assert _png_pixels(await sandbox.desktop.screenshot())[:2] == (W, H)
        await sandbox.start_shell("exec mousepad")
        if session == "wm":  # a window manager lists the windows it manages
            assert (await _window(sandbox, "mousepad")).width > 0
        else:  # none: no list of managed windows, the pointer still moves
            await asyncio.sleep(1)
            assert await sandbox.desktop.windows() == []
            assert (await sandbox.desktop.move(5, 6)).cursor_x == 5


async def test_accessibility_tree(client, desktop_image, no_sandbox_outlives_the_test):
    async with await client.run_container(_desktop_args(desktop_image)) as sandbox:
        desktop = sandbox.desktop
        await sandbox.run_shell("printf 'accessible words' > /home/user/a11y.txt")
        await desktop.launch("org.xfce.mousepad", "/home/user/a11y.txt")
        editor = await _window(sandbox, "mousepad")
        for _ in range(50):  # (the editor joins the bus as its window maps)
            tree = await desktop.accessibility_tree()
            if '[menu item] "Save' in tree:
                break
            await asyncio.sleep(0.2)
        lines = tree.splitlines()
        # The application at the top, its window a child (indented), with its place on the screen.
        app = lines.index('[application] "mousepad"')
        frames = [line for line in lines[app + 1:] if line.startswith("  [frame] ") and "a11y.txt" in line]
        assert frames, tree[:3000]
        # Its extents: the window with the window manager's frame around it.
        at, size = frames[0].rsplit("@", 1)[1].split()
        (fx, fy), (fw, fh) = map(int, at.split(",")), map(int, size.split("x"))
        assert fx <= editor.x and fy <= editor.y and fx + fw >= editor.x + editor.width \
            and fy + fh >= editor.y + editor.height, (frames[0], editor)
        # Its menus and their items, nested deeper; the text field with the file's text.
        assert any(line.strip().startswith('[menu] "File"') for line in lines), tree[:2000]
        [save] = [line for line in lines if line.strip().startswith('[menu item] "Save"')]
        assert save.startswith("    ") and "hidden)" in save  # (a closed menu's items are not showing)
        assert any('text="accessible words"' in line and "editable" in line for line in lines), tree[:4000]
        # The window manager is there, but not the window it keeps wholly off the screen (whose
        # "active" state depends on the order focus events came in).
        assert '[application] "xfwm4"' in lines and "@-1000,-1000" not in tree, tree[:2000]

        # Bounded: a tree cut at max_chars says so on its last line.
        small = await desktop.accessibility_tree_info(max_chars=1000)
        assert small.truncated and len(small.tree) <= 1100 and "[... truncated:" in small.tree.splitlines()[-1]
        with pytest.raises(ValueError, match="max_chars"):  # (refused before it is sent)
            await desktop.accessibility_tree(max_chars=10)

        # The AT-SPI bus killed: a typed error naming it; screenshots and input go on.
        # (by process name: the desktop agent's command line holds its source, which names them)
        await sandbox.run_shell("pkill -KILL -x at-spi-bus-laun; pkill -KILL -f accessibility.conf; "
                                "pkill -KILL -x at-spi2-registr; true", user="root")
        await asyncio.sleep(0.3)
        with pytest.raises(DesktopUnavailable, match="AT-SPI"):
            await desktop.accessibility_tree()
        assert _png_pixels(await desktop.screenshot())[:2] == (W, H)
        await desktop.click(10, 10)
