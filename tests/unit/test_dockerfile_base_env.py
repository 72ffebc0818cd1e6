"""``$NAME`` in a Dockerfile's words sees the FROM image's ENV, as docker's builder does."""

from dsec.images import dockerfile


def test_env_extends_the_base_images_path(tmp_path):
    text = "FROM python\nENV PATH=/opt/venv/bin:$PATH HOME_DIR=${HOME:-/nowhere}\n"
    plan = dockerfile.plan(text, tmp_path, base_env={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    assert plan.env == {"PATH": "/opt/venv/bin:/usr/bin:/bin", "HOME_DIR": "/root"}


def test_a_base_with_no_path_gets_dockers_default(tmp_path):
    plan = dockerfile.plan("FROM python\nENV PATH=/opt/bin:$PATH\n", tmp_path, base_env={})
    assert plan.env["PATH"] == f"/opt/bin:{dockerfile.DEFAULT_PATH}"


def test_the_base_env_changes_the_key_only_where_it_is_read(tmp_path):
    reads = "FROM python\nENV PATH=/opt/bin:$PATH\n"
    ignores = "FROM python\nENV A=1\n"
    one, two = {"PATH": "/a"}, {"PATH": "/b"}
    assert dockerfile.plan(reads, tmp_path, base_env=one).key != dockerfile.plan(reads, tmp_path, base_env=two).key
    assert dockerfile.plan(ignores, tmp_path, base_env=one).key == dockerfile.plan(ignores, tmp_path, base_env=two).key
