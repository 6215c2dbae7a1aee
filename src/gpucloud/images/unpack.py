"""Unpacking layer tarballs safely, with OCI whiteouts, in one of two formats.

``Whiteouts.APPLY`` applies a layer onto a directory that already holds the layers below
it, the classic way: ``.wh.NAME`` deletes ``NAME``, ``.wh..wh..opq`` empties its directory
of everything the lower layers put there. ``Whiteouts.OVERLAY`` unpacks a layer into its
own empty directory and turns whiteouts into what overlayfs understands (a 0/0 character
device, the ``trusted.overlay.opaque`` xattr), so the directory can be a ``lowerdir``.

Every entry is created with chroot semantics: its parent path is resolved inside the root,
following symlinks as the container would (an absolute link target is re-rooted), so a
layer cannot write outside the root through a symlink an earlier entry or layer planted.
Entry names containing ``..`` that would climb out, hard links to outside, and relative
symlink targets that climb above the root are refused with ``UnsafeLayer``.

The uncompressed tar stream is hashed while it is read, giving the layer's ``diff_id``.
The root-level ``stargz.index.json``, ``.prefetch.landmark`` and ``.no.prefetch.landmark`` of
an eStargz layer are skipped (still hashed), so a full pull gives the same rootfs as a lazy mount.
"""

from __future__ import annotations

import enum
import errno
import gzip
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard
from typing_extensions import Buffer

from gpucloud.images.errors import InvalidImage, UnsafeLayer
from gpucloud.images.lazy.toc import HIDDEN_ROOT_NAMES

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_SIZE = 1 << 20
# tarfile's stream mode slices its whole read buffer for every header and payload read
# (``_Stream.__read``): with a 1 MiB buffer each small file copied about 2 MiB, a third of
# a Python-tree layer's unpack CPU. A small tar buffer over a 1 MiB buffered reader keeps
# the big reads from the decompressor and makes the slicing cheap.
_TAR_BUFSIZE = 16 << 10
_MAX_SYMLINK_HOPS = 40


class Whiteouts(enum.Enum):
    """How a layer's whiteout entries are materialized."""

    APPLY = "apply"
    OVERLAY = "overlay"


class _HashingReader(io.RawIOBase):
    """A read-only raw stream that hashes everything read through it."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.hasher = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._raw.read(len(view))
        view[: len(data)] = data
        self.hasher.update(data)
        return len(data)

    def drain(self) -> None:
        while self.read(_READ_SIZE):
            pass


@contextmanager
def open_decompressed(path: Path) -> Iterator[BinaryIO]:
    """Open a layer blob as an uncompressed tar stream, detecting gzip/zstd by magic."""
    with path.open("rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if magic.startswith(_GZIP_MAGIC):
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield stream  # type: ignore[misc]
        elif magic == _ZSTD_MAGIC:
            with zstandard.ZstdDecompressor().stream_reader(raw) as zstream:
                yield zstream
        else:
            yield raw


def unpack_layer(path: Path, dest: Path, whiteouts: Whiteouts) -> str:
    """Unpack the layer blob at ``path`` into ``dest``; return its ``diff_id``."""
    with open_decompressed(path) as stream:
        return unpack_stream(stream, dest, whiteouts)


def unpack_stream(stream: BinaryIO, dest: Path, whiteouts: Whiteouts) -> str:
    """Unpack an uncompressed tar stream into ``dest``; return its ``diff_id``."""
    reader = _HashingReader(stream)
    unpacker = _Unpacker(dest.resolve(), whiteouts)
    try:
        buffered = io.BufferedReader(reader, _READ_SIZE)
        with tarfile.open(fileobj=buffered, mode="r|", bufsize=_TAR_BUFSIZE) as tar:
            for member in tar:
                unpacker.add(tar, member)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zstandard.ZstdError) as exc:
        raise InvalidImage(f"layer is not a valid tar archive: {exc}") from exc
    unpacker.finish()
    reader.drain()
    return "sha256:" + reader.hasher.hexdigest()


@dataclass
class _Unpacker:
    """The state of one layer's unpacking: its root, what it created, deferred dir modes."""

    root: Path
    whiteouts: Whiteouts
    created: set[str] = field(default_factory=set)
    dirs: list[tuple[Path, tarfile.TarInfo]] = field(default_factory=list)
    is_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    # Parent directories already resolved (entry paths share them): resolving follows
    # symlinks a component at a time, an lstat each. Only a symlink's creation or a
    # removal can change what a path resolves to; both clear it.
    resolved: dict[str, Path] = field(default_factory=dict)

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = _clean_name(member.name)
        if rel == "" or rel in HIDDEN_ROOT_NAMES:
            return  # an eStargz layer's TOC and landmark are not part of the rootfs
        parent_rel, base = posixpath.split(rel)
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(parent_rel, base)
            return
        parent = self._ensure_dir(parent_rel)
        target = parent / base
        self.created.add(rel)
        if member.isdir():
            self._make_dir(target, member)
            return
        self._remove(target)
        # a hard link shares its target's inode, whose metadata its own entry already set
        if self._create(tar, member, target, rel) and not member.islnk():
            self._set_metadata(target, member, member.issym())

    def finish(self) -> None:
        """Apply directory modes and times last, deepest first, as tar itself does."""
        for path, member in reversed(self.dirs):
            # a later entry may have replaced the directory with a symlink: never follow it
            self._set_metadata(path, member, path.is_symlink())

    def _create(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path, rel: str
    ) -> bool:
        """Create the entry; False when it is skipped (a device node without root)."""
        if member.isreg():
            _write_file(tar, member, target)
        elif member.issym():
            _check_symlink(rel, member.linkname)
            self.resolved.clear()
            os.symlink(member.linkname, target)
        elif member.islnk():
            os.link(self._hardlink_source(member.linkname), target, follow_symlinks=False)
        elif member.isfifo():
            os.mkfifo(target, member.mode & 0o7777)
        elif member.ischr() or member.isblk():
            return self._make_device(member, target)
        else:
            return False  # sparse/contiguous/unknown types: nothing a rootfs needs
        return True

    def _make_device(self, member: tarfile.TarInfo, target: Path) -> bool:
        """Device nodes need CAP_MKNOD; without it they are skipped (runc adds /dev)."""
        if not self.is_root:
            return False
        kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
        device = os.makedev(member.devmajor, member.devminor)
        try:
            os.mknod(target, kind | (member.mode & 0o7777), device)
        except PermissionError:
            return False
        return True

    def _make_dir(self, target: Path, member: tarfile.TarInfo) -> None:
        try:
            target.mkdir()
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(target).st_mode):
                self._remove(target)
                target.mkdir()
        self.dirs.append((target, member))

    def _whiteout(self, parent_rel: str, base: str) -> None:
        parent = self._ensure_dir(parent_rel)
        if base == OPAQUE_MARKER:
            self._opaque(parent, parent_rel)
        elif base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            return  # other AUFS metadata (.wh..wh.plnk …) carries nothing for us
        elif self.whiteouts is Whiteouts.OVERLAY:
            os.mknod(parent / base[len(WHITEOUT_PREFIX) :], stat.S_IFCHR, os.makedev(0, 0))
        else:
            self._remove(parent / base[len(WHITEOUT_PREFIX) :])

    def _opaque(self, parent: Path, parent_rel: str) -> None:
        if self.whiteouts is Whiteouts.OVERLAY:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            return
        for child in os.listdir(parent):
            if posixpath.join(parent_rel, child) not in self.created:
                self._remove(parent / child)

    def _ensure_dir(self, rel: str) -> Path:
        """The real directory for ``rel``, resolved in-root and created when missing."""
        known = self.resolved.get(rel)
        if known is not None:
            return known
        path = self._resolve(rel)
        if not path.is_dir():
            self._remove(path)
            path.mkdir(parents=True, exist_ok=True)
        self.resolved[rel] = path
        return path

    def _remove(self, path: Path) -> None:
        """Remove whatever is at ``path`` (file, link, or directory tree); nothing if
        absent. Anything removed may have been on a resolved path: forget them all."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        self.resolved.clear()
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            path.unlink()

    def _resolve(self, rel: str) -> Path:
        """Resolve ``rel`` inside the root, following symlinks with chroot semantics."""
        current = self.root
        pending = [p for p in rel.split("/") if p not in ("", ".")]
        hops = 0
        while pending:
            part = pending.pop(0)
            if part == "..":
                current = current.parent if current != self.root else current
                continue
            candidate = current / part
            if not candidate.is_symlink():
                current = candidate
                continue
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise UnsafeLayer(f"too many levels of symbolic links under {rel!r}")
            link = os.readlink(candidate)
            current = self.root if link.startswith("/") else current
            pending = [p for p in link.split("/") if p not in ("", ".")] + pending
        return current

    def _hardlink_source(self, linkname: str) -> Path:
        rel = _clean_name(linkname)
        source = self._resolve(posixpath.dirname(rel)) / posixpath.basename(rel)
        if not source.exists() and not source.is_symlink():
            raise InvalidImage(f"layer hard link points to missing file {linkname!r}")
        return source

    def _set_metadata(self, path: Path, member: tarfile.TarInfo, is_link: bool) -> None:
        if self.is_root:
            os.lchown(path, member.uid, member.gid)
            _set_xattrs(path, member)
        if not is_link:
            os.chmod(path, member.mode & 0o7777)
        os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _clean_name(name: str) -> str:
    """A tar entry name as a clean relative path; refuse one that climbs out of the root."""
    normalized = posixpath.normpath(name.lstrip("/"))
    if normalized == ".." or normalized.startswith("../"):
        raise UnsafeLayer(f"layer entry {name!r} escapes the root filesystem")
    return "" if normalized == "." else normalized


def _check_symlink(rel: str, target: str) -> None:
    """Refuse a relative symlink target that climbs above the root from where it lives."""
    if target.startswith("/"):
        return
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if joined == ".." or joined.startswith("../"):
        raise UnsafeLayer(f"symlink {rel!r} -> {target!r} escapes the root filesystem")


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    source = tar.extractfile(member)
    if source is None:
        raise InvalidImage(f"layer entry {member.name!r} has no content")
    with source, open(target, "wb") as out:
        shutil.copyfileobj(source, out, _READ_SIZE)


def _set_xattrs(path: Path, member: tarfile.TarInfo) -> None:
    for key, value in member.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        name = key[len("SCHILY.xattr.") :]
        raw = value.encode("utf-8", "surrogateescape")
        try:
            os.setxattr(path, name, raw, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EPERM):
                raise
