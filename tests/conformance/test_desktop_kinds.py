"""The desktop case of the conformance suite: every sandbox kind whose backend declares
``Capability.DESKTOP`` runs the ``desktop`` image's desktop with the same calls, through one real
``dsec serve`` (one sandbox, and so one VM boot, per kind): a screenshot of the asked size as a
PNG, a window listed by ``windows()``, a click that changes the screen and typing that reaches
the window. (The container kind's full set of calls and errors: tests/integration/
test_desktop.py.)"""

from __future__ import annotations

import asyncio
import struct
import time

import pytest

from dsec.backends.base import Capability
from dsec.backends.container import ContainerBackend
from dsec.backends.vm.fullvm import FullVMBackend
from dsec.backends.vm.microvm import MicroVMBackend
from libdsec import DesktopSpec, DSecContainerRunArgs, DSecFullVMRunArgs, DSecMicroVMRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

W, H = 1024, 640
KINDS = [cls.kind for cls in (ContainerBackend, MicroVMBackend, FullVMBackend) if Capability.DESKTOP in cls.capabilities]
# A guest emulated by TCG starts the editor in seconds where a container takes a fraction of one.
WAIT_S = 90.0


# A window of the image's own python3-xlib that paints itself black when clicked and shows what
# is typed in its title: an X client of a second's start where an editor takes a minute under TCG.
PROBE = """
from Xlib import X, display
d = display.Display()
s = d.screen()
w = s.root.create_window(100, 80, 400, 200, 0, s.root_depth, background_pixel=s.white_pixel,
                         event_mask=X.ExposureMask | X.KeyPressMask | X.ButtonPressMask)
w.set_wm_name("probe")
w.set_wm_class("probe", "Probe")
w.map()
d.flush()
typed = ""
while True:
    e = d.next_event()
    if e.type == X.ButtonPress:
        w.change_attributes(background_pixel=s.black_pixel)
        w.clear_area()
        w.set_wm_name("probe clicked")
    elif e.type == X.KeyPress:
        typed += d.lookup_string(d.keycode_to_keysym(e.detail, e.state & X.ShiftMask)) or ""
        w.set_wm_name("probe: " + typed)
    d.flush()
"""


async def _run(client, kind: str, spec: DesktopSpec):
    if kind == "container":
        return await client.run_container(DSecContainerRunArgs(container_image="desktop", memory_limit_mb=1024,
                                                               desktop=spec))
    if kind == "microvm":
        return await client.run_microvm(DSecMicroVMRunArgs(container_image="desktop", memory_limit_mb=512, desktop=spec))
    return await client.run_vm(DSecFullVMRunArgs(container_image="desktop", memory_limit_mb=512, desktop=spec))


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", png[:16]
    return struct.unpack(">II", png[16:24])


async def _until(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (found := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S:.0f} s")
        await asyncio.sleep(0.3)
    return found


def test_the_kinds_that_declare_desktops():
    assert KINDS == ["container", "microvm", "fullvm"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_desktop_on_each_kind(kind, client, desktop_image):
    # ``wm``: the window manager without the rest of xfce4's session, for a guest under TCG.
    async with await _run(client, kind, DesktopSpec(width=W, height=H, dpi=96, session="wm")) as sandbox:
        desktop = sandbox.desktop
        # (started first: its python3 takes half a minute to start in a guest under TCG)
        await sandbox.start_shell('exec python3 -c "$PROBE"', env={"PROBE": PROBE})
        assert await desktop.size() == (W, H)
        assert _png_size(await desktop.screenshot()) == (W, H)
        assert len(await desktop.screenshot(format="raw")) == W * H * 4

        async def probe():
            return next((w for w in await desktop.windows() if w.app == "Probe"), None)

        window = await _until(probe, "no window of the probe")
        assert window.title == "probe" and window.width == 400 and window.height == 200
        await asyncio.sleep(0.5)  # (mapped and painted white)
        before = await desktop.screenshot()
        x, y = window.x + 200, window.y + 100
        await desktop.click(x, y)  # (xfwm4 gives it the keyboard too)
        await _until(lambda: _titled(desktop, "probe clicked"), "the click did not reach the window")
        assert await desktop.screenshot() != before  # (it painted itself black)
        await desktop.focus(window)
        await desktop.type(f"on {kind}")
        await _until(lambda: _titled(desktop, f"probe: on {kind}"), "the typing did not reach the window")
        assert await desktop.cursor() == (x, y)
    assert await client.list_sandboxes() == []


async def _titled(desktop, title: str) -> bool:
    return any(w.title == title for w in await desktop.windows())
