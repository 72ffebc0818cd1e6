"""The VM modules' server: one ``dsec serve`` a module, without a warm pool (VMs are made to
order), and a client of it that lives as long (the modules' tests share one event loop)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from libdsec import DSecClient


@pytest.fixture(scope="module")
def vm_server(request, tmp_path_factory, test_store):
    from dsec.local import serving

    from conftest import make_state_dir

    name = "dsec-" + request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "")
    with serving(make_state_dir(tmp_path_factory, test_store, name), "--pool-max", "0") as srv:
        yield srv


@pytest_asyncio.fixture(loop_scope="module")
async def client(vm_server):
    async with DSecClient(vm_server.endpoint, token=vm_server.token) as c:
        yield c
