"""E2B's template builder and its ``base`` template on DSec, driven by the official ``e2b``
SDK's own calls (``Template``, ``Template.build``, ``alias_exists``, ``Sandbox.create``) against
one ``dsec serve``."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import AsyncTemplate, BuildException, Sandbox, Template, wait_for_port  # noqa: E402

from dsec.compat.e2b.templates import UploadLinks  # noqa: E402
from libdsec import SyncDSecClient  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def e2b_base_image(tmp_path_factory, test_store: Path) -> str:
    """E2B's ``base`` template, built as an operator builds it (``dsec image build e2b-base``):
    about a minute and a half, once per store."""
    from conftest import make_state_dir

    from dsec.images.store import LayerStore

    if not LayerStore(test_store).has_image("e2b-base"):
        state = make_state_dir(tmp_path_factory, test_store, "e2b-base-build")
        built = subprocess.run([sys.executable, "-m", "dsec", "image", "build", "e2b-base", "--state-dir", str(state)],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stdout + built.stderr
    return "e2b-base"


@pytest.fixture(scope="module")
def e2b(server, e2b_settings, python_image, e2b_base_image):
    """The e2b SDK pointed at the server; the templates it built are removed after."""
    yield e2b_settings
    with SyncDSecClient(server.endpoint, token=server.token) as client:  # the templates built (the store is shared)
        for image in client.list_images().images:
            if image.name in NAMED:
                client.remove_image(image.name)


NAMED: set[str] = set()


def new_name() -> str:
    NAMED.add(name := f"tpl-{uuid.uuid4().hex[:10]}")
    return name


def run(sb: Sandbox, command: str, **kwargs) -> str:
    return sb.commands.run(command, **kwargs).stdout.strip()


def test_the_base_template_is_e2bs(e2b):
    with Sandbox.create() as sb:
        assert sb.get_info().template_id == "base"
        assert run(sb, "whoami") == "user"
        assert run(sb, "pwd") == "/home/user"
        assert run(sb, "sudo -n true && sudo -n whoami") == "root"
        assert run(sb, "stat -c %U:%G /home/user && stat -c %U /home/user/.bashrc") == "user:user\nuser"
        assert run(sb, "command -v curl git python3 python ss pgrep").split() == [
            "/usr/bin/curl", "/usr/bin/git", "/usr/bin/python3", "/usr/bin/python", "/usr/bin/ss", "/usr/bin/pgrep"]
        assert run(sb, "python3 -c 'print(6 * 7)'") == "42"
        sb.files.write("/home/user/note.txt", "from the SDK")
        assert run(sb, "cat ~/note.txt") == "from the SDK"
        # envd's paths with no user named are the sandbox's user's: relative ones from its home
        info = sb.files.write("sub/relative.txt", "here")
        assert info.path == "/home/user/sub/relative.txt"
        assert run(sb, "stat -c %U:%G ~/sub/relative.txt ~/note.txt") == "user:user\nuser:user"
        assert [e.name for e in sb.files.list("sub")] == ["relative.txt"]
        # Owners by name, as envd names them; a deep listing in envd's walk order.
        info = sb.files.get_info("sub/relative.txt")
        assert (info.owner, info.group) == ("user", "user")
        assert (sb.files.get_info("/etc/passwd").owner, sb.files.get_info("/etc").group) == ("root", "root")
        for d in ("tree/b", "tree/a/z", "tree/a/y", "tree/a-1"):
            sb.files.make_dir(d)
        assert [e.path.removeprefix("/home/user/tree/") for e in sb.files.list("tree", depth=2)] == [
            "a", "a/y", "a/z", "a-1", "b"]
        assert sb.files.read("sub/relative.txt") == "here"
        assert run(sb, "pwd", cwd="sub") == "/home/user/sub"
        assert run(sb, "whoami", user="root") == "root"


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("e2b-context")
    (root / "app").mkdir()
    (root / "app" / "index.html").write_text("<h1>served by the start command</h1>\n")
    (root / "app" / "data.txt").write_text("copied\n")
    (root / "app" / "run.txt").write_text(uuid.uuid4().hex)  # a new build each run (the store is shared)
    (root / "tool.sh").write_text("#!/bin/sh\necho tool ran as $(whoami)\n")
    return root


def served_template(context: Path):
    return (Template(file_context_path=context)
            .from_template("base")
            .copy("app", "/home/user/app/")
            .copy("tool.sh", "/usr/local/bin/tool", mode=0o755)
            .run_cmd("echo built by $(whoami) > /home/user/built.txt")
            .run_cmd("touch /opt/by-root", user="root")
            .set_envs({"GREETING": "hello there", "PRICE": "\\$5"})
            .set_envs({"MESSAGE": "$GREETING!"})
            .set_workdir("/home/user/app")
            .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000)))


def test_a_template_built_with_the_sdk_runs_its_files_and_start_command(e2b, context):
    name = new_name()
    assert not Template.alias_exists(name)
    logs = []
    started = time.monotonic()
    info = Template.build(served_template(context), alias=name, on_build_logs=logs.append)
    first_s = time.monotonic() - started
    assert info.template_id == name and info.alias == name
    text = "\n".join(str(entry) for entry in logs)
    assert "Uploaded 'app'" in text and "Uploaded 'tool.sh'" in text and "is ready (built" in text, text
    assert Template.alias_exists(name)
    with Sandbox.create(template=name) as sb:
        # the ready command was awaited: the start command's server answers at once
        assert "served by the start command" in run(sb, "curl -s http://127.0.0.1:8000/index.html")
        assert run(sb, "whoami; pwd") == "user\n/home/user/app"
        assert run(sb, "cat data.txt ../built.txt") == "copied\nbuilt by user"
        assert run(sb, "stat -c %U:%a /home/user/app/data.txt /usr/local/bin/tool /opt/by-root") == \
            "user:644\nuser:755\nroot:644"  # (copies belong to the current user, as E2B's)
        assert run(sb, "tool") == "tool ran as user"
        assert run(sb, 'echo "$GREETING costs $PRICE"') == "hello there costs $5"
        # ENV as E2B builds it (Docker's): $NAME expanded, \$ a literal $
        assert run(sb, 'echo "$MESSAGE"') == "hello there!"
        assert sb.get_info().template_id == name

    # The same template again: the files are present (no upload), the build is the cache's.
    logs.clear()
    started = time.monotonic()
    Template.build(served_template(context), alias=name, on_build_logs=logs.append)
    again_s = time.monotonic() - started
    text = "\n".join(str(entry) for entry in logs)
    assert "Skipping upload of 'app', already cached" in text, text
    server_s = float(re.search(r"cached: nothing changed in ([0-9.]+) s\)", text).group(1))
    assert server_s < 1.0, text
    print(f"\nfirst build {first_s:.1f} s; again {again_s:.2f} s (server {server_s:.3f} s)")

    # A changed file is built again.
    (context / "app" / "data.txt").write_text("changed\n")
    try:
        Template.build(served_template(context), alias=name)
        with Sandbox.create(template=name) as sb:
            assert run(sb, "cat data.txt") == "changed"
    finally:
        (context / "app" / "data.txt").write_text("copied\n")

    # Started 100 times through the SDK, start command and ready check each time.
    started = time.monotonic()
    for _ in range(100):
        sb = Sandbox.create(template=name)
        sb.kill()
    loop_s = time.monotonic() - started
    print(f"100 × create (start command + ready check) + kill: {loop_s:.1f} s ({loop_s * 10:.0f} ms each)")


def test_a_template_from_a_dsec_image_and_a_failing_step(e2b, tmp_path):
    name = new_name()
    template = (AsyncTemplate(file_context_path=tmp_path)
                .from_image("python")
                .run_cmd(f"python3 -c 'print(6 * 7)' > /root/answer  # {name}")
                .set_user("root"))
    asyncio.run(AsyncTemplate.build(template, alias=name))
    assert asyncio.run(AsyncTemplate.alias_exists(name))
    with Sandbox.create(template=name) as sb:
        assert run(sb, "cat /root/answer; whoami") == "42\nroot"

    logs = []
    failing = (Template(file_context_path=tmp_path)
               .from_image("python")
               .run_cmd("echo fine")
               .run_cmd("echo about to fail; exit 3"))
    bad = new_name()
    with pytest.raises(BuildException, match=r"build step 2 \('RUN echo about to fail; exit 3'\) failed with exit code 3"):
        Template.build(failing, alias=bad, on_build_logs=logs.append)
    text = "\n".join(str(entry) for entry in logs)
    assert "about to fail" in text, text
    assert not Template.alias_exists(bad)

    offline = Template(file_context_path=tmp_path).from_image("python").apt_install("cowsay")
    with pytest.raises(BuildException, match=r"build step 1 .*apt-get update.* failed with exit code"):
        Template.build(offline, alias=new_name())


def test_upload_links_are_single_use_and_expire(e2b, server):
    api = httpx.Client(base_url=e2b["E2B_API_URL"], headers={"X-API-Key": e2b["E2B_API_KEY"]})
    files_hash = uuid.uuid4().hex * 2
    answer = api.get(f"/templates/t/files/{files_hash}")
    assert answer.status_code == 201 and answer.json()["present"] is False
    url = answer.json()["url"]
    assert httpx.put(url, content=b"not used").status_code == 200
    again = httpx.put(url, content=b"again")
    assert again.status_code == 403 and "used already" in again.json()["message"]
    assert api.get(f"/templates/t/files/{files_hash}").json() == {"present": True}
    # another project does not see it
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        client.create_project("tpl-other")
        other = client.create_project_token("tpl-other", e2b=True)
    assert httpx.get(f"{e2b['E2B_API_URL']}/templates/t/files/{files_hash}",
                     headers={"X-API-Key": other}).json()["present"] is False

    expired = UploadLinks(server.token.encode()).token("root", "t", files_hash, now=time.time() - 3600)
    refused = httpx.put(f"{e2b['E2B_API_URL']}/template-files/{expired}", content=b"late")
    assert refused.status_code == 403 and "expired" in refused.json()["message"]
    forged = url.rsplit(".", 1)[0] + "." + "0" * 64
    assert httpx.put(forged, content=b"x").status_code == 403
    api.close()


GATEWAY = ("printf '%s\\n' '#!/bin/sh' 'mkdir -p /etc/mcp-gateway' "
           "'printf %s \"$GATEWAY_ACCESS_TOKEN\" > /etc/mcp-gateway/.token' "
           "'printf %s \"$2\" > /etc/mcp-gateway/config.json' > /usr/local/bin/mcp-gateway "
           "&& chmod 755 /usr/local/bin/mcp-gateway")


def test_mcp_the_sdk_starts_the_templates_gateway_and_kills_a_sandbox_without_one(e2b, tmp_path):
    """``mcp``: the API takes it, and E2B's SDK runs the template's ``mcp-gateway`` (as root, its
    config and access token given); a template without one fails that start, and the sandbox
    the create made is gone (E2B's own ``test_mcp_gateway_start_failure_kills_created_sandbox``)."""
    from e2b import SandboxException, SandboxQuery

    metadata = {"mcp_test": uuid.uuid4().hex}
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create(template="python", metadata=metadata, mcp={"invalid_server": {}})
    assert Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items() == []

    name = new_name()
    Template.build(Template(file_context_path=tmp_path).from_image("python").run_cmd(f"{GATEWAY}  # {name}"),
                   alias=name)
    config = {"duckduckgo": {}, "arxiv": {"storagePath": "/tmp/papers"}}
    with Sandbox.create(template=name, mcp=config) as sb:
        assert json.loads(sb.files.read("/etc/mcp-gateway/config.json", user="root")) == config
        assert sb.files.read("/etc/mcp-gateway/.token", user="root") == sb.get_mcp_token() != ""
