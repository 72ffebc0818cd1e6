"""The DSec server comes from the environment (``E2B_API_URL`` …): set by tests/compat/test_e2b.py."""

from __future__ import annotations

import os

import pytest

TEMPLATE = os.environ.get("DSEC_E2B_TEMPLATE", "python")


@pytest.fixture(scope="module")
def sandbox():
    from e2b import Sandbox

    sb = Sandbox.create(template=TEMPLATE, timeout=300)
    yield sb
    sb.kill()
