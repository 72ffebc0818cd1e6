"""schemathesis against the OpenAPI document of a live ``dsec serve``: requests generated from
each operation's schema (valid and invalid ones) get no server error (5xx), and every answer
matches the schema the document gives for its status. Bounded for CI: a few examples an
operation, one server of the test's own.

Left out: what would change the layer store, which the test servers share with other runs
(removing an image, the layer gc), and VM creates (a TCG boot each)."""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from dsec.local import LocalServer, leftovers

pytestmark = [pytest.mark.slow, pytest.mark.root]

EXAMPLES = 8  # an operation (about 60 operations; fewer where the schema allows fewer)
LEFT_OUT = [("DELETE", "/v1/images/{name}"), ("POST", "/v1/images:gc"), ("POST", "/v1/microvms"),
            ("POST", "/v1/vms")]


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_store):
    state = tmp_path_factory.mktemp("dsec-fuzz")
    (state / "store").symlink_to(test_store)
    srv = LocalServer(state, extra_args=("--pool-max", "2"), env={"DSEC_VMS": "0"}).start()
    try:
        yield srv
    finally:
        srv.stop_sandboxes()
        srv.stop()
    assert not leftovers(state), leftovers(state)


def test_no_server_error_and_every_answer_matches_its_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.endpoint}/openapi.json")
    for method, path in LEFT_OUT:
        schema = schema.exclude(method=method, path=path)
    headers = {"authorization": f"Bearer {server.token}"}
    failures: list[str] = []
    tried = 0
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            nonlocal tried
            tried += 1
            case.call_and_validate(base_url=server.endpoint, headers=headers, timeout=60,
                                   checks=[not_a_server_error, response_schema_conformance])

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - gathered over every operation, reported together
            failures.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:600]}")
    print(f"schemathesis: {tried} requests over the operations in {time.monotonic() - started:.1f} s")
    assert tried > 100
    assert not failures, "\n".join(sorted(set(failures))[:20])
