"""Sandbox ids name their node: ``<node>-<16 hex digits>``."""

from __future__ import annotations

import pytest

from dsec.edge.api import new_sandbox_id, node_of
from libdsec import InvalidRequest


@pytest.mark.parametrize(("sandbox_id", "node"), [
    ("n0-0123456789abcdef", "n0"),
    ("node7-ffffffffffffffff", "node7"),
    ("a" * 32 + "-0000000000000000", "a" * 32),
])
def test_node_of(sandbox_id, node):
    assert node_of(sandbox_id) == node


@pytest.mark.parametrize("sandbox_id", [
    "", "n0", "n0-", "-0123456789abcdef", "n0-0123456789abcde", "n0-0123456789abcdef0",
    "n0-0123456789ABCDEF", "N0-0123456789abcdef", "n0-0123456789abcdeg", "n0_0123456789abcdef",
    "n-0-0123456789abcdef", "a" * 33 + "-0123456789abcdef", "../n0-0123456789abcdef",
    "n0-0123456789abcdef\n", "n0-0123456789abcdef/..", " n0-0123456789abcdef", "n0-0123456789abcdef ",
])
def test_node_of_rejects_malformed_ids(sandbox_id):
    with pytest.raises(InvalidRequest, match="malformed sandbox id") as info:
        node_of(sandbox_id)
    assert repr(sandbox_id) in str(info.value)


def test_new_ids_parse_back_and_differ():
    ids = {new_sandbox_id("n3") for _ in range(1000)}
    assert len(ids) == 1000
    assert {node_of(i) for i in ids} == {"n3"}
