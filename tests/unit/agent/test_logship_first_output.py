"""What the watch loop asks the shipper while it waits for a pod's first output."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from gpucloud.agent.connection import Connection
from gpucloud.agent.logship import LogShipper, Offsets


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
