# e2b_sdk/ is E2B-only code run by test_e2b.py in a pytest of its own, under each e2b release's
# own Python environment (it imports nothing of DSec's): not part of this collection.
collect_ignore = ["e2b_sdk"]

import os  # noqa: E402

import pytest  # noqa: E402

from libdsec import SyncDSecClient  # noqa: E402


@pytest.fixture(scope="module")
def e2b_settings(server):
    """The e2b SDK pointed at ``server`` with a root E2B key: its settings, which are environment
    variables, set for the module and put back after."""
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        key = client.create_project_token("root", e2b=True)
    settings = {"E2B_API_URL": f"{server.endpoint}/e2b", "E2B_SANDBOX_URL": f"{server.endpoint}/e2b/envd",
                "E2B_API_KEY": key}
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    yield settings
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
