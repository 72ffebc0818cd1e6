"""The sync twin cannot drift: ``twin_of`` checks each blocking class when libdsec is imported."""

from __future__ import annotations

import inspect

import pytest

import libdsec
from libdsec import _client, _files, _process, _pty, _sync
from libdsec._twin import twin_of

PAIRS = [(_client.DSecClient, _sync.SyncDSecClient), (_client.Sandbox, _sync.SyncSandbox),
         (_process.Process, _sync.SyncProcess), (_process.Session, _sync.SyncSession),
         (_files.SandboxFiles, _sync.SyncFiles), (_pty.Pty, _sync.SyncPty)]


@pytest.mark.parametrize("original, twin", PAIRS, ids=[t.__name__ for _, t in PAIRS])
def test_every_public_method_has_its_blocking_twin(original, twin):
    methods = [n for n in dir(original) if not n.startswith("_") and inspect.isfunction(inspect.getattr_static(original, n))
               and n not in twin.__twin_not_here__]
    assert methods
    for name in methods:
        mine = getattr(twin, name)
        assert mine.__twin_of__ is inspect.getattr_static(original, name), name
        assert mine.__doc__ == (mine.__twin_of__.__doc__ if mine.__doc__ is None else mine.__doc__)
        ours = list(inspect.signature(mine).parameters)
        assert ours == list(inspect.signature(mine.__twin_of__).parameters), name


def test_the_twin_shows_the_real_parameters_and_docs():
    signature = inspect.signature(libdsec.SyncSandbox.run_shell)
    assert {"timeout", "env", "workdir", "user", "on_stdout"} <= set(signature.parameters)
    assert signature.return_annotation in ("ExecResult", libdsec.ExecResult)
    assert libdsec.SyncSandbox.run_shell.__doc__ == libdsec.Sandbox.run_shell.__doc__
    assert libdsec.SyncDSecClient.node_info.__doc__ == libdsec.DSecClient.node_info.__doc__


class _Async:
    async def run(self, command, *, timeout=60.0):
        """Run it."""

    async def stop(self):
        """Stop it."""

    @property
    def status(self):
        return "running"


def _twin(**methods):
    return type("Twin", (), methods)


def test_a_missing_method_is_refused():
    with pytest.raises(TypeError, match=r"Twin.stop is missing"):
        twin_of(_Async)(_twin(run=lambda self, command, **kw: None, status=property(lambda self: 1)))


def test_a_parameter_that_drifted_is_refused():
    def run(self, command, timeout=30.0):  # another default, and positional
        pass

    with pytest.raises(TypeError, match=r"parameter 'timeout' does not match"):
        twin_of(_Async)(_twin(run=run, stop=lambda self: None, status=property(lambda self: 1)))


def test_a_parameter_the_twin_cannot_pass_on_is_refused():
    def run(self):  # no command, and nothing that hands on the rest
        pass

    with pytest.raises(TypeError, match=r"parameter 'command' is missing"):
        twin_of(_Async)(_twin(run=run, stop=lambda self: None, status=property(lambda self: 1)))


def test_a_property_must_stay_a_property():
    def status(self):
        pass

    with pytest.raises(TypeError, match=r"Twin.status must be a property"):
        twin_of(_Async)(_twin(run=lambda self, command, **kw: None, stop=lambda self: None, status=status))


def test_a_matching_twin_gets_the_originals_docs():
    def run(self, command, **kwargs):
        pass

    twin = twin_of(_Async)(_twin(run=run, stop=lambda self: None, status=property(lambda self: 1)))
    assert twin.run.__doc__ == "Run it." and "timeout" in inspect.signature(twin.run).parameters


class Sandbox:  # a twinned answer, by name, as the SDK's
    pass


class _Answers:
    async def get(self, key: str, *, default: int = 0) -> int:
        """Get it."""
        return {"a": 1}.get(key, default)

    async def child(self) -> Sandbox:
        """A new object, which has a twin of its own: wrapped by hand."""
        return Sandbox()


def test_a_call_that_only_waits_is_made_for_the_twin_with_its_docs_and_signature():
    def init(self, inner):
        import asyncio

        self._inner, self._run = inner, asyncio.run

    def child(self):
        return "wrapped by hand"

    twin = twin_of(_Answers, forward="_inner")(_twin(__init__=init, child=child))
    assert twin.get.__doc__ == "Get it." and twin.get.__twin_of__ is _Answers.get
    assert list(inspect.signature(twin.get).parameters) == ["self", "key", "default"]
    made = twin(_Answers())
    assert (made.get("a"), made.get("b"), made.get("b", default=7)) == (1, 0, 7)
    assert made.child() == "wrapped by hand"


def test_a_call_answering_a_twinned_object_is_never_forwarded():
    with pytest.raises(TypeError, match=r"Twin.child is missing"):
        twin_of(_Answers, forward="_inner")(_twin())
