"""`gpucloud template`, `gpucloud registry-auth` and `pod create --template` against a
real server over HTTP (both databases): one option set, and only given options sent."""

from __future__ import annotations

import io

import pytest

from tests.integration.test_cli import Cli, cli, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("server")


def _add_auth(cli: Cli, monkeypatch: pytest.MonkeyPatch, name: str = "lab") -> None:  # noqa: F811 - fixture
    monkeypatch.setattr("sys.stdin", io.StringIO("t0ken-pass\n"))
    code, out, err = cli("registry-auth", "add", name, "--username", "alice",
                         "--password-stdin", "--registry", "127.0.0.1:5000")
    assert code == 0, err
    assert f"registry auth {name} added" in out


def test_registry_auth_add_list_remove(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - fixture
    _add_auth(cli, monkeypatch)
    code, out, err = cli("registry-auth", "list")
    assert code == 0 and "alice" in out and "127.0.0.1:5000" in out
    assert "t0ken-pass" not in out
    listed = cli.json("registry-auth", "list")
    assert [(a["name"], a["username"]) for a in listed] == [("lab", "alice")]
    assert "password" not in listed[0]
    code, out, err = cli("registry-auth", "remove", "lab")
    assert code == 0 and "removed" in out
    assert cli.json("registry-auth", "list") == []
    code, _, err = cli("registry-auth", "remove", "lab")
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_registry_auth_wants_the_password_on_stdin(cli: Cli) -> None:  # noqa: F811 - fixture
    code, _, err = cli("registry-auth", "add", "lab", "--username", "alice")
    assert code == 1 and "--password-stdin" in err


def test_template_create_get_list_delete(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - fixture
    _add_auth(cli, monkeypatch)
    code, out, err = cli(
        "template", "create", "lab", "--image", "127.0.0.1:5000/lab/jupyter:3",
        "--gpus", "1", "--env", "A=1", "--port", "8888/http", "--port", "22/tcp",
        "--volume-size", "20Gi", "--volume-path", "/workspace", "--memory", "2Gi",
        "--entrypoint", "python -u", "--registry-auth", "lab", "--", "serve.py", "--fast")
    assert code == 0, err
    assert "template lab created" in out
    shown = cli.json("template", "get", "lab")
    assert shown["entrypoint"] == ["python", "-u"]
    assert shown["command"] == ["serve.py", "--fast"]
    assert shown["ports"] == ["8888/http", "22/tcp"] and shown["gpus"] == 1
    assert shown["volume_size"] == 20 * 1024**3 and shown["memory"] == "2Gi"
    assert shown["registry_auth"] == "lab" and shown["env"] == {"A": "1"}
    code, out, _ = cli("template", "get", "lab")
    assert code == 0 and "python -u" in out and "20Gi at /workspace" in out
    code, out, _ = cli("template", "list")
    assert code == 0 and "lab" in out and "8888/http,22/tcp" in out
    code, out, _ = cli("template", "delete", "lab")
    assert code == 0 and cli.json("template", "list") == []


def test_pod_from_template_keeps_what_the_command_line_does_not_name(cli: Cli) -> None:  # noqa: F811 - fixture
    code, _, err = cli("template", "create", "base", "--image", "busybox", "--memory", "2Gi",
                       "--cpu", "2", "--gpus", "1", "--env", "A=1", "--port", "8888/http",
                       "--entrypoint", "/bin/sh -c", "--", "echo hi")
    assert code == 0, err
    pod = cli.json("pod", "create", "p1", "--template", "base", "--gpus", "0",
                   "--entrypoint", "")
    assert pod["template"] == "base" and pod["image"] == "busybox"
    assert pod["gpus"] == 0 and pod["entrypoint"] == []
    assert pod["memory"] == "2Gi" and pod["cpu"] == 2 and pod["env"] == {"A": "1"}
    assert pod["ports"] == ["8888/http"] and pod["command"] == ["echo hi"]
    assert pod["restart"] == "never"
    code, _, err = cli("pod", "create", "p2", "--image", "busybox", "--", "true")
    assert code == 0, err
    plain = cli.json("pod", "get", "p2")
    assert plain["memory"] == "1Gi" and plain["entrypoint"] is None and plain["template"] is None


@pytest.mark.parametrize(("args", "fragment"), [
    (["pod", "create", "x", "--template", "nope"], "template"),
    (["pod", "create", "x", "--image", "busybox", "--port", "8888", "--port", "8888/http"],
     "ports:"),
    (["pod", "create", "x", "--image", "busybox", "--port", "99999"], "ports:"),
    (["pod", "create", "x", "--image", "busybox", "--registry-auth", "nope"],
     "registry credentials"),
    (["pod", "create", "x", "--image", "busybox", "--volume-path", "/sys"], "volume_path:"),
    (["template", "create", "t"], "--image is required"),
    (["template", "create", "t", "--image", "busybox", "--gpus", "1.5"], "gpus:"),
    (["job", "create", "j", "--image", "busybox", "--registry-auth", "nope"],
     "registry credentials"),
])
def test_bad_input_is_one_line_and_creates_nothing(cli: Cli, args: list[str],  # noqa: F811 - fixture
                                                   fragment: str) -> None:
    code, out, err = cli(*args)
    assert code != 0 and fragment in err, (out, err)
    assert len(err.strip().splitlines()) == 1
    assert cli.json("pod", "list") == [] and cli.json("template", "list") == []
    assert cli.json("job", "list") == []
