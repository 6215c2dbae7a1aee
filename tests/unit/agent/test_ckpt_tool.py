"""``gpucloud-ckpt`` in a pod's bundle: a hard link to the node's one copy (s46)."""

from __future__ import annotations

import os
from pathlib import Path

from gpucloud.agent.checkpoints import CKPT_TOOL, install_tool


def _tool(run_dir: Path) -> Path:
    return run_dir / "bin" / "gpucloud-ckpt"


def test_every_bundle_links_the_node_copy_written_once(tmp_path: Path) -> None:
    node_copy = tmp_path / "state" / "tools" / "gpucloud-ckpt"
    node_copy.parent.mkdir(parents=True)
    node_copy.write_text("#!/bin/sh\necho an older agent's tool\n")
    earlier = tmp_path / "earlier"
    (earlier / "bin").mkdir(parents=True)
    os.link(node_copy, _tool(earlier))  # a container the older agent started
    for pod in ("a", "b"):
        install_tool(tmp_path / pod / "run", node_copy)
    first, second = _tool(tmp_path / "a" / "run"), _tool(tmp_path / "b" / "run")
    assert first.read_text() == CKPT_TOOL
    assert first.stat().st_ino == second.stat().st_ino == node_copy.stat().st_ino
    assert first.stat().st_mode & 0o777 == 0o755
    # this process's copy replaced the older one without changing it under its container
    assert "an older agent's tool" in _tool(earlier).read_text()


def test_a_node_copy_that_cannot_be_made_gives_the_bundle_its_own(tmp_path: Path) -> None:
    blocked = tmp_path / "tools"
    blocked.write_text("a file where the tools' directory should be")
    install_tool(tmp_path / "pod" / "run", blocked / "gpucloud-ckpt")
    tool = _tool(tmp_path / "pod" / "run")
    assert tool.read_text() == CKPT_TOOL
    assert tool.stat().st_nlink == 1 and tool.stat().st_mode & 0o777 == 0o755


def test_without_a_node_copy_the_bundle_gets_its_own(tmp_path: Path) -> None:
    install_tool(tmp_path / "run")
    tool = _tool(tmp_path / "run")
    assert tool.read_text() == CKPT_TOOL and tool.stat().st_nlink == 1
