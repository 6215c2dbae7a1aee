"""What the watch loop asks the shipper while it waits for a pod's first output."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import cast

from gpucloud.agent.connection import Connection
from gpucloud.agent.logship import LogShipper, LogWatch, Offsets


def test_the_shipper_sees_unshipped_bytes_with_a_stat(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    shipper = LogShipper(cast(Connection, None), "p1", log, tmp_path / "record.json")
    assert not shipper.behind() and not shipper.shipped_any()  # no log file yet
    log.write_bytes(b"")
    assert not shipper.behind()
    log.write_bytes(b"first line\n")
    assert shipper.behind() and not shipper.shipped_any()
    shipper.offsets = Offsets(file=11, server=11)  # what an accepted chunk leaves
    assert shipper.shipped_any() and not shipper.behind()
    with log.open("ab") as out:
        out.write(b"more")
    assert shipper.behind()


def test_the_watch_wakes_on_a_write_made_after_it_opened_and_on_interrupt(
        tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    assert LogWatch.open(log) is None  # no file: the caller falls back to the stat
    log.write_bytes(b"before\n")
    watch = LogWatch.open(log)
    assert watch is not None
    try:
        assert not watch.wait(0)  # the write before the watch is the size check's
        with log.open("ab") as out:  # the container's fd, appending
            out.write(b"first line\n")
            out.flush()
        assert watch.wait(0)
        assert not watch.wait(0)  # drained: one wake-up per batch of writes
        watch.interrupt()
        watch.interrupt()
        assert watch.wait(0) and not watch.wait(0)
    finally:
        watch.close()
    watch.interrupt()  # after close: nothing (no write to a reused descriptor)
    watch.close()


def test_a_waiting_watch_returns_when_another_process_writes(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    log.write_bytes(b"")
    watch = LogWatch.open(log)
    assert watch is not None
    try:
        writer = subprocess.Popen(["sh", "-c", f"read _; echo line >> {log}"],
                                  stdin=subprocess.PIPE)
        assert writer.stdin is not None
        writer.stdin.write(b"go\n")
        writer.stdin.close()
        assert watch.wait(30)  # returns at the write, not after the 30 s
        assert writer.wait(30) == 0
        assert log.read_bytes() == b"line\n"
    finally:
        watch.close()
