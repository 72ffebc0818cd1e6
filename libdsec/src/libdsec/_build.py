"""What ``DSecClient.build_image`` sends: the Dockerfile's text and its build context as a tar
(gzip), with what ``.dockerignore`` leaves out left out. Links are sent as links: one that leads
out of the context is refused by the server, naming it."""

from __future__ import annotations

import base64
import fnmatch
import io
import os
import tarfile
from pathlib import Path

from ._errors import InvalidRequest
from .protocol import MAX_BUILD_CONTEXT_BYTES, BuildImageRequest


def build_request(name: str, dockerfile: str | os.PathLike | None, dockerfile_text: str | None,
                  context: str | os.PathLike | None, **options) -> BuildImageRequest:
    """The request for image ``name``: the Dockerfile at ``dockerfile`` (its context: its
    directory unless ``context`` names one) or the text ``dockerfile_text`` (context: none, or
    ``context``)."""
    if (dockerfile is None) == (dockerfile_text is None):
        raise InvalidRequest("give dockerfile (a path) or dockerfile_text, not both or neither")
    if dockerfile is not None:
        path = Path(dockerfile)
        try:
            dockerfile_text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot read the Dockerfile {path}: {exc}") from None
        context = path.parent if context is None else context
    context_b64 = ""
    if context is not None:
        root = Path(context)
        if not root.is_dir():
            raise InvalidRequest(f"the build context {root} is not a directory")
        context_b64 = base64.b64encode(pack_context(root)).decode()
    return BuildImageRequest(name=name, dockerfile=dockerfile_text, context_b64=context_b64, **options)


def pack_context(root: Path) -> bytes:
    ignore = _ignore_patterns(root)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(dirnames + filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if _ignored(rel, ignore):
                    if name in dirnames:
                        dirnames.remove(name)
                    continue
                tar.add(os.path.join(dirpath, name), arcname=rel, recursive=False)
            if out.tell() > MAX_BUILD_CONTEXT_BYTES:
                raise InvalidRequest(f"the build context {root} is over {MAX_BUILD_CONTEXT_BYTES >> 20} MiB "
                                     "(leave out what the build does not copy with a .dockerignore)")
    return out.getvalue()


def _ignore_patterns(root: Path) -> list[tuple[bool, str]]:
    """``.dockerignore``'s patterns as (excluded, pattern); ``!`` lines bring paths back."""
    try:
        lines = (root / ".dockerignore").read_text().splitlines()
    except OSError:
        return []
    patterns = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
        patterns.append((not keep, pattern))
    return patterns


def _ignored(rel: str, patterns: list[tuple[bool, str]]) -> bool:
    excluded = False
    for exclude, pattern in patterns:
        if _matches(rel, pattern):
            excluded = exclude
    return excluded


def _matches(rel: str, pattern: str) -> bool:
    """A path matches when it, or a directory above it, matches (``**`` spans directories)."""
    parts = rel.split("/")
    for n in range(1, len(parts) + 1):
        head = "/".join(parts[:n])
        if fnmatch.fnmatchcase(head, pattern) or ("**" in pattern and fnmatch.fnmatchcase(head, pattern.replace("**/", "*"))):
            return True
    return False
