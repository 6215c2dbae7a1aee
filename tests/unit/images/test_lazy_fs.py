"""The FUSE reply structures, splice sizing and failed reads of ``images/lazy/fs.py``
(no mount: the operations are called directly)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
from pathlib import Path

import httpx
import mfusepy
import pytest

from gpucloud.images.lazy import fs
from gpucloud.images.lazy.cache import ChunkCache
from gpucloud.images.lazy.estargz import convert_layer
from gpucloud.images.lazy.fetch import RangeFetcher
from gpucloud.images.lazy.layer import READ_FAILURE_EVENT_INTERVAL, LazyLayer
from gpucloud.images.lazy.scheduler import FetchScheduler
from gpucloud.images.testing import layer_tar
from tests.fixtures.registry import free_port


def test_fd_bufvec_packs_libfuse_structs() -> None:
    """The ``struct``-packed vector reads back field by field as ``fuse_bufvec``."""
    extents = [(7, 4095, 1 << 20), (9, 0, 3)]
    address = fs._fd_bufvec(extents)
    try:
        head = fs._BufvecHead.from_address(address)
        assert (head.count, head.idx, head.off) == (2, 0, 0)
        bufs = (fs._FuseBuf * 2).from_address(address + ctypes.sizeof(fs._BufvecHead))
        got = [(b.fd, b.pos, b.size, b.flags, b.mem) for b in bufs]
        flags = fs.FUSE_BUF_IS_FD | fs.FUSE_BUF_FD_SEEK
        assert got == [(7, 4095, 1 << 20, flags, None), (9, 0, 3, flags, None)]
    finally:
        fs._libc.free(ctypes.c_void_p(address))


def test_splice_max_read_fits_a_reply_in_a_permitted_pipe() -> None:
    """Either a 2 MiB pipe is allowed (no cap), or a capped reply (data, a page per
    buffer for a few buffers, the header) fits the largest pipe this process may have."""
    cap = fs.splice_max_read()
    read_fd, write_fd = os.pipe()
    try:
        if cap == 0:
            assert fcntl.fcntl(read_fd, fs.F_SETPIPE_SZ, 2 << 20) >= 2 << 20
        else:
            limit = int(open("/proc/sys/fs/pipe-max-size").read())
            assert cap % 4096 == 0 and 128 << 10 <= cap < limit
            assert cap + 4096 * 6 + 16 <= fcntl.fcntl(read_fd, fs.F_SETPIPE_SZ, limit)
    finally:
        os.close(read_fd)
        os.close(write_fd)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _layer_behind_a_closed_port(tmp_path: Path, events: list[tuple[str, str]],
                                clock: Clock) -> LazyLayer:
    """A layer of three files whose registry is gone (nothing listens on its port; the
    URL carries a token in its query, which no event may show). Nothing is cached."""
    tar = tmp_path / "layer.tar"
    tar.write_bytes(layer_tar({f"data/{n}.bin": os.urandom(3000) for n in "abc"}))
    blob = tmp_path / "blob"
    with blob.open("wb") as out:
        converted = convert_layer(tar, out, level=1)
    http = httpx.Client()
    url = f"http://127.0.0.1:{free_port()}/v2/app/blobs/{converted.digest}?token=s3cret"
    fetcher = RangeFetcher(http, http, url, converted.size, attempts=2, backoff=0.001,
                           deadline=2.0)
    return LazyLayer(converted.digest, converted.toc, fetcher,
                     ChunkCache(tmp_path / "cache", 1 << 20),
                     lambda reason, message: events.append((reason, message)),
                     FetchScheduler(threads=False, read_deadline=2.0), clock=clock)


def _read_fails_with_eio(layer_fs: fs.LayerFs, path: str) -> None:
    with pytest.raises(mfusepy.FuseOSError) as exc:
        layer_fs.read(path, 100, 0, 0)
    assert exc.value.errno == errno.EIO


def test_a_failed_read_is_eio_and_an_event_at_most_once_per_interval(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Registry unreachable: every uncached read is ``EIO``, and the layer's pods hear of
    it by a ``LazyReadFailed`` event naming the layer, one line, no token (nor in the
    daemon's log); a reader retrying gets no event per read, but one per interval
    counting the others."""
    caplog.set_level(logging.WARNING, logger=fs.__name__)
    events: list[tuple[str, str]] = []
    clock = Clock()
    layer = _layer_behind_a_closed_port(tmp_path, events, clock)
    layer_fs = fs.LayerFs(layer)
    _read_fails_with_eio(layer_fs, "/data/a.bin")
    assert len(events) == 1
    reason, message = events[0]
    assert reason == "LazyReadFailed" and f"layer {layer.digest}" in message
    assert "data/a.bin" in message and "127.0.0.1" in message
    assert "\n" not in message and "s3cret" not in message
    clock.now += 1
    _read_fails_with_eio(layer_fs, "/data/b.bin")
    _read_fails_with_eio(layer_fs, "/data/a.bin")
    assert len(events) == 1
    clock.now += READ_FAILURE_EVENT_INTERVAL
    _read_fails_with_eio(layer_fs, "/data/c.bin")
    assert [r for r, _ in events] == ["LazyReadFailed"] * 2
    assert "data/c.bin" in events[1][1] and "(2 more failed reads since the last event)" \
        in events[1][1]
    assert layer.stats.errors == 4
    logged = [r.getMessage() for r in caplog.records if r.name == fs.__name__]
    assert len(logged) == 4 and not any("s3cret" in line for line in logged)
