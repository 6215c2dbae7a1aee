"""`gpucloud ssh-key …` and `gpucloud pod ssh --print` against a real server over HTTP."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.core.settings import Settings
from tests.conftest import ADMIN_KEY
from tests.fixtures.openssh import keygen
from tests.fixtures.postgres import free_port
from tests.fixtures.server import live_server
from tests.integration.test_cli import Cli, cli  # noqa: F401 - the fixture, by name


@pytest.fixture
def gateway_server(settings: Settings, monkeypatch: pytest.MonkeyPatch,
                   tmp_path: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    with live_server(dataclasses.replace(settings, ssh_port=port),
                     run_controllers=False) as url:
        monkeypatch.setenv("GPUCLOUD_URL", url)
        monkeypatch.setenv("GPUCLOUD_API_KEY", ADMIN_KEY)
        monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "cli-home"))
        yield url, port


def test_ssh_key_add_list_remove(gateway_server: tuple[str, int], cli: Cli,  # noqa: F811
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = keygen(tmp_path / "id_ed25519")
    code, out, err = cli("ssh-key", "add", str(tmp_path / "id_ed25519.pub"))
    assert code == 0, err
    assert out.startswith("added ") and "ssh-ed25519" in out and "SHA256:" in out
    [listed] = cli.json("ssh-key", "list")
    assert listed["public_key"] == " ".join(line.split()[:2]) and listed["name"] == "id_ed25519"
    code, _, err = cli("ssh-key", "add", str(tmp_path / "id_ed25519.pub"))
    assert code == 1 and err.startswith("error: ") and "already in this project" in err
    assert len(err.strip().splitlines()) == 1
    rsa = keygen(tmp_path / "id_rsa", "rsa")
    monkeypatch.setattr("sys.stdin", io.StringIO(rsa + "\n"))
    code, out, err = cli("ssh-key", "add", "-", "--name", "from-stdin")
    assert code == 0, err
    assert [k["name"] for k in cli.json("ssh-key", "list")] == ["id_ed25519", "from-stdin"]
    code, out, _ = cli("ssh-key", "remove", listed["id"])
    assert code == 0 and listed["id"] in out
    assert [k["name"] for k in cli.json("ssh-key", "list")] == ["from-stdin"]
    (tmp_path / "bad.pub").write_text("ssh-dss AAAAB3NzaC1kc3MAAACBAP me\n")
    code, _, err = cli("ssh-key", "add", str(tmp_path / "bad.pub"))
    assert code == 1 and err.startswith("error: public_key: unsupported key type")
    code, _, err = cli("ssh-key", "add", str(tmp_path / "missing.pub"))
    assert code == 1 and "cannot read" in err
    code, _, err = cli("ssh-key", "remove", "nope")
    assert code == 1 and err == "error: ssh key 'nope' not found\n"


def test_pod_ssh_prints_the_exact_command(gateway_server: tuple[str, int],
                                          cli: Cli) -> None:  # noqa: F811
    _, port = gateway_server
    code, _, err = cli("pod", "create", "dev", "--image", "busybox", "--port", "8888/http",
                       "--", "sleep", "600")
    assert code == 0, err
    pod = cli.json("pod", "get", "dev")
    code, out, err = cli("pod", "ssh", "dev", "--print")
    assert code == 0, err
    assert out == f"ssh -p {port} {pod['id']}@127.0.0.1\n"
    code, _, err = cli("pod", "ssh", "nope", "--print")
    assert code == 1 and err == "error: pod 'nope' not found\n"
