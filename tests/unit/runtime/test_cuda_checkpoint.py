"""cuda-checkpoint around a GPU container's dump: which processes, in which order, and
rollback when one cannot be suspended. NVIDIA's utility is stood in for by a script that
records its arguments (the real one needs a driver); the processes and their open files
are real."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.runtime.cuda_checkpoint import SuspendedGpus, gpu_pids, toggle
from gpucloud.runtime.errors import RuncError


@pytest.fixture
def utility(tmp_path: Path) -> Path:
    """A stand-in ``cuda-checkpoint``: logs ``--toggle --pid P``; fails for pid 1."""
    script = tmp_path / "cuda-checkpoint"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n"
                      "[ \"$3\" = 1 ] && { echo 'pid 1 is not a CUDA process' >&2; exit 3; }\n"
                      "exit 0\n")
    script.chmod(0o755)
    return script


def calls(utility: Path) -> list[str]:
    log = utility.parent / "calls"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """Two processes holding a fake GPU device open and one that does not."""
    device = tmp_path / "nvidia0"
    device.write_text("")
    other = tmp_path / "other"
    other.write_text("")
    processes = [subprocess.Popen(["sh", "-c", f"exec 3<{path}; exec sleep 60"])
                 for path in (device, device, other)]
    try:
        for process in processes:  # the shell has opened fd 3 once it execs sleep
            for _ in range(200):
                if (Path(f"/proc/{process.pid}/fd/3")).exists():
                    break
                subprocess.run(["sleep", "0.01"], check=False)
        yield tmp_path / "nvidia", [p.pid for p in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_only_processes_holding_a_gpu_device_are_found(holders: tuple[Path, list[int]]
                                                       ) -> None:
    prefix, pids = holders
    assert gpu_pids([*pids, 999_999_999], device_prefix=str(prefix)) == pids[:2]


def test_suspended_for_the_dump_and_resumed_after(utility: Path) -> None:
    with SuspendedGpus(str(utility), [11, 12]):
        assert calls(utility) == ["--toggle --pid 11", "--toggle --pid 12"]
    assert calls(utility)[2:] == ["--toggle --pid 11", "--toggle --pid 12"]


def test_a_container_that_ended_dumped_stays_suspended(utility: Path) -> None:
    with SuspendedGpus(str(utility), [11]) as suspended:
        suspended.keep_suspended()
    assert calls(utility) == ["--toggle --pid 11"]


def test_a_process_that_cannot_be_suspended_rolls_the_others_back(utility: Path) -> None:
    with pytest.raises(RuncError, match="pid 1 failed: pid 1 is not a CUDA process"):
        with SuspendedGpus(str(utility), [11, 1, 12]):
            pytest.fail("the dump must not run")
    assert calls(utility) == ["--toggle --pid 11", "--toggle --pid 1", "--toggle --pid 11"]


def test_toggle_reports_what_it_did(utility: Path) -> None:
    assert toggle(str(utility), [5, 6]) == [5, 6]
