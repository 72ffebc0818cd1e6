"""Damage done to files by the tests that check it is found (a layer file on the store, its sums)."""

from __future__ import annotations

import os
from pathlib import Path


def flip(path: Path, offset: int) -> None:
    """Invert the byte at ``offset`` of ``path`` (read-only files too: the tests run as root or
    own them); a second flip puts it back."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
