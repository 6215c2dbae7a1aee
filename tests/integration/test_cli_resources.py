"""The list/get/delete/action commands that no other CLI test drives (join tokens,
checkpoints, priority classes), through cli/resources.py: table, JSON, and the one-line
error with exit status 1."""

from __future__ import annotations

import pytest

from tests.integration.test_cli import Cli, cli, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("server")


def test_join_token_list_and_revoke(cli: Cli) -> None:  # noqa: F811 - fixture
    assert cli("node", "join-token", "--uses", "2")[0] == 0
    [token] = cli.json("node", "join-token", "list")
    assert (token["uses"], token["max_uses"], token["revoked_at"]) == (0, 2, None)
    code, out, _ = cli("node", "join-token", "list")
    header, row = out.splitlines()
    assert header.split() == ["ID", "PREFIX", "USES", "EXPIRES", "REVOKED"]
    assert row.split()[2:3] == ["0/2"] and row.split()[-1] == "no"
    code, out, _ = cli("node", "join-token", "revoke", token["id"])
    assert code == 0 and out == f"join token {token['prefix'] or token['id']} revoked\n"
    [revoked] = cli.json("node", "join-token", "list")
    assert revoked["revoked_at"] is not None
    code, out, err = cli("node", "join-token", "revoke", "no-such-token")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: ")


def test_checkpoint_list_and_get_of_a_pod_without_any(cli: Cli) -> None:  # noqa: F811
    assert cli("pod", "create", "train", "--image", "busybox", "--checkpoint-dir", "/ckpt",
               "--", "sleep", "1")[0] == 0
    assert cli.json("checkpoint", "list", "train") == []
    code, out, _ = cli("checkpoint", "list", "train")
    assert code == 0 and out.split() == ["ID", "ATTEMPT", "SEQ", "STATE", "SIZE", "SENT",
                                         "FILES", "COST", "NODE", "CREATED"]
    code, out, err = cli("checkpoint", "get", "train")
    assert code == 1 and out == "" and err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1
    code, _, err = cli("checkpoint", "list", "missing")
    assert code == 1 and err.strip() == "error: pod 'missing' not found"


def test_priority_class_create_list_and_a_bad_value(cli: Cli) -> None:  # noqa: F811
    code, out, _ = cli("priority-class", "create", "urgent", "--value", "5000",
                       "--description", "pager duty")
    assert code == 0 and out == "priority class urgent created (5000)\n"
    listed = {c["name"]: c["value"] for c in cli.json("priority-class", "list")}
    assert listed["urgent"] == 5000
    code, out, _ = cli("priority-class", "list")
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("urgent")] == [
        ["urgent", "5000"]]
    code, out, err = cli("priority-class", "create", "Bad_Name", "--value", "1")
    assert code == 1 and out == "" and err.startswith("error: name: ")
