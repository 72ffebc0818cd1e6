"""The E2B layer's pure parts: network options, envd tokens, command lines, watch diffs."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b")

from e2b.envd.filesystem import filesystem_pb as fpb  # noqa: E402

from dsec.compat.e2b.control import network_rules  # noqa: E402
from dsec.compat.e2b.envd import EnvdTokens, Target  # noqa: E402
from dsec.compat.e2b.filesystem import _changes  # noqa: E402
from dsec.compat.e2b.process import _command, _config_of, _end  # noqa: E402
from e2b.envd.process import process_pb as ppb  # noqa: E402
from libdsec import InvalidRequest  # noqa: E402


def test_network_options_become_dsec_rules():
    assert network_rules(None, None) == {}
    assert network_rules(None, ["0.0.0.0/0"]) == {}  # denied already
    assert network_rules(["pypi", "example.internal", "10.1.2.3"], ["npm"]) == {
        "pypi": True, "npm": False, "domains": ["example.internal", "10.1.2.3"]}
    for bad, why in (("10.0.0.0/8", "address ranges"), ("*.example.com", "wildcards"), ("", "name a domain")):
        with pytest.raises(InvalidRequest, match=why):
            network_rules([bad], None)


def test_envd_tokens_open_one_sandbox_and_depend_on_the_root_token():
    tokens = EnvdTokens(b"root-token")
    a = tokens.token("n0-0123456789abcdef")
    assert tokens.check("n0-0123456789abcdef", a)
    assert not tokens.check("n0-fedcba9876543210", a)
    assert not EnvdTokens(b"another").check("n0-0123456789abcdef", a)
    named = tokens.token("n0-0123456789abcdef", "user")  # a sandbox whose own user is not root
    assert named.startswith("user.") and tokens.check("n0-0123456789abcdef", named) == "user"
    assert tokens.check("n0-0123456789abcdef", a) == "root"
    assert tokens.check("n0-0123456789abcdef", "root." + named.partition(".")[2]) is None  # the MAC covers the user
    assert tokens.check("n0-fedcba9876543210", named) is None
    assert not tokens.check("n0-0123456789abcdef", "")


def test_paths_are_taken_from_the_users_home():
    root, user = Target(None, "s", None), Target(None, "s", "user")
    assert root.path("a/b") == "/root/a/b" and user.path("a") == "/home/user/a"
    own = Target(None, "s", None, own_user="user")  # E2B's base: no user named, the sandbox's own
    assert own.path("a") == "/home/user/a" and own.cwd is None and user.cwd == "/home/user"
    assert root.path("/etc/x") == "/etc/x" and root.path("") == "/root"
    assert root.path("../etc/passwd") == "/etc/passwd"  # normalized, still inside the sandbox
    with pytest.raises(InvalidRequest, match="NUL"):
        root.path("a\0b")


def test_command_lines_round_trip_for_the_listing():
    config = ppb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "echo 'hi there'; sleep 1"])
    line = _command(config, stdin=False)
    assert line.endswith(" </dev/null") and line.startswith("exec ")
    back = _config_of(line)
    assert (back.cmd, list(back.args)) == ("/bin/bash", ["-l", "-c", "echo 'hi there'; sleep 1"])
    assert not _command(config, stdin=True).endswith("</dev/null")
    assert _end(0).exited and _end(3).exit_code == 3
    killed = _end(137)
    assert not killed.exited and killed.status == "signal: kill"


def test_watch_diffs():
    before = {"a": ("file", 1, 1.0), "d": ("dir", 0, 1.0), "gone": ("file", 1, 1.0)}
    after = {"a": ("file", 2, 2.0), "d": ("dir", 0, 5.0), "new": ("file", 3, 3.0)}
    events = [(e.type, e.name) for e in _changes(before, after)]
    assert events == [(fpb.EventType.REMOVE, "gone"), (fpb.EventType.WRITE, "a"),
                      (fpb.EventType.CREATE, "new"), (fpb.EventType.WRITE, "new")]


def test_pty_pids_are_above_any_process_pid_and_sizes_are_checked():
    from connectrpc.code import Code
    from connectrpc.errors import ConnectError

    from dsec.compat.e2b.pty import PTY_PID_BASE, _pty_id, _size, is_pty
    from libdsec.protocol import PtyResizeRequest

    assert PTY_PID_BASE == 4194304  # the kernel's PID_MAX_LIMIT: pid_max is at most this
    assert is_pty(PTY_PID_BASE + 1) and _pty_id(PTY_PID_BASE + 7) == 7
    assert not is_pty(PTY_PID_BASE) and not is_pty(999999) and not is_pty(1)
    assert _size(ppb.PTY.Size(cols=100, rows=30), PtyResizeRequest) == PtyResizeRequest(cols=100, rows=30)
    for cols, rows in ((0, 24), (80, 0), (5000, 24)):
        with pytest.raises(ConnectError, match=f"bad PTY size {cols}x{rows}") as bad:
            _size(ppb.PTY.Size(cols=cols, rows=rows), PtyResizeRequest)
        assert bad.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(ConnectError, match="size"):
        _size(None, PtyResizeRequest)


def test_template_steps_become_a_dockerfile_dsec_builds(tmp_path):
    import io
    import tarfile

    from dsec.compat.e2b import _models as m
    from dsec.compat.e2b.templates import StepRefused, translate
    from dsec.images import dockerfile

    upload = io.BytesIO()
    (tmp_path / "src" / "app").mkdir(parents=True)
    (tmp_path / "src" / "app" / "a.py").write_text("print(1)")
    (tmp_path / "src" / "app" / "ünï cödé.py").write_text("print(2)")  # (a pax header's path, as the SDK tars it)
    with tarfile.open(fileobj=upload, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in ("app", "app/a.py", "app/ünï cödé.py"):
            tar.add(tmp_path / "src" / name, arcname=name, recursive=False)
    spec = m.parse(m.TemplateBuildStart, {"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["cat <<EOF > $HOME/x\nhi\nEOF"]},
        {"type": "COPY", "args": ["app", "app/", "", "0755"], "filesHash": "a" * 64},
        {"type": "ENV", "args": ["A", "1 $x 'q'", "B", "\\$y \"quoted\""]},
        {"type": "WORKDIR", "args": ["sub"]},
        {"type": "USER", "args": ["root"]},
        {"type": "RUN", "args": ["id", "user"]},
    ]})
    plan = translate(spec, "e2b-base", "user", "/home/user", lambda h: upload.getvalue())
    context = tmp_path / "context"
    tarfile.open(fileobj=io.BytesIO(plan.context)).extractall(context)
    assert sorted(p.name for p in (context / "s2" / "app").iterdir()) == ["a.py", "ünï cödé.py"]
    assert sorted(p.name for p in context.iterdir()) == ["s2"]  # nothing outside its step's folder
    built = dockerfile.plan(plan.dockerfile, context)
    runs = [s for s in built.steps if isinstance(s, dockerfile.Run) and not s.text.startswith("WORKDIR")]
    assert runs[0].command == "/bin/sh -c " + __import__("shlex").quote("cat <<EOF > $HOME/x\nhi\nEOF")
    assert (runs[0].user, runs[0].workdir) == ("user", "/home/user")  # the base's user and directory
    copy = next(s for s in built.steps if isinstance(s, dockerfile.Copy))
    assert (copy.sources, copy.dest, copy.chown) == (("s2/app",), "/home/user/app", "user")
    chmod = "chmod 0755 -- " + __import__("shlex").join(["/home/user/app/a.py", "/home/user/app/ünï cödé.py"])
    assert (runs[1].command, runs[1].user) == ("/bin/sh -c " + __import__("shlex").quote(chmod), "root")
    assert (runs[2].user, runs[2].workdir) == ("user", "/home/user/sub")  # RUN's own user, then back
    # ENV as E2B builds it, Docker's: $x (unset) expanded, \$ a literal $ (the SDK's from_dockerfile
    # leaves `ENV PATH=/x:$PATH` for the build to expand)
    assert built.env == {"A": "1  'q'", "B": '$y "quoted"'} and built.user == "root"
    assert built.workdir == "/home/user/sub"
    assert plan.steps[len(plan.dockerfile.splitlines())] == "6" and plan.steps[1] == "base"
    with pytest.raises(StepRefused, match="step 1: the files of COPY x were not uploaded"):
        translate(m.parse(m.TemplateBuildStart, {"steps": [{"type": "COPY", "args": ["x", "/x"], "filesHash": "b" * 64}]}),
                  "python", "root", "/", lambda h: None)
    with pytest.raises(StepRefused, match="MCP is not a step"):
        translate(m.parse(m.TemplateBuildStart, {"steps": [{"type": "MCP", "args": []}]}), "python", "root", "/",
                  lambda h: None)


def test_upload_links_are_signed_single_use_and_expire():
    from dsec.compat.e2b.templates import LinkRefused, UploadLinks

    links = UploadLinks(b"root-token")
    token = links.token("team", "t", "c" * 64)
    assert links.take(token) == ("team", "t", "c" * 64)
    with pytest.raises(LinkRefused, match="used already"):
        links.take(token)
    with pytest.raises(LinkRefused, match="expired"):
        links.take(links.token("team", "t", "c" * 64, now=1.0))
    with pytest.raises(LinkRefused, match="not an upload link"):
        UploadLinks(b"another root").take(links.token("team", "t", "c" * 64))
