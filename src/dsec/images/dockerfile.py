"""Dockerfiles as DSec builds. ``plan(text, context, build_args)`` reads a Dockerfile into a
``BuildPlan``: the image it starts from, its steps, the config the image ends with, and the
content key that names the result (the Dockerfile's steps, the build args they use and the bytes
of every context file they copy). It does no I/O but reading the context; the node runs the
plan (``dsec.edge.build``) in a sandbox of the base image and packs what the steps changed.

What maps: FROM (a DSec image of that name, else a registry reference), RUN (shell and exec
forms, run with the ENV, WORKDIR, USER and SHELL so far), COPY and ADD of context files (globs,
directories' contents, ``--chown``; ADD unpacks a local tar archive), ENV, ARG (``build_args``
override the defaults), WORKDIR, USER, SHELL. The image keeps ENV, WORKDIR and USER. Noted and
ignored: CMD, ENTRYPOINT, EXPOSE, LABEL, VOLUME, STOPSIGNAL, HEALTHCHECK, MAINTAINER. Refused,
naming the line: a second FROM or ``COPY --from`` (multi-stage builds), ADD of a URL, ONBUILD,
heredocs, a source outside the context or matching nothing, and any other instruction.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path

from libdsec import ImageBuildFailed

MAX_DOCKERFILE_BYTES = 1 << 20
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # docker's, for a base with none
IGNORED = frozenset({"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER"})
_VARIABLE = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}"
                       r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_FLAG = re.compile(r"^--(?P<name>[a-z-]+)(?:=(?P<value>.*))?$")


class DockerfileError(ImageBuildFailed):
    """A Dockerfile DSec cannot build, naming the line."""


@dataclass(frozen=True)
class Run:
    """A RUN step: ``command`` for ``sh -c`` (exec forms and SHELL already folded in)."""

    command: str
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str
    line: int
    text: str


@dataclass(frozen=True)
class Copy:
    """A COPY or ADD step: context files (relative paths) into ``dest`` (absolute). With
    ``into_dir`` each source lands under ``dest`` by its own name (a directory: its contents);
    else the one source file becomes ``dest``. ``unpack``: an ADD of a local tar archive."""

    sources: tuple[str, ...]
    dest: str
    into_dir: bool
    chown: str | None
    unpack: bool
    line: int
    text: str


@dataclass
class BuildPlan:
    base: str
    steps: list[Run | Copy] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # what the Dockerfile set (over the base's)
    workdir: str | None = None
    user: str | None = None
    notes: list[str] = field(default_factory=list)
    key: str = ""  # hex sha256 of everything the result depends on but the base's layers


def plan(text: str, context: Path, build_args: dict[str, str] | None = None,
         base_env: dict[str, str] | None = None, keyed: bool = True) -> BuildPlan:
    """The plan of the Dockerfile ``text`` over the build ``context`` (``DockerfileError``
    naming the line for anything DSec does not build). ``base_env``: the FROM image's ENV,
    which ``$NAME`` in the Dockerfile's own words sees as docker's builder does (``ENV
    PATH=/opt/venv/bin:$PATH``); PATH is docker's default when the base sets none. Without
    ``keyed`` the copied files are not read for the key (a first look, to check the Dockerfile
    and learn its base)."""
    from dockerfile_parse import DockerfileParser

    if len(text.encode()) > MAX_DOCKERFILE_BYTES:
        raise DockerfileError(f"the Dockerfile is over {MAX_DOCKERFILE_BYTES >> 20} MiB")
    if re.search(r"^\s*(RUN|COPY|ADD)\b[^\n]*<<-?\s*['\"]?[A-Za-z_]", text, re.MULTILINE | re.IGNORECASE):
        raise DockerfileError("heredocs (RUN <<EOF) are not supported: put the script in a file and COPY it")
    try:
        parsed = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False).structure
    except Exception as exc:  # noqa: BLE001 - the parser's own errors name no type of ours
        raise DockerfileError(f"the Dockerfile does not parse: {exc}") from None
    build_args = dict(build_args or {})
    args: dict[str, str] = {}  # ARGs in scope, with their values (RUN steps see them as env)
    global_args: dict[str, str] = {}  # those declared before FROM: for FROM, and as defaults after
    env: dict[str, str] = {}
    inherited = {"PATH": DEFAULT_PATH, **(base_env or {})} if base_env is not None else {}
    result: BuildPlan | None = None
    workdir, user, shell = "/", "root", ["/bin/sh", "-c"]
    used_args: dict[str, str] = {}
    declared: set[str] = set()
    for item in parsed:
        instruction, value, line = item["instruction"].upper(), item["value"], item["startline"] + 1
        where = f"line {line} ({item['content'].strip()[:80]!r})"

        def expand(word: str) -> str:
            return _expand(word, {**args, **inherited, **env}, used_args, where)

        if instruction == "COMMENT":
            continue
        if instruction == "ARG":
            for name, default in _pairs(value, where, single_allowed=True):
                fallback = expand(default) if default is not None else global_args.get(name, "")
                args[name] = build_args.get(name, fallback)
                declared.add(name)
            continue
        if instruction == "FROM":
            if result is not None:
                raise DockerfileError(f"{where}: a second FROM: multi-stage builds are not supported")
            words = expand(value).split()
            words = [w for w in words if not w.startswith("--")]
            if not words or (len(words) > 1 and (len(words) != 3 or words[1].upper() != "AS")):
                raise DockerfileError(f"{where}: FROM takes IMAGE [AS NAME]")
            if words[0] == "scratch":
                raise DockerfileError(f"{where}: FROM scratch is not supported: start from a DSec image")
            result = BuildPlan(base=words[0])
            global_args, args = args, {}  # a stage sees the ARGs it declares again
            continue
        if result is None:
            raise DockerfileError(f"{where}: {instruction} before FROM")
        if instruction == "ENV":
            for name, raw in _pairs(value, where, single_allowed=False):
                env[name] = expand(raw)
            result.env = dict(env)
        elif instruction == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, expand(value)))
            result.workdir = workdir
            result.steps.append(Run(f"mkdir -p {shlex.quote(workdir)}", (), "/", "root", line, f"WORKDIR {workdir}"))
        elif instruction == "USER":
            user = expand(value).strip()
            if not user or " " in user:
                raise DockerfileError(f"{where}: USER takes one user[:group]")
            result.user = user
        elif instruction == "SHELL":
            shell = _exec_form(value, where)
            if shell is None or not shell:
                raise DockerfileError(f"{where}: SHELL takes a JSON array, e.g. [\"/bin/bash\", \"-c\"]")
        elif instruction == "RUN":
            _, rest = _flags(value, where, allowed=())
            argv = _exec_form(rest, where)
            command = shlex.join(argv) if argv is not None else shlex.join([*shell, rest])
            used_args.update(args)  # (a RUN step reads them all, as env)
            run_env = {**args, **env}
            result.steps.append(Run(command, tuple(sorted(run_env.items())), workdir, user, line, f"RUN {rest}"))
        elif instruction in ("COPY", "ADD"):
            result.steps.append(_copy(instruction, expand(value), context, workdir, line, where))
        elif instruction in IGNORED:
            result.notes.append(f"{where}: {instruction} is not kept by DSec images; ignored")
        else:
            raise DockerfileError(f"{where}: {instruction} is not supported")
    if result is None:
        raise DockerfileError("the Dockerfile has no FROM")
    unknown = sorted(set(build_args) - declared)
    if unknown:
        result.notes.append(f"build args not declared by an ARG, ignored: {', '.join(unknown)}")
    if keyed:
        result.key = _key(result, used_args, context)
    return result


def _expand(word: str, values: dict[str, str], used: dict[str, str], where: str) -> str:
    """``$NAME``, ``${NAME}``, ``${NAME:-default}`` and ``${NAME:+alternative}`` as Docker
    substitutes them (``\\$`` is a dollar); what was read is noted in ``used`` for the key."""

    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group("braced") or m.group("plain")
        value = values.get(name, "")
        used[name] = value
        if m.group("op") == "-":
            return value or m.group("word")
        if m.group("op") == "+":
            return m.group("word") if value else ""
        return value

    return _VARIABLE.sub(one, word)


def _pairs(value: str, where: str, single_allowed: bool) -> list[tuple[str, str | None]]:
    """``K=V K2="v 2"`` (or the old ``K V`` form of ENV; a bare ``K`` for ARG)."""
    try:
        words = shlex.split(value, posix=True)
    except ValueError as exc:
        raise DockerfileError(f"{where}: {exc}") from None
    if not words:
        raise DockerfileError(f"{where}: nothing to set")
    if "=" not in words[0] and not single_allowed:
        name, _, rest = value.strip().partition(" ")
        return [(name, rest.strip())]
    pairs = []
    for word in words:
        name, eq, val = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or (not eq and not single_allowed):
            raise DockerfileError(f"{where}: {word!r} is not NAME=VALUE")
        pairs.append((name, val if eq else None))
    return pairs


def _exec_form(value: str, where: str) -> list[str] | None:
    """The JSON array of an exec form, or None for the shell form."""
    if not value.lstrip().startswith("["):
        return None
    try:
        argv = json.loads(value)
    except ValueError:
        return None  # Docker runs a malformed array through the shell too
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise DockerfileError(f"{where}: the exec form is a JSON array of strings")
    return argv


def _flags(value: str, where: str, allowed: tuple[str, ...]) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    rest = value.strip()
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        rest = rest.strip()
        m = _FLAG.match(word)
        if m is None or m.group("name") not in allowed:
            raise DockerfileError(f"{where}: the flag {word.split('=')[0]} is not supported")
        flags[m.group("name")] = m.group("value") or ""
    return flags, rest


def _copy(instruction: str, value: str, context: Path, workdir: str, line: int, where: str) -> Copy:
    flags, rest = _flags(value, where, allowed=("chown", "from", "chmod", "link"))
    if "from" in flags:
        raise DockerfileError(f"{where}: COPY --from (multi-stage builds) is not supported")
    if "chmod" in flags:
        raise DockerfileError(f"{where}: --chmod is not supported: chmod in a RUN step")
    words = _exec_form(rest, where)
    if words is None:
        try:
            words = shlex.split(rest)
        except ValueError as exc:
            raise DockerfileError(f"{where}: {exc}") from None
    if len(words) < 2:
        raise DockerfileError(f"{where}: {instruction} takes SOURCE... DEST")
    *patterns, dest = words
    sources: list[str] = []
    for pattern in patterns:
        if re.match(r"^[a-z]+://", pattern):
            raise DockerfileError(f"{where}: {instruction} of a URL is not supported: fetch it in a RUN step")
        sources += _match(pattern, context, where)
    into_dir = dest.endswith("/") or len(sources) > 1 or any((context / s).is_dir() for s in sources)
    dest = posixpath.normpath(posixpath.join(workdir, dest))
    unpack = instruction == "ADD" and len(sources) == 1 and _is_tar(context / sources[0])
    return Copy(tuple(sources), dest, into_dir or unpack, flags.get("chown") or None, unpack, line,
                f"{instruction} {rest}")


def _match(pattern: str, context: Path, where: str) -> list[str]:
    """The context paths ``pattern`` names (a glob is matched against the paths at its depth),
    relative, sorted; refused when it leaves the context or matches nothing."""
    norm = posixpath.normpath(pattern.lstrip("/")) or "."
    if norm == ".." or norm.startswith("../"):
        raise DockerfileError(f"{where}: {pattern!r} is outside the build context")
    if norm == ".":
        return ["."]
    if not any(c in norm for c in "*?["):
        if not os.path.lexists(context / norm):
            raise DockerfileError(f"{where}: {pattern!r} is not in the build context")
        return [norm]
    depth = norm.count("/")
    found = sorted(str(p.relative_to(context)) for p in context.rglob("*")
                   if str(p.relative_to(context)).count("/") == depth
                   and fnmatch.fnmatchcase(str(p.relative_to(context)), norm))
    if not found:
        raise DockerfileError(f"{where}: {pattern!r} matches nothing in the build context")
    return found


def _is_tar(path: Path) -> bool:
    import tarfile

    try:
        return path.is_file() and tarfile.is_tarfile(path)
    except OSError:
        return False


def _key(result: BuildPlan, used_args: dict[str, str], context: Path) -> str:
    """What the built image depends on besides its base: the steps as planned (with the values
    of the args they read), the config, and every copied file's path, mode, link and bytes."""
    digest = hashlib.sha256(b"dsec-dockerfile-1\0")
    digest.update(json.dumps({"base": result.base, "env": result.env, "workdir": result.workdir, "user": result.user,
                              "args": sorted(used_args.items()),
                              "steps": [repr(s) for s in result.steps]}, sort_keys=True).encode())
    for step in result.steps:
        if isinstance(step, Copy):
            for source in step.sources:
                for path in _walk(context / source):
                    _digest_entry(digest, context, path)
    return digest.hexdigest()


def _walk(path: Path):
    yield path
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(dirs + files):
                yield Path(root, name)


def _digest_entry(digest, context: Path, path: Path) -> None:
    st = path.lstat()
    digest.update(f"{path.relative_to(context)}\0{stat.S_IMODE(st.st_mode):o}\0{stat.S_IFMT(st.st_mode):o}\0".encode())
    if stat.S_ISLNK(st.st_mode):
        digest.update(os.readlink(path).encode() + b"\0")
    elif stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")


def context_tar(context: Path, step: Copy, into_dir: bool) -> bytes:
    """The files of a COPY step as one tar to unpack at ``step.dest`` (``into_dir``: the
    destination is a directory, given as one or found in the image) or at its parent (one file
    renamed to the destination's name), owned by root as Docker's are. An ADD of a tar archive
    is that archive's members."""
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        def add(path: Path, arcname: str) -> None:
            info = tar.gettarinfo(str(path), arcname=arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)
            # (sockets, devices and fifos in a context are left out, as Docker leaves them)

        if step.unpack:
            with tarfile.open(context / step.sources[0]) as archive:  # compressed or not
                for member in archive.getmembers():
                    data = archive.extractfile(member) if member.isreg() else None
                    member.uid = member.gid = 0
                    member.uname = member.gname = "root"
                    if member.isreg() or member.isdir() or member.issym():
                        tar.addfile(member, data)
            return out.getvalue()
        for source in step.sources:
            top = context / source
            if top.is_dir() and not top.is_symlink():
                for path in _walk(top):
                    if path != top:
                        add(path, str(path.relative_to(top)))
            else:
                add(top, top.name if into_dir else posixpath.basename(step.dest))
    return out.getvalue()
