"""Operations declared once: what a call is on the wire, for the ends that make and serve it.

An ``Operation`` names a method (on a seam or the SDK) and says how it crosses HTTP: the method
and path, the request's model and how it maps onto the method's arguments, the query
parameters, the answer's model and shape, and how long a caller waits for it. A table of them
is the single place an operation is written; the client methods and the server routes are made
from it when their modules are imported, so nothing is parsed or formatted from it per call.

Path templates name their parameters with a type: ``/sandboxes/{sandbox_id}/ptys/{pty:int}``.
The types are ``PARAM_TYPES``: each a regex for the route and a conversion for the value.
Query parameters use the same ``name:type`` spelling; a type the table's user gives meaning to
(``mode``, a file mode) is allowed there, and ``opt``: a string that may be left out (the
method gets None), ``count``: an integer from 0, 0 when left out, ``flag``: a boolean, false
when left out.

The shapes:

- request bodies: ``json`` (the request model), ``optional`` (the request model, or no body at
  all or ``null``: the method gets None, or a spread request's method its own defaults: an
  operation that took no body before its request had fields, so a client of then is still
  understood), ``bytes`` (the raw body, whole), ``stream`` (the raw
  body as chunks, read as they arrive), or none;
- answers: ``json`` (the answer model, or ``{"ok":true}`` for none), ``list`` (a JSON array
  of the answer model), ``bytes`` (a raw body),
  ``lines`` (an NDJSON stream of the answer model, one a line), ``chunks`` (raw bytes as they
  come), ``upgrade`` (the connection becomes a raw byte stream both ways);
- timeouts: ``call`` (the client's call bound), ``long`` (its long bound: packing a layer,
  saving a VM), ``own`` (the request's own ``timeout`` plus slack), or a number of seconds
  (plus slack; for a stream, the longest silence between two pieces; for a body streamed, the
  whole upload's bound, no slack).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel

BodyShape = Literal["json", "optional", "bytes", "stream"]
AnswerShape = Literal["json", "list", "bytes", "lines", "chunks", "upgrade"]
Timeout = Literal["call", "long", "own"] | float

# A path parameter's type: the regex its segment must match, and the value made from it.
PARAM_TYPES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "str": (r"[^/]+", str),
    "int": (r"[0-9]{1,9}", int),
    "port": (r"[0-9]{1,5}", int),
    "name": (r"[^/:]+", str),  # a segment with no ':' (one an action such as ':remove' follows)
    "key": (r"[A-Za-z0-9_-]{1,64}", str),
    "job": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", str),  # a job's name (``protocol.check_job_name``)
    "snapshot": (r"[a-z0-9][a-z0-9._-]{0,63}", str),  # a snapshot's id or name
}
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([a-z]+))?\}")


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of a table. ``name`` is the method it is on both ends."""

    name: str
    method: str  # GET, POST, PUT, …
    path: str  # a template: "/sandboxes/{sandbox_id}/processes/{pid:int}"
    request: type[BaseModel] | None = None
    # The request reaches the method whole, as the argument ``request_arg``, or (``spread``)
    # as keyword arguments, one per field of its model. A raw body is passed as ``request_arg``.
    spread: bool = False
    request_arg: str = "request"
    body: BodyShape | None = None  # none: "json" with a request model, no body without one
    query: tuple[str, ...] = ()  # "name" or "name:type", each an argument of the method
    answer: type[BaseModel] | None = None  # none: {"ok":true} (a json answer) or raw bytes
    unwrap: str | None = None  # the answer model's field the method returns (a list's models)
    answers: AnswerShape = "json"
    timeout: Timeout = "call"
    # For the public table: the lifecycle action the call is checked against, and how the
    # call is kept in a job's log. None for the node's operations.
    lifecycle: str | None = None
    journal: str | None = None
    # For the public table: who serves the call. ``node``: the ``EdgeAPI`` method of its name,
    # on the sandbox's node (any node for an image call); ``apiserver``: the apiserver's own
    # method of its name (``dsec.apiserver.calls``), given the caller first — a call with more
    # to it than one node call (a catalogue filtered by project, projects, jobs, many nodes).
    served: Literal["node", "apiserver"] = "node"

    @property
    def body_shape(self) -> BodyShape | None:
        return self.body or ("json" if self.request is not None else None)

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        """The path's parameters, in order, as (name, type)."""
        return tuple((name, kind or "str") for name, kind in _PARAM.findall(self.path))

    @property
    def query_params(self) -> tuple[tuple[str, str], ...]:
        """The query's parameters as (name, type)."""
        return tuple((q.partition(":")[0], q.partition(":")[2] or "str") for q in self.query)


def path_regex(template: str, prefix: str = "") -> re.Pattern[str]:
    """A regex matching the paths of ``template`` (after ``prefix``) whole, one named group a
    parameter; an unknown parameter type is a ``ValueError``."""
    out, at = [], 0
    for m in _PARAM.finditer(template):
        kind = m.group(2) or "str"
        if kind not in PARAM_TYPES:
            raise ValueError(f"unknown path parameter type {kind!r} in {template!r}")
        out += [re.escape(template[at:m.start()]), f"(?P<{m.group(1)}>{PARAM_TYPES[kind][0]})"]
        at = m.end()
    out.append(re.escape(template[at:]))
    return re.compile(re.escape(prefix) + "".join(out) + r"\Z")


def path_format(template: str) -> str:
    """``template`` as a ``str.format`` string: ``path_format(t).format_map(arguments)``."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", template)


def format_path(template: str, **arguments: object) -> str:
    """The path of ``template`` for these arguments (each formatted with ``str``)."""
    return path_format(template).format_map(arguments)
