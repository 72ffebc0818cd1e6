"""The records of a node's live sandboxes, in one append-only file.

An edge writes a sandbox's record when it comes up and whenever it changes (pause, resume),
and drops it when the sandbox is gone; on restart it reads them back to re-adopt what still
runs. Each change is one line appended to ``records.log``: ``+ID JSON`` puts a record (the
last one for an id wins), ``-ID`` drops it. That is one ``write`` a change, where a file per
record took four system calls (open, write, close, rename) on every create and one on every
stop. The file is rewritten with only the live records when it is opened and whenever lines
that no longer count (dropped, or put again) outnumber live ones; the rewrite goes to a new file
renamed over the old, so a crash leaves one whole file or the other. A line cut short (a crash
in the middle of its write) is skipped on reading, with a warning. A write that fails (ENOSPC:
the disk is full) raises ``OSError`` and changes nothing: what it wrote of its line is cut off
again, so the next line does not join it; a rewrite that fails is tried again later.

``RecordJournal(directory)``; ``load()`` once, before any change, returns ``{id: JSON}``
(``read(directory)`` returns the same without touching the file);
``put(id, json)``, ``drop(id)``; ``close()`` ends it (a second call does nothing, and a change
after it opens the file again). Records left as one file each (``ID.json``) by an earlier
version are read by ``load()`` and folded into the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("dsec.edge.journal")

_NAME = "records.log"


def read(directory: Path | str) -> dict[str, str]:
    """The records in ``directory``'s log, ``{id: JSON}``, read and nothing more (a live edge
    may be writing it: a line it has not finished is skipped)."""
    path = Path(directory) / _NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    live: dict[str, str] = {}
    for number, raw in enumerate(data.splitlines(), 1):
        line = raw.decode(errors="replace")
        op, rest = line[:1], line[1:]
        if op == "+" and " " in rest:
            sandbox_id, text = rest.split(" ", 1)
            live[sandbox_id] = text
        elif op == "-" and rest:
            live.pop(rest, None)
        else:
            log.warning("skipping a damaged line (%d) of %s: %.80r", number, path, line)
    return live


class RecordJournal:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / _NAME
        self._live: dict[str, str] = {}
        self._lines = 0  # lines in the file now
        self._fd: int | None = None

    def load(self) -> dict[str, str]:
        """The live records, ``{id: JSON}``, from the log and any older one-file records; the
        log is then rewritten with just these."""
        live: dict[str, str] = {}
        legacy = sorted(self.directory.glob("*.json"))
        for path in legacy:
            try:
                live[path.stem] = path.read_text()
            except OSError as exc:
                log.warning("dropping unreadable record %s: %s", path, exc)
        live.update(read(self.directory))
        self._live = live
        try:
            self._rewrite()
        except OSError as exc:  # a full disk: the log as it is still says all (appends may fail)
            log.warning("cannot rewrite %s: %s", self.path, exc)
            return dict(live)
        for path in legacy:
            path.unlink(missing_ok=True)
        return dict(live)

    def put(self, sandbox_id: str, text: str) -> None:
        if "\n" in text:
            raise ValueError("a record is one line of JSON")
        before = self._live.get(sandbox_id)
        self._live[sandbox_id] = text
        try:
            self._append(f"+{sandbox_id} {text}\n")
        except OSError:
            if before is None:
                del self._live[sandbox_id]
            else:
                self._live[sandbox_id] = before
            raise

    def drop(self, sandbox_id: str) -> None:
        if self._live.pop(sandbox_id, None) is None:
            return
        self._append(f"-{sandbox_id}\n")

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _append(self, line: str) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        data = line.encode()
        written = 0
        try:
            while written < len(data):  # a short write: the disk filled in the middle of the line
                written += os.write(self._fd, data[written:])
        except OSError:
            if written:  # cut what there is of it off again, or the next line would join it
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
            raise
        self._lines += 1
        if self._lines > 2 * len(self._live) + 256:  # mostly lines that no longer count
            try:
                self._rewrite()
            except OSError as exc:  # the line is written; the file is only longer than it needs be
                log.warning("cannot rewrite %s (tried again later): %s", self.path, exc)
                self._lines = len(self._live)

    def _rewrite(self) -> None:
        tmp = self.directory / f".{_NAME}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = memoryview("".join(f"+{i} {t}\n" for i, t in self._live.items()).encode())
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        self.close()  # the next change appends to the new file
        self._lines = len(self._live)
