"""A pytest plugin (``pytest_plugins`` in the root conftest): a test module whose own
``pytestmark`` already rules out every one of its tests under ``-m`` is not imported at all.

Why: ``make test-quick`` (``-m "not slow"``) deselects the kernel-level modules, but pytest
imports a module before it can read its marks, and those modules import what the quick tests
never need (inspect_ai, schemathesis, hypothesis, gymnasium, the peers' SDKs): a third of the
quick run's collection went there. The module marks are read from the source instead (its
top-level ``pytestmark = pytest.mark.X`` or a list of them), and the module is left out only
when the mark expression is false whatever marks its tests add; anything not read with
certainty (no ``pytestmark``, one made by a function, ``-m`` with keyword arguments) is
imported as before. The header says how many modules were left out."""

from __future__ import annotations

import ast
import fnmatch
import itertools
import re
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression  # the parser ``-m`` itself uses

_LEFT_OUT = pytest.StashKey[list[Path]]()
_IDENT = re.compile(r"[\w:+\-.\[\]\\/]+")
_MAX_FREE_MARKS = 8  # 2**8 evaluations at most per module: ``-m`` expressions are short


def module_marks(source: str) -> frozenset[str] | None:
    """The mark names a module's top-level ``pytestmark`` gives all its tests, or None when the
    module has none or it is not a plain ``pytest.mark.NAME[(…)]`` or a list/tuple of them."""
    marks = None
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                if not isinstance(statement, ast.Assign):
                    return None  # built up in steps: not read here
                marks = _mark_names(statement.value)
    return marks


def _mark_names(node: ast.expr) -> frozenset[str] | None:
    items = node.elts if isinstance(node, ast.List | ast.Tuple) else [node]
    names = set()
    for item in items:
        if isinstance(item, ast.Call):
            item = item.func
        if not (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Attribute)
                and item.value.attr == "mark" and isinstance(item.value.value, ast.Name)
                and item.value.value.id == "pytest"):
            return None
        names.add(item.attr)
    return frozenset(names)


def rules_out(markexpr: str, marks: frozenset[str]) -> bool:
    """Whether ``-m markexpr`` is false for every test that carries ``marks``, whichever other
    marks the test has (each of the expression's other names is tried present and absent)."""
    if "(" in markexpr and "=" in markexpr:
        return False  # marks with keyword arguments: their values are not read here
    expression = Expression.compile(markexpr)
    free = sorted(set(_IDENT.findall(markexpr)) - {"and", "or", "not"} - marks)
    if len(free) > _MAX_FREE_MARKS:
        return False
    for present in itertools.product((False, True), repeat=len(free)):
        others = {name for name, on in zip(free, present) if on}
        if expression.evaluate(lambda name, **_: name in marks or name in others):
            return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    markexpr = config.option.markexpr
    if not markexpr or collection_path.suffix != ".py" or not any(
            fnmatch.fnmatch(collection_path.name, pattern) for pattern in config.getini("python_files")):
        return None
    try:
        marks = module_marks(collection_path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None  # pytest's own import then says what is wrong
    if marks is None or not rules_out(markexpr, marks):
        return None
    config.stash.setdefault(_LEFT_OUT, []).append(collection_path)
    return True


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    left_out = config.stash.get(_LEFT_OUT, [])
    if left_out:
        return f"not imported: {len(left_out)} modules whose marks -m {config.option.markexpr!r} rules out"
    return None
