"""``sandbox.desktop``: the screen, mouse and keyboard of a sandbox made with a desktop
(``DSecContainerRunArgs(..., desktop=DesktopSpec(width=1280, height=800, dpi=96))``).

Each call is one request; on the node it is one request to the sandbox's desktop agent, which
holds one connection to the X server (no command is started per action). Coordinates are
pixels from the top-left corner; a point outside the screen, an unknown key or button, or text
over ``MAX_TYPED_TEXT`` characters is ``InvalidRequest``. A sandbox without a desktop, or whose
X server died, answers ``DesktopUnavailable``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .api_ops import api_route
from .protocol import (
    DesktopAccessibilityRequest,
    DesktopAccessibilityTree,
    DesktopFocusRequest,
    DesktopInfo,
    DesktopInput,
    DesktopLaunchRequest,
    DesktopStream,
    DesktopStreamRequest,
    DesktopWindow,
    DesktopWindowList,
    ProcessInfo,
)

if TYPE_CHECKING:
    from ._client import Sandbox

Button = Literal["left", "middle", "right", "back", "forward"]


class Desktop:
    """The desktop of one sandbox (``sandbox.desktop``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    async def _input(self, **fields: object) -> DesktopInfo:
        sandbox = self._sandbox
        body = await sandbox._client._request(*api_route("desktop_input", sandbox_id=sandbox.id),
                                              model=DesktopInput(**fields))
        return DesktopInfo.model_validate(body)

    async def screenshot(self, *, format: Literal["png", "raw"] = "png") -> bytes:
        """The whole screen: PNG bytes, or (``raw``) its pixels, 4 bytes each (B, G, R, unused),
        row after row."""
        sandbox = self._sandbox
        return await sandbox._client._request(*api_route("desktop_screenshot", sandbox_id=sandbox.id),
                                              params={"format": format}, raw=True)

    async def click(self, x: int | None = None, y: int | None = None, *, button: Button = "left",
                    count: int = 1) -> DesktopInfo:
        """Click ``count`` times (2: a double click) at (x, y), or where the pointer is."""
        return await self._input(action="click", x=x, y=y, button=button, count=count)

    async def move(self, x: int, y: int) -> DesktopInfo:
        return await self._input(action="move", x=x, y=y)

    async def drag(self, x: int, y: int, to_x: int, to_y: int, *, button: Button = "left") -> DesktopInfo:
        """Press at (x, y), move to (to_x, to_y) in steps, release."""
        return await self._input(action="drag", x=x, y=y, to_x=to_x, to_y=to_y, button=button)

    async def scroll(self, dy: int = 0, dx: int = 0, *, x: int | None = None, y: int | None = None) -> DesktopInfo:
        """Turn the wheel ``dy`` clicks (down positive) and ``dx`` (right positive), at (x, y) if given."""
        return await self._input(action="scroll", dx=dx, dy=dy, x=x, y=y)

    async def mouse_down(self, button: Button = "left", *, x: int | None = None, y: int | None = None) -> DesktopInfo:
        return await self._input(action="mouse_down", button=button, x=x, y=y)

    async def mouse_up(self, button: Button = "left", *, x: int | None = None, y: int | None = None) -> DesktopInfo:
        return await self._input(action="mouse_up", button=button, x=x, y=y)

    async def type(self, text: str) -> DesktopInfo:
        """Type ``text`` into the focused window (any Unicode; newlines are Return)."""
        return await self._input(action="type", text=text)

    async def press(self, keys: str) -> DesktopInfo:
        """Press keys together and release them: ``"ctrl+s"``, ``"Return"``, ``"alt+F4"``."""
        return await self._input(action="press", keys=keys)

    async def info(self) -> DesktopInfo:
        """The screen's size and DPI, and where the pointer is."""
        sandbox = self._sandbox
        return DesktopInfo.model_validate(
            await sandbox._client._request(*api_route("desktop_info", sandbox_id=sandbox.id)))

    async def cursor(self) -> tuple[int, int]:
        """Where the pointer is: (x, y)."""
        info = await self.info()
        return info.cursor_x, info.cursor_y

    async def size(self) -> tuple[int, int]:
        """The screen's (width, height) in pixels."""
        info = await self.info()
        return info.width, info.height

    async def windows(self) -> list[DesktopWindow]:
        """The top-level windows the window manager manages (id, title, app, geometry)."""
        sandbox = self._sandbox
        body = await sandbox._client._request(*api_route("desktop_windows", sandbox_id=sandbox.id))
        return DesktopWindowList.model_validate(body).windows

    async def accessibility_tree(self, *, max_chars: int = 100_000) -> str:
        """The AT-SPI accessibility tree of the desktop as text, as OSWorld gives it to agents: one
        line per accessible (``[role] "name"``, a text field's ``text="…"``, states that matter
        such as ``focused``, ``selected``, ``checked``, ``hidden``; ``@x,y WxH`` on the screen),
        children indented under their parent. At most ``max_chars`` characters; a tree cut there
        ends with a ``[... truncated: …]`` line. ``DesktopUnavailable`` naming the AT-SPI bus when
        it is down. (``accessibility_tree_info`` gives the counts too.)"""
        return (await self.accessibility_tree_info(max_chars=max_chars)).tree

    async def accessibility_tree_info(self, *, max_chars: int = 100_000) -> DesktopAccessibilityTree:
        """``accessibility_tree`` with how many accessibles it shows and whether it was cut."""
        sandbox = self._sandbox
        return DesktopAccessibilityTree.model_validate(await sandbox._client._request(
            *api_route("desktop_accessibility_tree", sandbox_id=sandbox.id),
            model=DesktopAccessibilityRequest(max_chars=max_chars)))

    async def focus(self, window: int | DesktopWindow) -> None:
        """Raise ``window`` and give it the keyboard."""
        sandbox = self._sandbox
        wid = window.id if isinstance(window, DesktopWindow) else window
        await sandbox._client._request(*api_route("desktop_focus", sandbox_id=sandbox.id),
                                       model=DesktopFocusRequest(window=wid))

    async def launch(self, app: str, uri: str | None = None) -> ProcessInfo:
        """Start an application by its desktop entry (``mousepad``, ``firefox-esr``), with ``uri``."""
        sandbox = self._sandbox
        return ProcessInfo.model_validate(await sandbox._client._request(
            *api_route("desktop_launch", sandbox_id=sandbox.id), model=DesktopLaunchRequest(app=app, uri=uri)))

    async def open(self, path_or_url: str) -> ProcessInfo:
        """Open a file or URL with its default application (``xdg-open``)."""
        sandbox = self._sandbox
        return ProcessInfo.model_validate(await sandbox._client._request(
            *api_route("desktop_launch", sandbox_id=sandbox.id), model=DesktopLaunchRequest(open=path_or_url)))

    async def stream_url(self, *, ttl_s: float = 3600.0) -> str:
        """A live view of the desktop in the browser: the URL of noVNC's page through the API,
        which connects by itself and takes the mouse and keyboard. It opens for this client's
        project only (its path carries a key made for it and this sandbox, valid ``ttl_s``
        seconds): keep it as you would a token. x11vnc and noVNC start in the sandbox on the
        first call (on E2B Desktop's ports, 5900 and 6080)."""
        sandbox = self._sandbox
        body = await sandbox._client._request(*api_route("desktop_stream", sandbox_id=sandbox.id),
                                              model=DesktopStreamRequest(ttl_s=ttl_s))
        return sandbox._client.endpoint + DesktopStream.model_validate(body).path
