"""The FUSE reply structures and splice sizing of ``images/lazy/fs.py`` (no mount)."""

from __future__ import annotations

import ctypes
import fcntl
import os

from gpucloud.images.lazy import fs


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
