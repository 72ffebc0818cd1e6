"""``module_marks``: which test modules ``-m`` rules out from their source alone, and only those."""

from __future__ import annotations

import pytest

from module_marks import module_marks, rules_out


@pytest.mark.parametrize("source, marks", [
    ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.root]\n", {"slow", "root"}),
    ("pytestmark = pytest.mark.slow\n", {"slow"}),
    ('pytestmark = (pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"))\n', {"slow", "asyncio"}),
    ("pytestmark = [pytest.mark.root]\npytestmark = [pytest.mark.slow]\n", {"slow"}),  # the last one holds
])
def test_plain_module_marks_are_read(source, marks):
    assert module_marks(source) == marks


@pytest.mark.parametrize("source", [
    "def test_x(): pass\n",  # none
    "pytestmark = marks()\n",  # made by a function
    "pytestmark = [pytest.mark.slow]\npytestmark += [other]\n",  # built up in steps
    "if x:\n    pytestmark = pytest.mark.slow\n",  # not at the top level
    "pytestmark = [pytest.mark.slow, custom_mark]\n",
])
def test_what_is_not_read_with_certainty_is_none(source):
    assert module_marks(source) is None


@pytest.mark.parametrize("markexpr, marks, out", [
    ("not slow", {"slow", "root"}, True),
    ("not slow", {"root"}, False),
    ("not slow and not root", {"root"}, True),
    ("slow or cluster", {"root"}, False),  # a test of it may be marked cluster
    ("slow and not hostvm", {"slow"}, False),  # its tests need not be hostvm
    ("slow and not hostvm", {"slow", "hostvm"}, True),
    ("(not slow)", {"slow"}, True),
    ("not slow and platform(os='linux')", {"slow"}, False),  # keyword arguments: not read
])
def test_a_module_is_left_out_only_if_no_test_of_it_could_match(markexpr, marks, out):
    assert rules_out(markexpr, frozenset(marks)) is out
