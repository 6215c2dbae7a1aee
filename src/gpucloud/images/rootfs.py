"""Turning a stored image into a pod's root filesystem, fast.

Why overlayfs: a pod start from a cached image must take well under a second, whatever
the image's size. Each layer is unpacked once, into its own directory named by its
``diff_id`` (with whiteouts in overlayfs form), and shared by every pod of every image that
has it; a pod's rootfs is then an overlay mount (lowerdirs = the image's layers, upper and
work dirs in the pod's bundle), which takes milliseconds and leaves the cached layers
untouched whatever the container writes. Releasing the pod unmounts and deletes its upper
dir. Lowerdirs are given through short symlinks (``l/<16 hex>``) so that images with many
layers still fit the kernel's one-page limit on mount options.

The fallback, for an agent without root (development) or a state directory on a file
system overlayfs cannot use: the image's layers are applied once, in order, into a cached
image rootfs, and each pod gets a copy of it (``cp -a --reflink=auto``: cheap on
reflink-capable file systems, a real copy elsewhere).
"""

from __future__ import annotations

import ctypes
import enum
import os
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from gpucloud.images.errors import DigestMismatch, InvalidImage
from gpucloud.images.lazy.trace import mark
from gpucloud.images.manifest import Descriptor, Platform, check_config_platform
from gpucloud.images.pull import Image
from gpucloud.images.store import BlobStore, digest_hex, remove_tree
from gpucloud.images.unpack import Whiteouts, unpack_layer

_MNT_DETACH = 2
_MAX_MOUNT_DATA = 4095
_LINK_ID_LENGTH = 16
_libc = ctypes.CDLL(None, use_errno=True)


class RootfsMode(enum.Enum):
    """How pod root filesystems are composed from layers."""

    OVERLAY = "overlay"
    COPY = "copy"


def mount_overlay(lowerdirs: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount an overlay at ``target``; ``lowerdirs`` top layer first."""
    lower = ":".join(str(p) for p in lowerdirs)
    data = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if len(data) > _MAX_MOUNT_DATA:
        raise InvalidImage("too many layers for one overlay mount")
    result = _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, data.encode())
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"overlay mount failed: {os.strerror(errno)}", str(target))


def unmount(target: Path) -> None:
    """Lazily unmount ``target`` if it is a mount point."""
    if not os.path.ismount(target):
        return
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unmount failed: {os.strerror(errno)}", str(target))


def detect_mode(scratch: Path) -> RootfsMode:
    """``OVERLAY`` when we are root and a trial overlay mount under ``scratch`` works."""
    if os.geteuid() != 0:
        return RootfsMode.COPY
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="overlay-probe-") as probe:
        dirs = [Path(probe) / name for name in ("lower", "upper", "work", "merged")]
        for path in dirs:
            path.mkdir()
        try:
            mount_overlay([dirs[0]], dirs[1], dirs[2], dirs[3])
        except OSError:
            return RootfsMode.COPY
        unmount(dirs[3])
    return RootfsMode.OVERLAY


class LazyLayers(Protocol):
    """Lazily mounted layers (``images.lazy.mounter.LazyMounter``), held per pod bundle."""

    def mount(self, image: Image, layer: Descriptor, bundle: Path) -> Path | None:
        """The layer's read-only mount for this pod, or None to unpack its blob."""

    def release(self, bundle: Path) -> None:
        """Drop the pod's holds on its mounts."""


class RootfsBuilder:
    """Prepares and releases pod root filesystems from images in a ``BlobStore``.

    With ``lazy``, eStargz layers are lower dirs mounted by the node's lazyfs daemon instead
    of unpacked directories (overlay mode only: the copy mode would read every byte)."""

    def __init__(
        self, blobs: BlobStore, root: Path, platform: Platform, mode: RootfsMode | None = None,
        lazy: LazyLayers | None = None,
    ) -> None:
        self._blobs = blobs
        self._root = root
        self._platform = platform
        self.mode = mode or detect_mode(root / "tmp")
        self._lazy = lazy if self.mode is RootfsMode.OVERLAY else None

    def prepare(self, image: Image, bundle: Path) -> Path:
        """Create ``bundle/rootfs`` for a pod of ``image`` and return its path."""
        check_config_platform(image.config, image.reference, self._platform)
        if len(image.config.diff_ids) != len(image.manifest.layers):
            raise InvalidImage(f"image {image.reference}: config and manifest disagree on layers")
        rootfs = bundle / "rootfs"
        bundle.mkdir(parents=True, exist_ok=True)
        if self.mode is RootfsMode.OVERLAY:
            self._prepare_overlay(image, bundle, rootfs)
        else:
            self._prepare_copy(image, rootfs)
        return rootfs

    def release(self, bundle: Path) -> None:
        """Unmount and delete what ``prepare`` made in ``bundle``; harmless if absent."""
        rootfs = bundle / "rootfs"
        unmount(rootfs)
        remove_tree(rootfs)
        remove_tree(bundle / "overlay")
        if self._lazy is not None:
            self._lazy.release(bundle)

    def layer_dirs(self, image: Image, bundle: Path | None = None) -> list[Path]:
        """The layer directories of ``image`` (base first): unpacked as needed, or (for the
        pod at ``bundle``) lazily mounted."""
        pairs = list(zip(image.manifest.layers, image.config.diff_ids, strict=True))
        mounted: list[Path | None] = [None] * len(pairs)
        if self._lazy is not None and bundle is not None:
            mounted = self._mount_lazy(image, [layer for layer, _ in pairs], bundle)
        return [got or self._unpacked_layer(layer.digest, diff_id)
                for got, (layer, diff_id) in zip(mounted, pairs, strict=True)]

    def _mount_lazy(self, image: Image, layers: list[Descriptor], bundle: Path
                    ) -> list[Path | None]:
        """Every layer's lazy mount (None: unpack it), asked for all at once: each mount
        waits on the registry (TOC) and the FUSE handshake, so one after another they add
        up; concurrently the image costs about its slowest layer."""
        lazy = self._lazy
        assert lazy is not None

        def one(layer: Descriptor) -> Path | None:
            mark("rootfs.layer.start", digest=layer.digest)
            got = lazy.mount(image, layer, bundle)
            mark("rootfs.layer.end", digest=layer.digest)
            return got

        if len(layers) < 2:
            return [one(layer) for layer in layers]
        with ThreadPoolExecutor(max_workers=min(8, len(layers)),
                                thread_name_prefix="lazy-mount") as pool:
            futures = [pool.submit(one, layer) for layer in layers]
        return [future.result() for future in futures]  # the first failure is raised

    def _prepare_overlay(self, image: Image, bundle: Path, rootfs: Path) -> None:
        lowers = [self._short_link(path) for path in self.layer_dirs(image, bundle)]
        if not lowers:
            lowers = [self._empty_layer()]
        upper, work = bundle / "overlay" / "upper", bundle / "overlay" / "work"
        for path in (upper, work, rootfs):
            path.mkdir(parents=True, exist_ok=True)
        mount_overlay(list(reversed(lowers)), upper, work, rootfs)
        mark("rootfs.overlay")

    def _prepare_copy(self, image: Image, rootfs: Path) -> None:
        cached = self._image_rootfs(image)
        remove_tree(rootfs)
        subprocess.run(["cp", "-a", "--reflink=auto", str(cached), str(rootfs)], check=True)

    def _unpacked_layer(self, blob_digest: str, diff_id: str) -> Path:
        """Unpack one layer blob (overlay form) once, into ``layers/sha256/<diff_id hex>``."""
        final = self._root / "layers" / "sha256" / digest_hex(diff_id)
        if final.is_dir():
            return final
        with self._blobs.lock(diff_id, "unpack"):
            if final.is_dir():
                return final
            work = Path(tempfile.mkdtemp(dir=self._blobs.tmp, prefix="layer-"))
            try:
                self._unpack_checked(blob_digest, work, diff_id, Whiteouts.OVERLAY)
                final.parent.mkdir(parents=True, exist_ok=True)
                work.rename(final)
            finally:
                remove_tree(work)
        return final

    def _image_rootfs(self, image: Image) -> Path:
        """The image's layers applied in order, cached under ``rootfs/sha256/<manifest>``."""
        final = self._root / "rootfs" / "sha256" / digest_hex(image.manifest_digest)
        if final.is_dir():
            return final
        with self._blobs.lock(image.manifest_digest, "rootfs"):
            if final.is_dir():
                return final
            work = Path(tempfile.mkdtemp(dir=self._blobs.tmp, prefix="rootfs-"))
            try:
                pairs = zip(image.manifest.layers, image.config.diff_ids, strict=True)
                for layer, diff_id in pairs:
                    self._unpack_checked(layer.digest, work, diff_id, Whiteouts.APPLY)
                final.parent.mkdir(parents=True, exist_ok=True)
                work.rename(final)
            finally:
                remove_tree(work)
        return final

    def _unpack_checked(self, blob: str, dest: Path, diff_id: str, whiteouts: Whiteouts) -> None:
        """Unpack a layer blob and check its uncompressed digest; drop the blob if damaged."""
        try:
            actual = unpack_layer(self._blobs.path(blob), dest, whiteouts)
        except InvalidImage:
            self._blobs.discard(blob)
            raise
        if actual != diff_id:
            self._blobs.discard(blob)
            raise DigestMismatch(
                diff_id, f"layer {blob} unpacked to {actual}", "uncompressed layer"
            )

    def _short_link(self, layer_dir: Path) -> Path:
        link = self._root / "l" / layer_dir.name[:_LINK_ID_LENGTH]
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            # Unique per thread too: two pods of a new image may prepare it at once.
            tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(os.path.relpath(layer_dir, link.parent))
            tmp.replace(link)
        return link

    def _empty_layer(self) -> Path:
        empty = self._root / "layers" / "empty"
        empty.mkdir(parents=True, exist_ok=True)
        return empty
