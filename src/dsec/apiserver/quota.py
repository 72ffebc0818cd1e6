"""Quota arithmetic over the project tree. Pure functions; the store and the apiserver call them.

Every project has, per resource (sandboxes, CPU cores, memory MB), a cap or ``None``. A project
with a cap *holds* quota; one without draws from its nearest ancestor that holds some (the root
has no cap unless one is set: then only node capacity bounds it).

A holder's *pool* is itself and the descendants that draw from it. Quota a holder hands to a
child with a cap of its own is reserved for that child, so:

- delegation: the caps of the projects carved out of a pool add up to at most the holder's
  cap (a child cannot be given more than its parent has left to hand out);
- a create in project p, drawing from holder h: what h's pool uses, plus the request, stays
  within h's cap minus what h has handed out.

Both checks raise ``QuotaExceeded`` with a message naming the project, the resource and the
numbers. Sandboxes already running are never stopped by a lower quota; new ones are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from libdsec import QuotaExceeded

RESOURCES = ("sandboxes", "cpu_cores", "memory_mb")
UNITS = {"sandboxes": "sandboxes", "cpu_cores": "cores", "memory_mb": "MB"}
ROOT = "root"


@dataclass(frozen=True)
class Amount:
    """An amount of every resource (a request, a usage, or what was handed out)."""

    sandboxes: float = 0
    cpu_cores: float = 0.0
    memory_mb: float = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(*(getattr(self, r) + getattr(other, r) for r in RESOURCES))

    def __sub__(self, other: Amount) -> Amount:
        return Amount(*(getattr(self, r) - getattr(other, r) for r in RESOURCES))

    def times(self, n: int) -> Amount:
        return Amount(*(getattr(self, r) * n for r in RESOURCES))

    def get(self, resource: str) -> float:
        return getattr(self, resource)


@dataclass(frozen=True)
class Project:
    name: str
    parent: str | None
    # Caps by resource name; a missing or None cap: no cap of its own.
    caps: Mapping[str, float | None] = field(default_factory=dict)

    def cap(self, resource: str) -> float | None:
        return self.caps.get(resource)


class Tree:
    """The project tree, by name (one root, named ``root``)."""

    def __init__(self, projects: Iterable[Project]) -> None:
        self.projects = {p.name: p for p in projects}
        self.children: dict[str, list[str]] = {name: [] for name in self.projects}
        for p in self.projects.values():
            if p.parent is not None:
                self.children.setdefault(p.parent, []).append(p.name)
        for kids in self.children.values():
            kids.sort()
        self._limited: dict[str, bool] = {}  # a tree is not changed once made (``with_project`` copies)

    def __contains__(self, name: str) -> bool:
        return name in self.projects

    def ancestors(self, name: str) -> list[str]:
        """``name`` and its ancestors, nearest first."""
        chain = []
        current: str | None = name
        while current is not None:
            chain.append(current)
            current = self.projects[current].parent
            if len(chain) > len(self.projects):
                raise ValueError(f"cycle in the project tree at {name!r}")
        return chain

    def path(self, name: str) -> str:
        return "/".join(reversed(self.ancestors(name)))

    def subtree(self, name: str) -> set[str]:
        """``name`` and every project below it."""
        found, todo = set(), [name]
        while todo:
            current = todo.pop()
            found.add(current)
            todo.extend(self.children.get(current, ()))
        return found

    def with_project(self, project: Project) -> Tree:
        """A copy with ``project`` added or replaced."""
        return Tree([*(p for p in self.projects.values() if p.name != project.name), project])

    # -- pools ---------------------------------------------------------------------------

    def holder(self, name: str, resource: str) -> str | None:
        """The project whose cap ``name`` draws from for ``resource`` (itself if it has one)."""
        for p in self.ancestors(name):
            if self.projects[p].cap(resource) is not None:
                return p
        return None

    def limited(self, name: str) -> bool:
        """Whether any cap (its own or an ancestor's) limits ``name``; remembered per tree."""
        known = self._limited.get(name)
        if known is None:
            known = self._limited[name] = any(self.holder(name, r) is not None for r in RESOURCES)
        return known

    def pool(self, holder: str, resource: str) -> set[str]:
        """``holder`` and the descendants that draw from its cap."""
        found, todo = {holder}, list(self.children.get(holder, ()))
        while todo:
            current = todo.pop()
            if self.projects[current].cap(resource) is None:
                found.add(current)
                todo.extend(self.children.get(current, ()))
        return found

    def carved(self, holder: str, resource: str) -> list[str]:
        """Projects with a cap of their own whose parent is in ``holder``'s pool: the quota
        ``holder`` has handed out."""
        pool = self.pool(holder, resource)
        return sorted(
            child for member in pool for child in self.children.get(member, ())
            if self.projects[child].cap(resource) is not None
        )

    def handed_out(self, holder: str) -> Amount:
        """Per resource, the sum of the caps carved out of ``holder``'s pool (0 where
        ``holder`` has no cap of its own)."""
        values = []
        for r in RESOURCES:
            if self.projects[holder].cap(r) is None:
                values.append(0)
            else:
                values.append(sum(self.projects[c].cap(r) or 0 for c in self.carved(holder, r)))
        return Amount(*values)


def _fmt(resource: str, value: float) -> str:
    if resource == "cpu_cores":
        return f"{value:g} {UNITS[resource]}"
    return f"{int(round(value))} {UNITS[resource]}"


def check_tree(tree: Tree) -> None:
    """Raise ``QuotaExceeded`` where the caps carved out of a pool add up to more than the
    holder's cap."""
    for name, project in sorted(tree.projects.items()):
        for r in RESOURCES:
            cap = project.cap(r)
            if cap is None:
                continue
            if cap < 0:
                raise QuotaExceeded(f"project {name!r}: {r} quota must be >= 0, not {cap}")
            carved = tree.carved(name, r)
            total = sum(tree.projects[c].cap(r) or 0 for c in carved)
            if total > cap + 1e-9:
                shares = ", ".join(f"{c} {_fmt(r, tree.projects[c].cap(r) or 0)}" for c in carved)
                raise QuotaExceeded(
                    f"quota exceeded: project {name!r} has a {r} quota of {_fmt(r, cap)} but its "
                    f"sub-projects would be handed {_fmt(r, total)} ({shares})"
                )


def check_create(tree: Tree, usage: Mapping[str, Amount], project: str, request: Amount) -> None:
    """Raise ``QuotaExceeded`` unless ``request`` (one sandbox or a batch) fits ``project``'s
    quota. ``usage`` maps each project to what its own sandboxes hold (not its descendants')."""
    for r in RESOURCES:
        want = request.get(r)
        if want <= 0:
            continue
        holder = tree.holder(project, r)
        if holder is None:
            continue
        cap = tree.projects[holder].cap(r) or 0
        handed = sum(tree.projects[c].cap(r) or 0 for c in tree.carved(holder, r))
        used = sum(usage[p].get(r) for p in tree.pool(holder, r) if p in usage)
        if used + want > cap - handed + 1e-9:
            whose = f"project {project!r}" if holder == project else f"project {project!r} (drawing on {holder!r})"
            detail = f"{_fmt(r, used)} in use"
            if handed:
                detail += f", {_fmt(r, handed)} handed to sub-projects"
            raise QuotaExceeded(
                f"quota exceeded: {whose} asks for {_fmt(r, want)} more but the {r} quota of "
                f"{holder!r} is {_fmt(r, cap)} ({detail})"
            )
