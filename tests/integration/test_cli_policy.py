"""`gpucloud priority-class …` and `gpucloud quota …` against a real server over HTTP."""

from __future__ import annotations

import json

from tests.integration.test_cli import Cli, cli, server  # noqa: F401 - fixtures


def test_priority_classes_and_quotas_through_the_cli(server: str,  # noqa: F811 - fixtures
                                                     cli: Cli) -> None:  # noqa: F811
    code, out, _ = cli("priority-class", "create", "urgent", "--value", "5000")
    assert code == 0 and "urgent" in out
    code, out, _ = cli("priority-class", "list", "--output", "json")
    assert [c["name"] for c in json.loads(out)] == ["spot", "batch", "on-demand", "urgent"]
    assert cli("project", "create", "team-a")[0] == 0
    code, out, _ = cli("quota", "set", "team-a", "--gpus", "H100-80GB=8", "--gpus", "a100=4",
                       "--borrow-limit", "2", "--output", "json")
    assert code == 0 and json.loads(out)["gpus"] == {"H100-80GB": 8, "A100-40GB": 4}
    code, out, _ = cli("quota", "list")
    assert code == 0 and "team-a" in out and "H100-80GB=0/8" in out
    code, _, err = cli("quota", "set", "team-a", "--gpus", "H100")
    assert code == 1 and err.startswith("error: --gpus 'H100': expected MODEL=COUNT")
    code, _, err = cli("pod", "create", "p", "--image", "busybox", "--priority-class", "nope")
    assert code == 1 and "priority_class: unknown priority class 'nope'" in err
