"""Residue that must not travel when a sandbox's changes become a layer (``pack_diff``).

Shell and REPL histories (they hold the agent's commands), temporary files, runtime state and
package caches, and anything the platform itself put into the sandbox (``/.dsec``). The paths are
relative to the root of the sandbox's writable layer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Matched against the relative path of every entry in the writable layer.
_RULES = [
    re.compile(r"(?:root|home/[^/]+)/\.(?:bash|ash|sh|zsh|python|mysql|psql|node_repl)_history\Z"),
    re.compile(r"(?:root|home/[^/]+)/\.(?:lesshst|viminfo|wget-hsts)\Z"),
    re.compile(r"(?:tmp|var/tmp|run|dev/shm)/.+"),
    re.compile(r"var/cache/apt/(?:archives/[^/]+\.deb|[^/]+\.bin)\Z"),
    re.compile(r"\.dsec(?:/.*)?\Z"),
]


def residue(upper: Path) -> frozenset[str]:
    """Relative paths under ``upper`` to leave out of a packed layer (a directory's contents
    go with it, so only its top entry is listed)."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        for name in list(dirnames) + filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if any(rule.match(rel) for rule in _RULES):
                found.add(rel)
                if name in dirnames:
                    dirnames.remove(name)
    return frozenset(found)


def is_residue(rel: str) -> bool:
    """Whether the relative path ``rel`` is residue (its parents not looked at)."""
    return any(rule.match(rel) for rule in _RULES)
