from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.runtime.cgroups import memory_cgroup_dir, oom_killed
from gpucloud.runtime.driver import ExitInfo, RuncDriver
from gpucloud.runtime.logs import follow, read_from, tail
from gpucloud.runtime.supervisor import runc_error

TWO_BLOCKS = b"y" * 70_000 + b"\n" + b"z" * 70_000 + b"\n"  # lines longer than a read block


@pytest.mark.parametrize(
    ("content", "lines", "expected"),
    [
        (b"", 3, b""),
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),
        (b"a\nb\n", 5, b"a\nb\n"),
        (b"a\n", 0, b""),
        (b"x" * 200_000 + b"\nlast\n", 1, b"last\n"),
        (TWO_BLOCKS, 2, TWO_BLOCKS),
    ],
)
def test_tail(tmp_path: Path, content: bytes, lines: int, expected: bytes) -> None:
    log = tmp_path / "log"
    log.write_bytes(content)
    assert tail(log, lines) == expected


def test_tail_of_missing_file(tmp_path: Path) -> None:
    assert tail(tmp_path / "none", 10) == b""


def test_read_from_offsets(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"hello\nworld\n")
    first = read_from(log, 0, limit=6)
    assert (first.data, first.next_offset) == (b"hello\n", 6)
    rest = read_from(log, first.next_offset)
    assert (rest.text, rest.next_offset) == ("world\n", 12)
    assert read_from(log, 12).data == b"" and read_from(tmp_path / "none", 0).next_offset == 0


def test_follow_drains_after_done(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"one\n")
    calls = []

    def done() -> bool:
        calls.append(1)
        if len(calls) == 2:
            with log.open("ab") as handle:
                handle.write(b"two\n")
        return len(calls) >= 2

    chunks = list(follow(log, 0, done=done, poll_seconds=0, limit=4))
    assert [chunk.data for chunk in chunks] == [b"one\n", b"two\n"]
    assert chunks[-1].next_offset == 8


def _fake_proc(tmp_path: Path, cgroup_lines: str, mountinfo: str) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(cgroup_lines)
    info = tmp_path / "mountinfo"
    info.write_text(mountinfo)
    return proc, info


def test_memory_cgroup_v1_and_v2(tmp_path: Path) -> None:
    v1 = ("30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid shared:9 - cgroup cgroup rw,memory\n"
          "31 25 0:27 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw\n")
    proc, info = _fake_proc(tmp_path, "4:memory:/gpucloud/s/c1\n0::/gpucloud/s/c1\n", v1)
    assert memory_cgroup_dir(42, proc, info) == Path("/sys/fs/cgroup/memory/gpucloud/s/c1")
    v2 = "35 25 0:30 / /sys/fs/cgroup rw shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    proc, info = _fake_proc(tmp_path / "2", "0::/gpucloud/s/c2\n", v2)
    assert memory_cgroup_dir(42, proc, info) == Path("/sys/fs/cgroup/gpucloud/s/c2")
    nested = "35 25 0:30 /outer /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    proc, info = _fake_proc(tmp_path / "3", "0::/outer/gpucloud/c3\n", nested)
    assert memory_cgroup_dir(42, proc, info) == Path("/sys/fs/cgroup/gpucloud/c3")
    assert memory_cgroup_dir(7, proc, info) is None


def test_oom_killed_counters(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert oom_killed(v1, killed_by_sigkill=False)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (v1 / "memory.failcnt").write_text("12\n")
    assert not oom_killed(v1, killed_by_sigkill=True)  # the counter is exact
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert oom_killed(v2, killed_by_sigkill=True)
    old = tmp_path / "old-kernel"
    old.mkdir()
    (old / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    (old / "memory.failcnt").write_text("3\n")
    assert oom_killed(old, killed_by_sigkill=True)
    assert not oom_killed(old, killed_by_sigkill=False)
    assert not oom_killed(None, killed_by_sigkill=True)


def test_exit_info_reasons() -> None:
    assert ExitInfo(exit_code=137, signal=9, oom_killed=True).reason == "OOMKilled"
    assert ExitInfo(exit_code=None, error="runc create failed: x").reason == "runc create failed: x"
    assert ExitInfo(exit_code=0).succeeded and ExitInfo(exit_code=0).reason is None
    record = {"exit_code": 1, "signal": None, "future_field": True}
    assert ExitInfo.from_record(record) == ExitInfo(exit_code=1)


def test_runc_error_takes_the_last_logged_error(tmp_path: Path) -> None:
    log = tmp_path / "runc.log"
    log.write_text('{"level":"error","msg":"first"}\nnot json\n'
                   '{"level":"error","msg":"container_linux.go: bad cwd"}\n'
                   '{"level":"info","msg":"x"}\n')
    assert runc_error(log, "fallback") == "container_linux.go: bad cwd"
    assert runc_error(tmp_path / "none", "fallback") == "fallback"


def test_driver_naming(tmp_path: Path) -> None:
    first, second = RuncDriver(tmp_path / "a"), RuncDriver(tmp_path / "b")
    assert first.cgroup_path("c1") != second.cgroup_path("c1")
    assert first.cgroup_path("c1") == RuncDriver(tmp_path / "a").cgroup_path("c1")
    with pytest.raises(InvalidInput, match="not a valid container id"):
        first.paths("../escape")
