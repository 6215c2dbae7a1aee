"""`gpucloud endpoint create|list|get|update|delete` against a real server (loopback)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    at = args.index("--") if "--" in args else len(args)  # options before the command
    code, out, err = run(capsys, *args[:at], "--output", "json", *args[at:])
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("server")
def test_endpoint_commands(capsys: pytest.CaptureFixture[str]) -> None:
    made = as_json(capsys, "endpoint", "create", "echo", "--image", "reg.local/echo:1",
                   "--min-workers", "0", "--max-workers", "5", "--idle-timeout", "5s",
                   "--scaler", "request-count", "--scaler-value", "2",
                   "--execution-timeout", "600s", "--gpu-ids", "ADA_24", "--env", "A=1",
                   "--", "python", "-u", "handler.py")
    assert (made["max_workers"], made["scaler"], made["command"]) == (
        5, "request-count", ["python", "-u", "handler.py"])
    got = as_json(capsys, "endpoint", "get", "echo")
    assert got["id"] == made["id"] and got["workers"] == 0
    code, out, _ = run(capsys, "endpoint", "get", "echo")
    assert code == 0 and "0 running (0 idle), 0..5" in out
    updated = as_json(capsys, "endpoint", "update", "echo", "--max-workers", "2",
                      "--image", "reg.local/echo:2")
    assert (updated["max_workers"], updated["image"], updated["env"]) == (
        2, "reg.local/echo:2", {"A": "1"})
    code, out, _ = run(capsys, "endpoint", "list")
    assert code == 0 and "echo" in out and made["id"] in out
    code, _, err = run(capsys, "endpoint", "update", "echo", "--min-workers", "3")
    assert code != 0 and "max_workers" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "endpoint", "create", "bad", "--image", "r/x:1",
                       "--scaler", "magic")
    assert code != 0 and "scaler" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "endpoint", "create", "noimage")
    assert code != 0 and "--image" in err
    code, _, _ = run(capsys, "endpoint", "delete", "echo")
    assert code == 0
    code, _, err = run(capsys, "endpoint", "get", "echo")
    assert code != 0 and "not found" in err
