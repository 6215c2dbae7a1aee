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

import datetime
import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import mfusepy

from gpucloud.images.errors import ImageError
from gpucloud.images.lazy.layer import LazyLayer
from gpucloud.images.lazy.toc import HIDDEN_ROOT_NAMES, Toc, TocEntry, clean_name

log = logging.getLogger(__name__)

CACHE_SECONDS = 86400.0
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_TYPE_BITS = {
    "dir": stat.S_IFDIR, "reg": stat.S_IFREG, "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR, "block": stat.S_IFBLK, "fifo": stat.S_IFIFO,
}


@dataclass
class Node:
    """One path of the layer as the kernel sees it."""

    ino: int
    kind: str
    mode: int
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime: float = 0.0
    rdev: int = 0
    link: str = ""
    data_path: str = ""
    nlink: int = 1
    xattrs: dict[str, bytes] = field(default_factory=dict)
    children: dict[str, Node] = field(default_factory=dict)


def build_tree(toc: Toc) -> dict[str, Node]:
    """``path -> Node`` for every visible path ('' is the root), parents made as needed."""
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
            _add(nodes, hidden, Node(len(nodes) + 1, "char", 0, rdev=0))
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
    node.xattrs.update(ent.xattrs)


def _mtime(value: str) -> float:
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
    """mfusepy operations over a ``LazyLayer``; read errors become ``EIO``."""

    use_ns = True

    def __init__(self, layer: LazyLayer) -> None:
        self.layer = layer
        self.nodes = build_tree(layer.toc)
        self._by_ino = {node.ino: node for node in self.nodes.values()}

    def _node(self, path: str) -> Node:
        node = self.nodes.get(path.strip("/"))
        if node is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return node

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:  # noqa: ARG002 - mfusepy's signature
        node = self._node(path)
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

    def readlink(self, path: str) -> str:
        node = self._node(path)
        if node.kind != "symlink":
            raise mfusepy.FuseOSError(errno.EINVAL)
        return node.link

    def open(self, path: str, flags: int) -> int:
        node = self._node(path)
        if flags & 3 != 0:
            raise mfusepy.FuseOSError(errno.EROFS)
        return node.ino

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        node = self._by_ino.get(fh) or self._node(path)
        if node.kind != "reg":
            raise mfusepy.FuseOSError(errno.EISDIR)
        if offset >= node.size:
            return b""
        try:
            return self.layer.read(node.data_path, offset, size)
        except (ImageError, OSError) as exc:
            self.layer.stats.errors += 1
            log.warning("read of %s in layer %s failed: %s", path, self.layer.digest, exc)
            raise mfusepy.FuseOSError(errno.EIO) from exc

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


def serve(layer: LazyLayer, mountpoint: str) -> None:
    """Mount ``layer`` at ``mountpoint`` and serve it until it is unmounted (blocks)."""
    mfusepy.FUSE(LayerFs(layer), mountpoint, **MOUNT_OPTIONS)
