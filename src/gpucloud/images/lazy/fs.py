"""The read-only FUSE view of one eStargz layer, in overlayfs lower-layer form (mfusepy).

The tree comes from the TOC alone: stat, readdir and readlink never touch the network;
only ``read`` of file bytes does (through ``LazyLayer``). The layer is immutable, so the
mount tells the kernel to cache everything for a day: attributes, entries, negative
lookups (``negative_timeout``) and file pages (``kernel_cache``, no ``direct_io``, so mmap
of shared libraries and weights works). Inode numbers are stable (``use_ino``), hard links
share theirs and count their links.

Layer semantics: whiteouts are shown as overlayfs wants them (``.wh.x`` → character
device 0:0 named ``x``; ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` on its directory),
and the landmarks and ``stargz.index.json`` at the layer root are hidden.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import logging
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mfusepy

from gpucloud.images.errors import ImageError
from gpucloud.images.lazy.cache import CachedFd
from gpucloud.images.lazy.layer import LazyLayer, redacted_line
from gpucloud.images.lazy.toc import HIDDEN_ROOT_NAMES, Toc, TocEntry, clean_name, gc_paused

log = logging.getLogger(__name__)

CACHE_SECONDS = 86400.0
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_TYPE_BITS = {
    "dir": stat.S_IFDIR, "reg": stat.S_IFREG, "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR, "block": stat.S_IFBLK, "fifo": stat.S_IFIFO,
}


class Node:
    """One path of the layer as the kernel sees it. A plain class with slots, not a
    dataclass (whose generated ``__init__`` calls two default factories): a large layer has
    one per entry, built while a pod waits for its mount (``build_tree`` of the bench's
    tree layer: 116-165 ms before, 87-129 ms with this and the TOC's changes, under load)."""

    __slots__ = ("ino", "kind", "mode", "uid", "gid", "size", "mtime", "rdev", "link",
                 "data_path", "nlink", "xattrs", "children")

    def __init__(self, ino: int, kind: str, mode: int) -> None:
        self.ino = ino
        self.kind = kind
        self.mode = mode
        self.uid = self.gid = self.size = self.rdev = 0
        self.mtime = 0.0
        self.link = self.data_path = ""
        self.nlink = 1
        self.xattrs: dict[str, bytes] = {}
        self.children: dict[str, Node] = {}


def build_tree(toc: Toc) -> dict[str, Node]:
    """``path -> Node`` for every visible path ('' is the root), parents made as needed
    (without cyclic GC passes over the growing tree: ``toc.gc_paused``)."""
    with gc_paused():
        return _build_tree(toc)


def _build_tree(toc: Toc) -> dict[str, Node]:
    nodes: dict[str, Node] = {"": Node(1, "dir", 0o755)}
    links: list[TocEntry] = []
    for ent in toc.files():
        path = ent.path
        if path == "" and ent.type == "dir":
            _apply_entry(nodes[""], ent)
            continue
        parent, _, base = path.rpartition("/")
        if parent == "" and base in HIDDEN_ROOT_NAMES:
            continue
        if ent.type == "hardlink":
            links.append(ent)
            continue
        if base == _OPAQUE:
            _dir(nodes, parent).xattrs["trusted.overlay.opaque"] = b"y"
            continue
        if base.startswith(_WHITEOUT):
            hidden = f"{parent}/{base[len(_WHITEOUT):]}".lstrip("/")
            _add(nodes, hidden, Node(len(nodes) + 1, "char", 0))
            continue
        node = _add(nodes, path, Node(len(nodes) + 1, ent.type, 0))
        _apply_entry(node, ent)
    for ent in links:
        target = nodes.get(clean_name(ent.linkName))
        if target is not None and target.kind != "dir":
            target.nlink += 1
            _add(nodes, ent.path, target)
    return nodes


def _apply_entry(node: Node, ent: TocEntry) -> None:
    node.mode = ent.mode
    node.uid, node.gid = ent.uid, ent.gid
    node.size = ent.size if ent.type == "reg" else len(ent.linkName) if ent.type == "symlink" else 0
    node.mtime = _mtime(ent.modtime)
    node.rdev = (ent.devMajor << 8) | ent.devMinor if ent.type in ("char", "block") else 0
    node.link = ent.linkName if ent.type == "symlink" else ""
    node.data_path = ent.path if ent.type == "reg" else ""
    if ent.xattrs:
        node.xattrs.update(ent.xattrs)


def _mtime(value: str) -> float:
    got = _MTIMES.get(value)
    if got is None:
        got = _MTIMES[value] = _parse_mtime(value)
        if len(_MTIMES) > 65536:
            _MTIMES.clear()
    return got


_MTIMES: dict[str, float] = {}
"""Parsed ``modtime`` strings: the entries of a layer mostly share a few (a build's time),
and parsing every one again was a sizeable part of building a large layer's tree."""


def _parse_mtime(value: str) -> float:
    if not value:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _dir(nodes: dict[str, Node], path: str) -> Node:
    node = nodes.get(path)
    if node is None:
        node = _add(nodes, path, Node(len(nodes) + 1, "dir", 0o755))
    return node


def _add(nodes: dict[str, Node], path: str, node: Node) -> Node:
    """Put ``node`` at ``path`` (replacing a placeholder dir keeps its children)."""
    parent, _, base = path.rpartition("/")
    old = nodes.get(path)
    if old is not None and old.kind == "dir" and node.kind == "dir":
        node.children = old.children
        node.xattrs = {**old.xattrs, **node.xattrs}
    nodes[path] = node
    _dir(nodes, parent).children[base] = node
    return node


class LayerFs(mfusepy.Operations):  # type: ignore[misc]
    """mfusepy operations over a ``LazyLayer``; read errors become ``EIO``.

    Every callback is a Python call from a libfuse thread (GIL, ctypes), so what libfuse
    or the kernel can answer is left to them: ``open`` refuses with ``ENOSYS`` and the
    kernel stops asking (no OPEN, no RELEASE); ``flush`` is not implemented (libfuse answers
    ``ENOSYS`` and the kernel stops sending it), nor the xattr calls on a layer without
    xattrs."""

    use_ns = True

    def __init__(self, layer: LazyLayer, max_read: int = 0,
                 on_init: Callable[[], None] | None = None) -> None:
        self.layer = layer
        self._on_init = on_init
        self.nodes = build_tree(layer.toc)
        self._max_read = max_read
        # Uncached reads: fetched into the cache, then spliced from it like cached ones
        # (GPUCLOUD_LAZYFS_COPY_READS=1: the old path, the bytes copied into a buffer).
        self._fetch_to_cache = os.environ.get("GPUCLOUD_LAZYFS_COPY_READS") != "1"
        self._attrs: dict[str, dict[str, Any]] = {}
        self._stat_images: dict[str, bytes] = {}
        # Per libfuse worker thread (by its pthread id): the extents its last reply used.
        # Not a threading.local: a ctypes callback on a thread Python did not start gets a
        # fresh thread state each time, so a thread-local was always empty on the next
        # call, no descriptor was ever given back, and a large layer's reads ran the
        # daemon out of file descriptors (20,000: its control socket then failed).
        self._held: dict[int, list[tuple[CachedFd, int, int]]] = {}
        if not any(node.xattrs for node in self.nodes.values()):
            # No xattrs in the layer: getxattr/listxattr are not given to libfuse, which
            # answers ENOSYS, and the kernel stops asking (EOPNOTSUPP from then on, which
            # overlayfs takes as "none"). Otherwise overlayfs asks for its trusted.overlay.*
            # attributes at nearly every lookup: 977 Python callbacks for the bench start's
            # 742 files, more than its reads.
            self.getxattr = self.listxattr = _not_for_libfuse  # type: ignore[method-assign,assignment]

    def init_with_config(self, conn: Any, config: Any) -> None:  # noqa: ARG002 - mfusepy's signature
        """Ask for splice replies: libfuse then moves cached chunk pages to ``/dev/fuse``
        through a pipe instead of a malloc + ``pread`` + ``writev`` of every byte (the
        fallback, which spent most of the daemon's CPU in page faults on fresh buffers).
        ``max_read`` must be repeated here (libfuse 3.14 refuses a mismatch)."""
        if self._on_init is not None:
            self._on_init()  # the kernel's INIT: the mount exists and is being served
        if conn is None:
            return
        conn.want |= conn.capable & FUSE_CAP_SPLICE_WRITE  # not MOVE: the chunk files'
        # page-cache pages are shared; the kernel copies them out of the pipe either way
        if self._max_read:
            conn.max_read = self._max_read

    def _node(self, path: str) -> Node:
        node = self.nodes.get(path.strip("/"))
        if node is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return node

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:  # noqa: ARG002 - mfusepy's signature
        """The node's attributes, built once per path (the layer never changes): a walk
        (and readdirplus, which libfuse answers with a getattr per entry) is one dict
        lookup per entry."""
        attrs = self._attrs.get(path)
        if attrs is None:
            attrs = self._attrs[path] = self._stat(self._node(path))
        return attrs

    def stat_image(self, path: str) -> bytes:
        """The node's ``struct stat``, as bytes, built once per path: ``_LayerFuse``
        copies it into libfuse's buffer. (mfusepy fills that struct field by field from the
        ``getattr`` dict, with a ``getattr``/``setattr`` pair per key and a ``divmod`` per
        time, on every call: about 10 us of Python per lookup, against 1 for the copy.)"""
        image = self._stat_images.get(path)
        if image is None:
            st = mfusepy.c_stat()
            mfusepy.set_st_attrs(st, self._stat(self._node(path)), use_ns=True)
            image = self._stat_images[path] = bytes(st)
        return image

    def _stat(self, node: Node) -> dict[str, Any]:
        ns = int(node.mtime * 1e9)
        nlink = 2 + sum(1 for c in node.children.values() if c.kind == "dir") \
            if node.kind == "dir" else node.nlink
        return {
            "st_ino": node.ino, "st_mode": _TYPE_BITS[node.kind] | node.mode,
            "st_nlink": nlink, "st_uid": node.uid, "st_gid": node.gid, "st_size": node.size,
            "st_rdev": node.rdev, "st_mtime": ns, "st_ctime": ns, "st_atime": ns,
            "st_blocks": (node.size + 511) // 512, "st_blksize": 1 << 17,
        }

    def readdir(
        self, path: str, fh: int  # noqa: ARG002 - mfusepy's signature
    ) -> list[tuple[str, dict[str, int], int]]:
        """Names with mode and inode: the kernel drops READDIRPLUS entries of mode 0."""
        node = self._node(path)
        if node.kind != "dir":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        dirs = [(".", node), ("..", node)]
        return [(name, {"st_mode": _TYPE_BITS[child.kind] | child.mode, "st_ino": child.ino}, 0)
                for name, child in [*dirs, *node.children.items()]]

    def open(self, path: str, flags: int) -> int:  # noqa: ARG002 - mfusepy's signature
        """Refused with ``ENOSYS`` (once): the kernel then opens this mount's files by itself
        (``no_open``, Linux 4.19+), with no OPEN and no RELEASE request per open: two round
        trips through libfuse fewer for every file a start opens. Such opens default to
        ``keep_cache``, as this mount wants anyway. Nothing is set up per open: the mount is
        read-only (the kernel refuses a writable open before asking) and reads find their
        node by path."""
        raise mfusepy.FuseOSError(errno.ENOSYS)

    def readlink(self, path: str) -> str:
        node = self._node(path)
        if node.kind != "symlink":
            raise mfusepy.FuseOSError(errno.EINVAL)
        return node.link

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:  # noqa: ARG002 - mfusepy's signature
        node = self._node(path)
        if node.kind != "reg":
            raise mfusepy.FuseOSError(errno.EISDIR)
        if offset >= node.size:
            return b""
        with self._eio_on_failure(path):
            return self.layer.read(node.data_path, offset, size)

    def read_buf(self, path: str, bufpp: Any, size: int, offset: int, fh: int  # noqa: ARG002 - mfusepy's signature
                 ) -> int:
        """Zero-copy read (libfuse's ``read_buf``, used in place of ``read``): for cached
        chunks the reply is a vector of (chunk file descriptor, position, length) that
        libfuse splices to the kernel itself, in C, without the GIL; no byte passes
        through Python. Chunks not cached yet are fetched and handed over as one malloc'd
        buffer (``read``: digests verified first, errors become ``EIO``).

        libfuse reads the descriptors after this returns, so each is held (not closed,
        even if its chunk is evicted) until the same thread's next call (``_held``, by
        thread id): libfuse's worker threads handle one request at a time, so by then that
        reply has been sent. The hot path is dict and list lookups only: no locks of its
        own, no logging."""
        worker = threading.get_ident()
        held = self._held.pop(worker, None)
        if held:
            self.layer.release_extents(held)
        node = self._node(path)
        if node.kind != "reg":
            raise mfusepy.FuseOSError(errno.EISDIR)
        size = max(0, min(size, node.size - offset))
        extents = self.layer.cached_extents(node.data_path, offset, size) if size else []
        if extents is None and self._fetch_to_cache:
            extents = self._fetched_extents(path, node, offset, size)
        if extents is not None:
            _set_pointer(bufpp, _fd_bufvec([(h.fd, pos, length) for h, pos, length in extents]))
            if extents:
                self._held[worker] = extents
                if size >= SEQUENTIAL_REQUEST and offset + size < node.size:
                    self._advise(node, offset, size)
            return 0
        _set_pointer(bufpp, _mem_bufvec(self.read(path, size, offset, fh)))
        return 0

    def _fetched_extents(self, path: str, node: Node, offset: int, size: int
                         ) -> list[tuple[CachedFd, int, int]] | None:
        """Fetch the missing chunks into the cache (verified first, as always), then the
        extents to splice from it; None when a chunk did not stay cached (disk full, or
        evicted meanwhile): the caller then copies the bytes as before. A failed fetch is
        ``EIO``, as in ``read``."""
        with self._eio_on_failure(path):
            self.layer.fetch_missing(node.data_path, offset, size)
        return self.layer.cached_extents(node.data_path, offset, size)

    @contextmanager
    def _eio_on_failure(self, path: str) -> Iterator[None]:
        """A read of ``path`` that failed (registry, digest, disk, read deadline): ``EIO``
        to the reader, never unverified bytes; counted, logged, and an event for the pods
        holding the layer (``LazyLayer.read_failed``, rate-limited)."""
        try:
            yield
        except (ImageError, OSError) as exc:
            self.layer.read_failed(path, exc)
            # redacted as the event is: a presigned URL's signature or a token in a query
            log.warning("read of %s in layer %s failed: %s", redacted_line(path),
                        self.layer.digest, redacted_line(str(exc)))
            raise mfusepy.FuseOSError(errno.EIO) from exc

    def _advise(self, node: Node, offset: int, size: int) -> None:
        """Read ahead the chunk files of ``[offset+AHEAD, offset+size+AHEAD)``: over a
        sequential pass each chunk file is advised once, ``ADVISE_AHEAD`` before the
        reader gets there (the first request of a file advises the whole window). An
        advice of a file already in memory still walks its pages (tens of µs per MiB), so
        advising the whole window on every request would cost more than it saves."""
        start = offset + size if offset == 0 else offset + ADVISE_AHEAD
        end = min(node.size, offset + size + ADVISE_AHEAD)
        if start < end:
            self.layer.advise_ahead(node.data_path, start, end - start)

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:  # noqa: ARG002 - mfusepy's signature
        value = self._node(path).xattrs.get(name)
        if value is None:
            raise mfusepy.FuseOSError(errno.ENODATA)
        return value

    def listxattr(self, path: str) -> list[str]:
        return list(self._node(path).xattrs)

    def statfs(self, path: str) -> dict[str, int]:  # noqa: ARG002 - mfusepy's signature
        total = sum(n.size for n in self.nodes.values() if n.kind == "reg")
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (total + 4095) // 4096,
                "f_bfree": 0, "f_bavail": 0, "f_files": len(self.nodes), "f_ffree": 0,
                "f_namemax": 255}


def _not_for_libfuse(*_args: object) -> None:
    """An operation left to libfuse's default (mfusepy skips ``libfuse_ignore``)."""


_not_for_libfuse.libfuse_ignore = True  # type: ignore[attr-defined]

SEQUENTIAL_REQUEST = 128 << 10
"""A read this large is the kernel's readahead: the reader is going sequentially."""
ADVISE_AHEAD = 4 << 20
"""How far past a sequential read the chunk files are read ahead into the page cache."""
FUSE_BUF_IS_FD = 1 << 1
FUSE_BUF_FD_SEEK = 1 << 2
FUSE_CAP_SPLICE_WRITE = 1 << 7
_libc = ctypes.CDLL(None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]


class _FuseBuf(ctypes.Structure):
    """``struct fuse_buf`` (fuse_common.h, libfuse 3)."""

    _fields_ = [("size", ctypes.c_size_t), ("flags", ctypes.c_int), ("mem", ctypes.c_void_p),
                ("fd", ctypes.c_int), ("pos", ctypes.c_int64)]


class _BufvecHead(ctypes.Structure):
    """The head of ``struct fuse_bufvec``; ``count`` ``fuse_buf`` follow it inline."""

    _fields_ = [("count", ctypes.c_size_t), ("idx", ctypes.c_size_t), ("off", ctypes.c_size_t)]


def _bufvec(count: int) -> tuple[int, ctypes.Array[_FuseBuf]]:
    """A malloc'd ``fuse_bufvec`` of ``count`` buffers (libfuse frees it, and the ``mem``
    of buffers that are not descriptors, after sending the reply)."""
    head = ctypes.sizeof(_BufvecHead)
    size = head + max(1, count) * ctypes.sizeof(_FuseBuf)
    address = _libc.malloc(size)
    if not address:
        raise mfusepy.FuseOSError(errno.ENOMEM)
    ctypes.memset(address, 0, size)
    vec = _BufvecHead.from_address(address)
    vec.count = count
    return address, (_FuseBuf * max(1, count)).from_address(address + head)


def _set_pointer(bufpp: Any, address: int) -> None:
    """``*bufpp = address`` (``bufpp`` is a ``struct fuse_bufvec **``)."""
    ctypes.cast(bufpp, ctypes.POINTER(ctypes.c_void_p))[0] = address


_HEAD = struct.Struct("@NNN")
_BUF = struct.Struct("@NiPiq")  # struct fuse_buf: size, flags, mem, fd, pos
assert _HEAD.size == ctypes.sizeof(_BufvecHead) and _BUF.size == ctypes.sizeof(_FuseBuf)
_FD_FLAGS = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK


def _fd_bufvec(extents: list[tuple[int, int, int]]) -> int:
    """A malloc'd ``fuse_bufvec`` of descriptor buffers, packed with ``struct`` (building
    ctypes structures field by field cost more than the rest of a cached read)."""
    data = _HEAD.pack(len(extents), 0, 0) + b"".join(
        _BUF.pack(length, _FD_FLAGS, 0, fd, pos) for fd, pos, length in extents)
    address = _libc.malloc(max(len(data), _HEAD.size + _BUF.size))
    if not address:
        raise mfusepy.FuseOSError(errno.ENOMEM)
    ctypes.memmove(address, data, len(data))
    return int(address)


def _mem_bufvec(data: bytes) -> int:
    address, bufs = _bufvec(1)
    mem = _libc.malloc(max(1, len(data)))
    if not mem:
        _libc.free(ctypes.c_void_p(address))
        raise mfusepy.FuseOSError(errno.ENOMEM)
    ctypes.memmove(mem, data, len(data))
    bufs[0].size, bufs[0].mem = len(data), mem
    return address


MOUNT_OPTIONS: dict[str, object] = {
    "foreground": True,
    "ro": True,
    "allow_other": True,
    "default_permissions": True,
    "suid": True,
    "dev": True,
    "use_ino": True,
    "kernel_cache": True,
    "attr_timeout": CACHE_SECONDS,
    "entry_timeout": CACHE_SECONDS,
    "negative_timeout": CACHE_SECONDS,
    "fsname": "gpucloud-lazy",
    "subtype": "estargz",
}


READAHEAD_KB = 4096
"""The mount's readahead window. The kernel caps a FUSE mount's readahead at the default
128 KiB whatever ``max_readahead`` the daemon answers in INIT; raised through the mount's
BDI in sysfs, sequential reads reach the daemon as 1 MiB requests (libfuse 3.14 asks for
``max_pages`` 256) instead of 128 KiB ones: 8 times fewer Python round trips."""


def raise_readahead(mountpoint: str, kb: int = READAHEAD_KB) -> bool:
    """Set ``read_ahead_kb`` of the FUSE mount at ``mountpoint``; False where sysfs refuses."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as knob:
            knob.write(str(kb))
    except OSError as exc:
        log.info("cannot raise readahead of %s (%s): %s", mountpoint, path, exc)
        return False
    return True


F_SETPIPE_SZ = 1031
_SPLICE_REPLY = 2 << 20


def splice_max_read() -> int:
    """The ``max_read`` that lets libfuse splice every read reply (0: no cap needed).

    libfuse splices a reply only when its pipe holds the data plus a page per buffer and
    two more; for the kernel's 1 MiB requests that is a 2 MiB pipe, which only a process
    with ``CAP_SYS_RESOURCE`` can have while ``/proc/sys/fs/pipe-max-size`` is 1 MiB (the
    default). Without it libfuse silently falls back to copying, for every request; so
    requests are capped to what the largest permitted pipe can carry."""
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(read_fd, F_SETPIPE_SZ, _SPLICE_REPLY)
        return 0
    except OSError:
        try:
            limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        except (OSError, ValueError):
            limit = 1 << 20
        return max(128 << 10, min(1 << 20, limit) - (8 << 12))
    finally:
        os.close(read_fd)
        os.close(write_fd)


def serve(layer: LazyLayer, mountpoint: str,
          on_init: Callable[[], None] | None = None) -> None:
    """Mount ``layer`` at ``mountpoint`` and serve it until it is unmounted (blocks);
    ``on_init`` is called once the kernel's FUSE ``INIT`` arrives (the mount is up)."""
    max_read = splice_max_read()
    options = {**MOUNT_OPTIONS, **({"max_read": max_read} if max_read else {})}
    _LayerFuse(LayerFs(layer, max_read, on_init), mountpoint, **options)


class _LayerFuse(mfusepy.FUSE):  # type: ignore[misc]
    """mfusepy's libfuse binding, with GETATTR (every lookup, and every entry of a stat
    walk) answered by copying the node's prebuilt ``struct stat`` (``stat_image``)."""

    operations: LayerFs

    def fgetattr(self, path: bytes | None, buf: Any, fip: Any) -> int:
        if path is None:  # by handle only: not asked of this mount (no open, no fh)
            return int(super().fgetattr(path, buf, fip))
        image = self.operations.stat_image(path.decode(self.encoding, self.errors))
        ctypes.memmove(buf, image, len(image))
        return 0
