"""`gpucloud volume …` and the pod/job volume options against a real server over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.cli.main import main
from gpucloud.core.settings import Settings
from tests.conftest import ADMIN_KEY
from tests.fixtures.server import live_server


@pytest.fixture
def server(settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    with live_server(settings, run_controllers=False) as url:
        monkeypatch.setenv("GPUCLOUD_URL", url)
        monkeypatch.setenv("GPUCLOUD_API_KEY", ADMIN_KEY)
        monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "cli-home"))
        yield url


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_volume_create_list_delete_and_pods_that_mount_it(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    del server
    code, out, _ = _run(capsys, "volume", "create", "data", "--size", "100Gi", "--zone", "z1")
    assert code == 0 and out.startswith("volume data created (") and out.endswith(": 100Gi\n")
    code, out, _ = _run(capsys, "pod", "create", "dev", "--image", "busybox",
                        "--volume-size", "20Gi", "--container-disk", "10Gi",
                        "--network-volume", "data:/data", "--", "sleep", "1")
    assert code == 0, out
    code, out, _ = _run(capsys, "pod", "get", "dev")
    assert "20Gi at /workspace" in out and "data:/data" in out and "10Gi" in out
    code, out, _ = _run(capsys, "volume", "list", "--output", "json")
    (listed,) = json.loads(out)
    assert (listed["name"], listed["size"], listed["zone"], listed["mounted_by"]) == (
        "data", "100Gi", "z1", ["dev"])
    code, _, err = _run(capsys, "volume", "delete", "data")
    assert code != 0 and "mounted by pod dev" in err and len(err.strip().splitlines()) == 1
    assert _run(capsys, "pod", "delete", "dev")[0] == 0
    code, out, _ = _run(capsys, "volume", "delete", "data")
    assert code == 0 and out == "volume data deleted\n"
    assert _run(capsys, "volume", "list", "--output", "json")[1].strip() == "[]"


@pytest.mark.parametrize(("args", "needle"), [
    (["volume", "create", "Bad_Name", "--size", "1Gi"], "name"),
    (["volume", "create", "ok", "--size", "lots"], "size"),
    (["pod", "create", "p", "--image", "busybox", "--volume-size", "1Gi",
      "--volume-path", "/proc"], "volume_path"),
    (["pod", "create", "p", "--image", "busybox", "--network-volume", "missing"],
     "network_volumes"),
    (["job", "create", "j", "--nodes", "2", "--image", "busybox", "--network-volume",
      "missing:/d"], "network_volumes"),
])
def test_bad_volume_input_is_one_line_and_non_zero(
    server: str, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    del server
    code, _, err = _run(capsys, *args)
    assert code != 0 and needle in err and len(err.strip().splitlines()) == 1
    assert _run(capsys, "pod", "list", "--output", "json")[1].strip() == "[]"
    assert _run(capsys, "volume", "list", "--output", "json")[1].strip() == "[]"
