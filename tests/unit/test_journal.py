"""The edge's records log: puts and drops survive a reopen, the last put wins, a damaged line
is skipped, the file is compacted, and records left one file each by an earlier version load."""

from __future__ import annotations

import json

import pytest

from dsec.edge.journal import RecordJournal


def test_puts_and_drops_survive_a_reopen(tmp_path):
    j = RecordJournal(tmp_path)
    assert j.load() == {}
    j.put("n0-a", json.dumps({"v": 1}))
    j.put("n0-b", json.dumps({"v": 2}))
    j.put("n0-a", json.dumps({"v": 3}))
    j.drop("n0-b")
    j.drop("n0-b")  # a second drop writes nothing
    j.close()
    j.close()
    again = RecordJournal(tmp_path)
    assert again.load() == {"n0-a": json.dumps({"v": 3})}
    # load rewrote the file with the live record alone
    assert (tmp_path / "records.log").read_text() == '+n0-a {"v": 3}\n'


def test_a_change_after_close_opens_the_file_again(tmp_path):
    j = RecordJournal(tmp_path)
    j.load()
    j.close()
    j.put("n0-a", "{}")
    j.close()
    assert RecordJournal(tmp_path).load() == {"n0-a": "{}"}


def test_a_damaged_line_is_skipped(tmp_path):
    (tmp_path / "records.log").write_text('+n0-a {"v": 1}\ngarbage\n+n0-b\n-\n+n0-c {"v": 2}\n+n0-d {"v"')
    loaded = RecordJournal(tmp_path).load()
    # a cut-short last line keeps what it has: Record.from_json then refuses it and the edge drops it
    assert loaded == {"n0-a": '{"v": 1}', "n0-c": '{"v": 2}', "n0-d": '{"v"'}


def test_dropped_lines_are_compacted_away(tmp_path):
    j = RecordJournal(tmp_path)
    j.load()
    j.put("n0-keep", "{}")
    for i in range(400):
        j.put(f"n0-{i}", "{}")
        j.drop(f"n0-{i}")
    lines = (tmp_path / "records.log").read_text().splitlines()
    assert len(lines) < 300, len(lines)  # rewritten on the way, not 801 lines
    j.close()
    assert RecordJournal(tmp_path).load() == {"n0-keep": "{}"}


def test_one_file_records_of_an_earlier_version_are_folded_in(tmp_path):
    (tmp_path / "n0-old.json").write_text('{"id": "n0-old"}')
    j = RecordJournal(tmp_path)
    assert j.load() == {"n0-old": '{"id": "n0-old"}'}
    assert not (tmp_path / "n0-old.json").exists()
    j.close()
    assert RecordJournal(tmp_path).load() == {"n0-old": '{"id": "n0-old"}'}


def test_a_record_is_one_line(tmp_path):
    j = RecordJournal(tmp_path)
    j.load()
    with pytest.raises(ValueError, match="one line"):
        j.put("n0-a", "{\n}")


def test_records_put_again_are_compacted_away(tmp_path):
    """A sandbox paused and resumed over and over puts its record each time."""
    j = RecordJournal(tmp_path)
    j.load()
    for i in range(600):
        j.put("n0-a", f'{{"v": {i}}}')
    assert len((tmp_path / "records.log").read_text().splitlines()) < 300
    j.close()
    assert RecordJournal(tmp_path).load() == {"n0-a": '{"v": 599}'}


@pytest.mark.root
def test_a_full_disk_fails_a_put_and_changes_nothing(tmp_path):
    import errno
    import subprocess

    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "small", str(disk)], check=True)
    try:
        j = RecordJournal(disk)
        j.load()
        kept = {}
        for n in range(100):  # 700-byte records into 16 KiB: the disk fills within a line
            text = json.dumps({"n": n, "pad": "x" * 700})
            try:
                j.put(f"n0-{n}", text)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
            kept[f"n0-{n}"] = text
        else:
            raise AssertionError("the disk never filled")
        assert (disk / "records.log").read_bytes().endswith(b"\n")  # the cut line was taken back
        assert j._live == kept
        j.drop(next(iter(kept)))  # a drop line is short: it fits in what the cut line left
        kept.pop(next(iter(kept)))
        j.close()
        assert RecordJournal(disk).load() == kept
    finally:
        subprocess.run(["umount", str(disk)], check=True)
