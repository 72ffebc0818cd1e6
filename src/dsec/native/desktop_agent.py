"""The desktop agent: run inside a sandbox (``python3 -c`` with this source, python3-xlib), never
imported by the server.

It starts the X server (Xvfb, ready when it writes its display number on ``-displayfd``) and
the desktop session, opens ONE connection to the X server, and serves the node on
127.0.0.1:PORT in the sandbox's network namespace: screenshots (``GetImage`` of the root
window in bands, encoded as PNG here as they come) and input (the XTEST extension, as xdotool sends it), each a
request on that one connection.

Wire, one request at a time: the node sends a 4-byte big-endian length and a JSON object
(``op`` and its arguments); the agent answers a 4-byte length, a JSON header (``ok`` true with
``size`` bytes of payload following, or ``ok`` false with ``error``: ``invalid`` (the request's
fault), ``a11y_down`` (the AT-SPI bus cannot be read) or ``x_gone`` (the X server is gone), and
``message``).

Accessibility: the session's programs find the AT-SPI bus by the root window's ``AT_SPI_BUS``
(at-spi-bus-launcher sets it; xfce4-session starts the launcher itself, the lighter sessions get
one started here), with toolkit accessibility on (``NO_AT_BRIDGE`` removed from their
environment); ``accessibility_tree`` reads that bus with pyatspi in a child process.

Arguments: WIDTH HEIGHT DPI PORT DISPLAY SESSION (``xfce4``: xfce4-session on a D-Bus session
bus, as E2B Desktop starts it; ``wm``: xfwm4 alone; ``none``: only the X server).
"""

import json
import os
import socket
import struct
import subprocess
import sys
import time
import zlib

from Xlib import X, XK, display as xdisplay, error as xerror
from Xlib.ext import xtest
from Xlib.protocol import event as xevent

BUTTONS = {"left": 1, "middle": 2, "right": 3, "back": 8, "forward": 9}
# Key names as agents write them (xdotool's, pyautogui's) -> X keysym names.
ALIASES = {
    "ctrl": "Control_L", "control": "Control_L", "alt": "Alt_L", "shift": "Shift_L", "super": "Super_L",
    "win": "Super_L", "meta": "Super_L", "cmd": "Super_L", "enter": "Return", "return": "Return",
    "esc": "Escape", "escape": "Escape", "backspace": "BackSpace", "tab": "Tab", "space": "space",
    "delete": "Delete", "del": "Delete", "insert": "Insert", "home": "Home", "end": "End",
    "pageup": "Prior", "page_up": "Prior", "pagedown": "Next", "page_down": "Next", "up": "Up", "down": "Down",
    "left": "Left", "right": "Right", "capslock": "Caps_Lock", "menu": "Menu", "printscreen": "Print",
}
MAX_TEXT = 65536

# The accessibility tree, as OSWorld gives agents one: run as ``python3 -c A11Y_TREE MAX_CHARS``
# in a process of its own (pyatspi's D-Bus calls can hang on a broken bus: the agent bounds it by
# a timeout), on the AT-SPI bus the agent found (AT_SPI_BUS_ADDRESS). One line per accessible:
# role, "name", the states that matter, text of a text field, screen extents; children indented.
# A top-level window placed wholly off the screen is left out with what is in it (xfwm4 keeps one
# at -1000,-1000 whose "active" state depends on the order focus events came in).
A11Y_TREE = r"""
import sys
import pyatspi

MAX_CHARS, MAX_NODES, MAX_DEPTH = int(sys.argv[1]), 20000, 60
WIDTH, HEIGHT = int(sys.argv[2]), int(sys.argv[3])
S = pyatspi
FLAGS = [(S.STATE_FOCUSED, "focused"), (S.STATE_SELECTED, "selected"), (S.STATE_CHECKED, "checked"),
         (S.STATE_EXPANDED, "expanded"), (S.STATE_EDITABLE, "editable"), (S.STATE_ACTIVE, "active")]
TEXT_ROLES = {"text", "entry", "password text", "paragraph", "terminal", "document text", "label"}


def describe(acc, depth):
    role = acc.getRoleName()
    name = (acc.name or "").replace("\n", " ").strip()[:200]
    states = acc.getState()
    if role == "application":  # (an application has no states or place of its own)
        return "  " * depth + f'[{role}] "{name}"', True
    flags = [n for s, n in FLAGS if states.contains(s)]
    if not states.contains(S.STATE_SENSITIVE):
        flags.append("disabled")
    if not states.contains(S.STATE_SHOWING):
        flags.append("hidden")
    line = "  " * depth + f'[{role}] "{name}"'
    if role in TEXT_ROLES or states.contains(S.STATE_EDITABLE):
        try:
            text = acc.queryText()
            value = text.getText(0, min(text.characterCount, 200)).replace("\n", "\\n")
            if value and value != name:
                line += f' text="{value}"'
        except NotImplementedError:
            pass
    if flags:
        line += " (" + ", ".join(flags) + ")"
    on_screen = True
    try:
        ext = acc.queryComponent().getExtents(S.DESKTOP_COORDS)
        if ext.x > -(1 << 30) and ext.y > -(1 << 30):  # (a menu not open has no place: G_MININT)
            line += f" @{ext.x},{ext.y} {ext.width}x{ext.height}"
            on_screen = ext.x < WIDTH and ext.y < HEIGHT and ext.x + ext.width > 0 and ext.y + ext.height > 0
    except NotImplementedError:
        pass
    return line, on_screen


def main():
    desktop = S.Registry.getDesktop(0)
    out, size, seen = [], 0, 0
    stack = [(desktop.getChildAtIndex(i), 0) for i in reversed(range(desktop.childCount))]
    left = 0
    while stack:
        acc, depth = stack.pop()
        if acc is None:
            continue
        try:
            line, on_screen = describe(acc, depth)
            if depth == 1 and not on_screen:
                continue
            children = [] if depth >= MAX_DEPTH else [(acc.getChildAtIndex(i), depth + 1)
                                                       for i in reversed(range(min(acc.childCount, 1000)))]
        except Exception:  # (gone since its parent listed it)
            continue
        if size + len(line) + 1 > MAX_CHARS or seen >= MAX_NODES:
            left = 1 + len(stack)
            break
        out.append(line)
        size += len(line) + 1
        seen += 1
        stack.extend(children)
    if left:
        out.append(f"[... truncated: {left}+ more accessibles not shown, at {MAX_CHARS} characters]")
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.write(f"\0{seen} {1 if left else 0}")


main()
"""
A11Y_TIMEOUT_S = 20.0



class Invalid(Exception):
    pass


class A11yDown(Exception):
    """The AT-SPI bus cannot be reached (or the tree not read from it)."""


# A screenshot is read and encoded in bands of rows of at most this many bytes of pixels: each
# band's buffers stay under the malloc mmap threshold the node starts the agent with
# (dsec.edge.desktop.AGENT_MMAP_THRESHOLD, 256 KiB), so they come from the heap and go back to it
# instead of being mapped afresh (page faults on every megabyte, each screenshot: 2.5x its time
# here), and python-xlib receives each band's reply in one or two reads instead of growing one
# 4 MB buffer read by read.
BAND_BYTES = 240 * 1024


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width, height, bands):
    """PNG (8-bit RGB, no filter, zlib level 1) of a screen whose rows come as ``bands``:
    ZPixmap images in BGRX order, top to bottom."""
    stride = width * 3
    z = zlib.compressobj(1)
    parts = []
    for bgrx in bands:
        rgb = bytearray(len(bgrx) // 4 * 3)
        rgb[0::3] = bgrx[2::4]
        rgb[1::3] = bgrx[1::4]
        rgb[2::3] = bgrx[0::4]
        parts.append(z.compress(b"".join(b"\x00" + rgb[i:i + stride] for i in range(0, len(rgb), stride))))
    parts.append(z.flush())
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + png_chunk(b"IDAT", b"".join(parts)) + png_chunk(b"IEND", b""))


class Desktop:
    def __init__(self, name):
        self.name = name
        self.d = xdisplay.Display(name)
        self.root = self.d.screen().root
        self.width = self.d.screen().width_in_pixels
        self.height = self.d.screen().height_in_pixels
        if not self.d.has_extension("XTEST"):
            raise SystemExit("the X server has no XTEST extension")
        self.spare = None  # a keycode with no keysym, borrowed for characters the keymap lacks

    def atom(self, name):
        return self.d.intern_atom(name)

    # -- input ------------------------------------------------------------------------------

    def _point(self, x, y):
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise Invalid(f"({x}, {y}) is outside the {self.width}x{self.height} screen")
        return x, y

    def move(self, x, y):
        x, y = self._point(x, y)
        xtest.fake_input(self.d, X.MotionNotify, x=x, y=y)

    def _button(self, name):
        if name not in BUTTONS:
            raise Invalid(f"unknown button {name!r}: one of {', '.join(BUTTONS)}")
        return BUTTONS[name]

    def click(self, x=None, y=None, button="left", count=1):
        b = self._button(button)
        if not 1 <= count <= 10:
            raise Invalid(f"count {count} is outside 1-10")
        if x is not None:
            self.move(x, y)
        for _ in range(count):
            xtest.fake_input(self.d, X.ButtonPress, b)
            xtest.fake_input(self.d, X.ButtonRelease, b)

    def button(self, down, x=None, y=None, button="left"):
        b = self._button(button)
        if x is not None:
            self.move(x, y)
        xtest.fake_input(self.d, X.ButtonPress if down else X.ButtonRelease, b)

    def drag(self, x, y, to_x, to_y, button="left"):
        b = self._button(button)
        self._point(to_x, to_y)
        self.move(x, y)
        xtest.fake_input(self.d, X.ButtonPress, b)
        self.d.sync()
        steps = 8
        for i in range(1, steps + 1):
            self.move(x + (to_x - x) * i // steps, y + (to_y - y) * i // steps)
            self.d.sync()
        self._arrive(to_x, to_y)
        xtest.fake_input(self.d, X.ButtonRelease, b)

    def _arrive(self, x, y, wait_s=0.5):
        """Wait until the pointer is at (x, y): with a button held, a client's grab (the desktop's
        rubber band, a window being dragged) may have the server apply the queued motion a moment
        after the sync that sent it, and the release must land where the drag ends."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            p = self.root.query_pointer()
            if (p.root_x, p.root_y) == (x, y):
                return
            time.sleep(0.002)

    def scroll(self, dx=0, dy=0, x=None, y=None):
        if x is not None:
            self.move(x, y)
        for amount, less, more in ((dy, 4, 5), (dx, 6, 7)):
            if abs(amount) > 100:
                raise Invalid(f"scroll of {amount} clicks is over 100")
            b = more if amount > 0 else less
            for _ in range(abs(amount)):
                xtest.fake_input(self.d, X.ButtonPress, b)
                xtest.fake_input(self.d, X.ButtonRelease, b)

    def _keysym(self, name):
        if not name:
            raise Invalid("an empty key name")
        keysym = XK.string_to_keysym(ALIASES.get(name.lower(), name))
        if not keysym and len(name) > 1 and name[0].lower() == "f" and name[1:].isdigit():
            keysym = XK.string_to_keysym(name.upper())
        if not keysym and len(name) == 1:
            keysym = _char_keysym(name)
        if not keysym:
            raise Invalid(f"unknown key name {name!r}")
        return keysym

    def _keycode(self, keysym):
        """(keycode, shifted) for ``keysym``, remapping the spare keycode if the keymap lacks it."""
        for code, index in self.d.keysym_to_keycodes(keysym):
            if index in (0, 1):
                return code, index == 1
        if self.spare is None:
            first = self.d.display.info.min_keycode
            count = self.d.display.info.max_keycode - first + 1
            mapping = self.d.get_keyboard_mapping(first, count)
            empty = [first + i for i, syms in enumerate(mapping) if not any(syms)]
            if not empty:
                raise Invalid("no free keycode for a character the keymap lacks")
            self.spare = empty[-1]
        self.d.change_keyboard_mapping(self.spare, [(keysym, keysym)])
        self.d.sync()
        return self.spare, False

    def _tap(self, keysym):
        code, shifted = self._keycode(keysym)
        shift = self.d.keysym_to_keycode(XK.XK_Shift_L)
        if shifted:
            xtest.fake_input(self.d, X.KeyPress, shift)
        xtest.fake_input(self.d, X.KeyPress, code)
        xtest.fake_input(self.d, X.KeyRelease, code)
        if shifted:
            xtest.fake_input(self.d, X.KeyRelease, shift)
        if code == self.spare:
            self.d.sync()

    def press(self, keys):
        syms = [self._keysym(k) for k in keys.split("+")] if keys != "+" else [self._keysym("+")]
        codes = []
        for sym in syms:
            code, shifted = self._keycode(sym)
            codes.append(code)
        for code in codes:
            xtest.fake_input(self.d, X.KeyPress, code)
        for code in reversed(codes):
            xtest.fake_input(self.d, X.KeyRelease, code)

    def type(self, text):
        if len(text) > MAX_TEXT:
            raise Invalid(f"text of {len(text)} characters is over {MAX_TEXT}")
        for i, ch in enumerate(text):
            self._tap(_char_keysym(ch))
            if i % 200 == 199:
                self.d.sync()

    # -- reading ----------------------------------------------------------------------------

    def cursor(self):
        p = self.root.query_pointer()
        return {"x": p.root_x, "y": p.root_y}

    def screenshot(self, fmt):
        if fmt == "raw":
            return self.root.get_image(0, 0, self.width, self.height, X.ZPixmap, 0xFFFFFFFF).data
        rows = max(1, BAND_BYTES // (self.width * 4))
        bands = (self.root.get_image(0, y, self.width, min(rows, self.height - y), X.ZPixmap, 0xFFFFFFFF).data
                 for y in range(0, self.height, rows))
        # One screen, not bands of different moments: no other client is served until the last
        # band is read and encoded (they wait a screenshot's time, tens of milliseconds).
        self.d.grab_server()
        try:
            return png(self.width, self.height, bands)
        finally:
            self.d.ungrab_server()
            self.d.flush()

    def _text(self, window, name, kind):
        prop = window.get_full_property(self.atom(name), kind)
        if prop is None or prop.value is None:
            return None
        value = prop.value
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def windows(self):
        prop = self.root.get_full_property(self.atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
        ids = list(prop.value) if prop is not None else []
        active = self.root.get_full_property(self.atom("_NET_ACTIVE_WINDOW"), X.AnyPropertyType)
        active_id = active.value[0] if active is not None and len(active.value) else 0
        out = []
        for wid in ids:
            w = self.d.create_resource_object("window", wid)
            try:
                title = self._text(w, "_NET_WM_NAME", self.atom("UTF8_STRING")) or self._text(
                    w, "WM_NAME", X.AnyPropertyType) or ""
                wm_class = w.get_wm_class() or ("", "")
                geom = w.get_geometry()
                at = w.translate_coords(self.root, 0, 0)
                pid = w.get_full_property(self.atom("_NET_WM_PID"), X.AnyPropertyType)
            except xerror.BadWindow:
                continue  # closed since the list was read
            out.append({
                "id": wid, "title": title, "app": wm_class[1] or wm_class[0], "x": -at.x, "y": -at.y,
                "width": geom.width, "height": geom.height,
                "pid": int(pid.value[0]) if pid is not None and len(pid.value) else None, "focused": wid == active_id,
            })
        return out

    def focus(self, window):
        ids = [w["id"] for w in self.windows()]
        if window not in ids:
            raise Invalid(f"no window {window} on the desktop (windows: {ids})")
        w = self.d.create_resource_object("window", window)
        ev = xevent.ClientMessage(window=w, client_type=self.atom("_NET_ACTIVE_WINDOW"),
                                  data=(32, [2, X.CurrentTime, 0, 0, 0]))
        self.root.send_event(ev, event_mask=X.SubstructureRedirectMask | X.SubstructureNotifyMask)
        w.configure(stack_mode=X.Above)
        w.set_input_focus(X.RevertToParent, X.CurrentTime)

    def accessibility_tree(self, max_chars):
        if not 1000 <= max_chars <= 2_000_000:
            raise Invalid(f"max_chars {max_chars} is outside 1000-2000000")
        prop = self.root.get_full_property(self.atom("AT_SPI_BUS"), X.AnyPropertyType)
        if prop is None or not prop.value:
            raise A11yDown("no AT-SPI bus: the root window has no AT_SPI_BUS (at-spi-bus-launcher is not running)")
        address = prop.value.decode() if isinstance(prop.value, bytes) else str(prop.value)
        env = {**os.environ, "DISPLAY": self.name, "AT_SPI_BUS_ADDRESS": address}
        env.pop("NO_AT_BRIDGE", None)
        try:
            done = subprocess.run([sys.executable, "-c", A11Y_TREE, str(max_chars), str(self.width), str(self.height)], env=env, capture_output=True,
                                  timeout=A11Y_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise A11yDown(f"the AT-SPI bus at {address} did not answer in {A11Y_TIMEOUT_S:.0f} s") from None
        tree, _, counts = done.stdout.decode("utf-8", "replace").rpartition("\0")
        if done.returncode != 0 or not counts:
            why = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise A11yDown(f"the AT-SPI bus at {address} could not be read: {why[0][:300]}")
        count, truncated = (int(n) for n in counts.split())
        return {"count": count, "truncated": bool(truncated)}, tree.encode()

    def has_wm(self):
        return self.d.get_selection_owner(self.atom("WM_S0")) != X.NONE

    # -- a request --------------------------------------------------------------------------

    def handle(self, req):
        op = req.get("op")
        if op == "screenshot":
            return {}, self.screenshot(req.get("format", "png"))
        if op == "info":
            return {"width": self.width, "height": self.height, **self.cursor()}, b""
        if op == "windows":
            return {"windows": self.windows()}, b""
        if op == "accessibility_tree":
            return self.accessibility_tree(req.get("max_chars", 100_000))
        if op == "move":
            self.move(req["x"], req["y"])
        elif op == "click":
            self.click(req.get("x"), req.get("y"), req.get("button", "left"), req.get("count", 1))
        elif op in ("mouse_down", "mouse_up"):
            self.button(op == "mouse_down", req.get("x"), req.get("y"), req.get("button", "left"))
        elif op == "drag":
            self.drag(req["x"], req["y"], req["to_x"], req["to_y"], req.get("button", "left"))
        elif op == "scroll":
            self.scroll(req.get("dx", 0), req.get("dy", 0), req.get("x"), req.get("y"))
        elif op == "type":
            self.type(req["text"])
        elif op == "press":
            self.press(req["keys"])
        elif op == "focus":
            self.focus(req["window"])
        else:
            raise Invalid(f"unknown desktop operation {op!r}")
        self.d.sync()  # done when answered: the X server has the events
        return self.cursor(), b""


def _char_keysym(ch):
    if ch == "\n":
        return XK.XK_Return
    if ch == "\t":
        return XK.XK_Tab
    code = ord(ch)
    if 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xFF:
        return code
    return 0x01000000 | code


# No GLX: it loads Mesa (libLLVM's relocated pages, 8 MiB anonymous in every process that maps
# it) into the X server and into the window manager, which uses GL when the server offers it.
XVFB_LEAN = ("-extension", "GLX")


def start_x(display, width, height, dpi):
    r, w = os.pipe()
    server = subprocess.Popen(
        ["Xvfb", display, "-screen", "0", f"{width}x{height}x24", "-dpi", str(dpi), "-nolisten", "tcp",
         *XVFB_LEAN, "-displayfd", str(w)],
        pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open("/tmp/.dsec-xvfb.log", "wb"),
    )
    os.close(w)
    with os.fdopen(r) as ready:
        if not ready.readline().strip():
            raise SystemExit(f"Xvfb ended before it was ready (exit {server.wait()}): see /tmp/.dsec-xvfb.log")
    return server


A11Y_LAUNCHER = "/usr/libexec/at-spi-bus-launcher"


def start_session(session, env):
    if session != "xfce4" and os.access(A11Y_LAUNCHER, os.X_OK):  # (xfce4-session starts its own)
        subprocess.Popen(["dbus-run-session", "--", A11Y_LAUNCHER, "--launch-immediately"], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open("/tmp/.dsec-a11y.log", "wb"), start_new_session=True)
    if session == "none":
        return None
    # (the lone window manager without its compositor: nothing here needs one, and it keeps an
    # off-screen copy of every window in the X server)
    command = ["dbus-run-session", "--", "xfce4-session"] if session == "xfce4" else ["xfwm4", "--compositor=off"]
    if session == "xfce4":  # as startxfce4 sets it: xdg-open then opens with exo-open
        env = {**env, "XDG_CURRENT_DESKTOP": "XFCE"}
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open("/tmp/.dsec-session.log", "wb"), start_new_session=True)


def read_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def answer(conn, header, payload=b""):
    head = json.dumps({**header, "size": len(payload)}).encode()
    conn.sendall(struct.pack(">I", len(head)) + head + payload)


def serve(desktop, listener):
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                size = read_exact(conn, 4)
                if size is None:
                    break
                body = read_exact(conn, struct.unpack(">I", size)[0])
                if body is None:
                    break
                try:
                    header, payload = desktop.handle(json.loads(body))
                    answer(conn, {"ok": True, **header}, payload)
                except Invalid as exc:
                    answer(conn, {"ok": False, "error": "invalid", "message": str(exc)})
                except A11yDown as exc:
                    answer(conn, {"ok": False, "error": "a11y_down", "message": str(exc)})
                except (KeyError, TypeError, ValueError) as exc:
                    answer(conn, {"ok": False, "error": "invalid", "message": f"bad request: {exc!r}"})
                except (xerror.ConnectionClosedError, OSError) as exc:
                    answer(conn, {"ok": False, "error": "x_gone", "message": f"the X server is gone: {exc}"})
                    raise SystemExit(3)


def main():
    os.environ.pop("DESKTOP_AGENT_PY", None)  # (its own source: not for the desktop's programs)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # (the agent's own malloc tuning, likewise)
    width, height, dpi, port = (int(a) for a in sys.argv[1:5])
    name, session = sys.argv[5], sys.argv[6]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    start_x(name, width, height, dpi)
    env = {**os.environ, "DISPLAY": name}
    env.pop("NO_AT_BRIDGE", None)  # (toolkit accessibility on: the tree needs it)
    desktop = Desktop(name)
    start_session(session, env)
    if session != "none":  # the window manager up (WM_S0 owned), so windows get frames and focus
        deadline = time.monotonic() + 10
        while not desktop.has_wm() and time.monotonic() < deadline:
            time.sleep(0.02)
    listener.listen(4)  # the node's connect succeeds only now: the desktop is ready
    serve(desktop, listener)


if __name__ == "__main__":
    main()
