"""`gpucloud volume …` and the pod/job volume options against a real server over HTTP."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_cli import Cli, cli, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("server")


def test_volume_create_list_delete_and_pods_that_mount_it(cli: Cli) -> None:  # noqa: F811 - fixture
    code, out, _ = cli("volume", "create", "data", "--size", "100Gi", "--zone", "z1")
    assert code == 0 and out.startswith("volume data created (") and out.endswith(": 100Gi\n")
    code, out, _ = cli("pod", "create", "dev", "--image", "busybox",
                       "--volume-size", "20Gi", "--container-disk", "10Gi",
                       "--network-volume", "data:/data", "--", "sleep", "1")
    assert code == 0, out
    code, out, _ = cli("pod", "get", "dev")
    assert "20Gi at /workspace" in out and "data:/data" in out and "10Gi" in out
    code, out, _ = cli("volume", "list", "--output", "json")
    (listed,) = json.loads(out)
    assert (listed["name"], listed["size"], listed["zone"], listed["mounted_by"]) == (
        "data", "100Gi", "z1", ["dev"])
    code, _, err = cli("volume", "delete", "data")
    assert code != 0 and "mounted by pod dev" in err and len(err.strip().splitlines()) == 1
    assert cli("pod", "delete", "dev")[0] == 0
    code, out, _ = cli("volume", "delete", "data")
    assert code == 0 and out == "volume data deleted\n"
    assert cli("volume", "list", "--output", "json")[1].strip() == "[]"


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
    cli: Cli, args: list[str], needle: str  # noqa: F811 - fixture
) -> None:
    code, _, err = cli(*args)
    assert code != 0 and needle in err and len(err.strip().splitlines()) == 1
    assert cli("pod", "list", "--output", "json")[1].strip() == "[]"
    assert cli("volume", "list", "--output", "json")[1].strip() == "[]"
