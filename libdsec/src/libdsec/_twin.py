"""The rule that keeps the sync twin from drifting: checked when the module is imported.

``@twin_of(Sandbox)`` on a blocking class checks it against its async original: every public
method and property of the original has a blocking one of the same name; each blocking method
takes what the original takes (its own parameters are the original's, by name, kind and
default; the original's parameters it does not name are ones with a default, which its
``**kwargs`` hands on); and it gets the original's docstring and signature (with its own return
annotation), so ``help()`` and IDEs show the real parameters. A twin that does not match is a
``TypeError`` at import, not a surprise at a user's call.

A call that only waits for the original's answer needs no twin written: with ``forward`` (the
attribute holding the async original), every coroutine method the blocking class leaves out is
made for it, as ``self._run(original.method(...))`` with the original's docstring and signature,
unless its answer is one of the objects that have twins of their own (``TWINNED``): those the
blocking class wraps by hand.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)

# The async objects with blocking twins: a call answering one is wrapped by hand, never forwarded.
TWINNED = ("DSecClient", "Sandbox", "SandboxFiles", "Process", "Session", "Pty", "DirWatch")
_TWINNED = re.compile(r"\b(" + "|".join(TWINNED) + r")\b")


def _forwarder(name: str, inner: str, original: Callable[..., Any]) -> Callable[..., Any] | None:
    """A blocking method that runs ``original`` on the twin's loop and hands back its answer;
    None when the original is not a plain coroutine method or answers a twinned object."""
    if not inspect.iscoroutinefunction(original):
        return None
    answer = inspect.signature(original).return_annotation
    if _TWINNED.search(answer if isinstance(answer, str) else getattr(answer, "__name__", repr(answer))):
        return None

    def method(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(getattr(self, inner), name)(*args, **kwargs))

    method.__name__ = name
    method.__module__ = original.__module__  # where the names of its annotations are found
    method.__doc__ = original.__doc__
    method.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    method.__twin_of__ = original  # type: ignore[attr-defined]
    return method


def _public(cls: type) -> dict[str, Any]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def _check(sync_name: str, method: Callable[..., Any], original: Callable[..., Any]) -> None:
    ours = list(inspect.signature(method).parameters.values())[1:]
    theirs = {p.name: p for p in list(inspect.signature(original).parameters.values())[1:]}
    forwards = any(p.kind is p.VAR_KEYWORD for p in ours)
    named = set()
    for p in ours:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        named.add(p.name)
        other = theirs.get(p.name)
        if other is None or other.kind != p.kind or other.default != p.default:
            raise TypeError(f"{sync_name}: parameter {p.name!r} does not match the async original's "
                            f"({other if other is not None else 'no such parameter'})")
    for p in theirs.values():
        if p.name in named or p.kind is p.VAR_POSITIONAL:
            continue
        if p.kind is p.VAR_KEYWORD:
            if not forwards:
                raise TypeError(f"{sync_name}: the async original takes **{p.name}; the twin must hand them on")
        elif p.default is p.empty or not forwards:
            raise TypeError(f"{sync_name}: the async original's parameter {p.name!r} is missing")


def twin_of(original: type, *, not_here: tuple[str, ...] = (), forward: str | None = None) -> Callable[[C], C]:
    """Check a blocking class against ``original`` and give its methods the original's docs.

    ``not_here``: public names of the original with no blocking twin, on purpose. ``forward``:
    the attribute of the blocking object that holds the async one, for the calls made for it."""

    def check(twin: C) -> C:
        ours = _public(twin)
        for name, member in _public(original).items():
            label = f"{twin.__name__}.{name}"
            if name in not_here:
                continue
            if name not in ours and forward is not None and inspect.isfunction(member) \
                    and (made := _forwarder(name, forward, member)) is not None:
                made.__qualname__ = f"{twin.__name__}.{name}"
                setattr(twin, name, made)
                continue
            if name not in ours:
                raise TypeError(f"{label} is missing: the sync twin has every public member of {original.__name__}")
            mine = ours[name]
            if isinstance(member, property):
                if not isinstance(mine, property):
                    raise TypeError(f"{label} must be a property, as {original.__name__}.{name} is")
                continue
            if isinstance(member, (staticmethod, classmethod)) or not inspect.isfunction(member):
                continue
            if not inspect.isfunction(mine):
                raise TypeError(f"{label} must be a method, as {original.__name__}.{name} is")
            if getattr(mine, "__twin_of__", None) is member:
                continue  # a method shared by two twins (a mixin), already done
            _check(label, mine, member)
            mine.__doc__ = mine.__doc__ or member.__doc__
            signature = inspect.signature(member)
            mine.__signature__ = signature.replace(return_annotation=inspect.signature(mine).return_annotation)
            mine.__twin_of__ = member
        twin.__twin_not_here__ = frozenset(not_here)
        return twin

    return check
