"""A running usage batch pauses between its statements while a young stretch of API calls
runs on this host (api/usage_worker.Pause), and never longer than the admission's
deferral: ingest keeps its progress under a constant stream of API calls."""

from __future__ import annotations

import struct
from pathlib import Path

from gpucloud.api.usage_worker import Pause


class Host:
    """A controllable clock and the API workers' shared stamp (last call, stretch start)."""

    def __init__(self, path: Path) -> None:
        self.now = 1000.0
        self.path = path
        self.stamp(float("-inf"), float("-inf"))
        self.calls: list[float] = []  # an API call every so often while a pause sleeps
        self.call_every: float | None = None

    def stamp(self, last: float, since: float) -> None:
        self.path.write_bytes(struct.pack("dd", last, since))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.call_every is not None and (not self.calls
                                            or self.now - self.calls[-1] >= self.call_every):
            self.calls.append(self.now)
            since = struct.unpack("dd", self.path.read_bytes())[1]
            self.stamp(self.now, since)


def _pause(host: Host, quiet: float = 0.5, defer: float = 10.0) -> Pause:
    return Pause(host.path, quiet, defer, clock=host.clock, sleep=host.sleep)


def test_quiet_api_no_pause(tmp_path: Path) -> None:
    host = Host(tmp_path / "api-activity")
    pause = _pause(host)
    host.stamp(host.now - 0.6, host.now - 3)  # the last call 0.6 s ago: quiet
    pause()
    assert host.now == 1000.0 and pause.paused == 0


def test_a_burst_holds_the_batch_until_quiet(tmp_path: Path) -> None:
    host = Host(tmp_path / "api-activity")
    pause = _pause(host)
    host.stamp(host.now, host.now)  # a create just now, the stretch begins
    assert pause.held()
    pause()  # no further call: quiet 0.5 s after the last one
    assert 0.5 <= host.now - 1000.0 < 0.52
    assert not pause.held()


def test_a_constant_stream_holds_the_batch_no_longer_than_the_deferral(
        tmp_path: Path) -> None:
    host = Host(tmp_path / "api-activity")
    pause = _pause(host, defer=10.0)
    host.stamp(host.now, host.now - 2)  # a stretch 2 s old, calls every 10 ms from now
    host.call_every = 0.01
    pause()
    assert 7.99 <= host.now - 1000.0 < 8.01  # until the stretch is 10 s old
    assert len(host.calls) > 500  # the API never went quiet meanwhile
    before = host.now
    pause()  # past the deferral: the admission's pacing rules, the batch goes on
    assert host.now == before


def test_no_stamp_no_pause(tmp_path: Path) -> None:
    pause = Pause(None, 0.5, 10.0, clock=lambda: 0.0, sleep=lambda _: None)
    assert not pause.held()
    pause()
