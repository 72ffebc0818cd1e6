"""The density arm's own parts (``dsec_bench.desktop_density``), without a server: the end-to-end
run is in test_desktop_bench.py."""

from __future__ import annotations

from dsec_bench.desktop_density import cgroup_memory, png_size


def test_png_size_reads_the_header_and_refuses_what_is_not_a_png() -> None:
    header = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + (1280).to_bytes(4, "big") + (800).to_bytes(4, "big")
    assert png_size(header + b"\x08\x02\x00\x00\x00") == (1280, 800)
    assert png_size(b"GIF89a" + header[6:]) is None and png_size(header[:20]) is None


def test_cgroup_memory_of_a_missing_cgroup_is_nothing() -> None:
    assert cgroup_memory("dsec-no-such-cgroup-for-this-test") == (0, 0)
