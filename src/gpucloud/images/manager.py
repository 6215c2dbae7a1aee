"""``ImageManager``: the one object the node agent uses for images.

It ties together the registry client, the content-addressed store, the index, archive
import and rootfs preparation, all under ``<state-dir>/images``. Methods are synchronous
and thread-safe; the agent calls them from worker threads. Several agents on one machine
may share a state directory's image store or use their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx

from gpucloud.images.archive import ArchiveImporter
from gpucloud.images.auth import Credentials
from gpucloud.images.client import RegistryClient
from gpucloud.images.errors import ImageNotFound, InvalidImage
from gpucloud.images.lazy.client import LazyfsClient
from gpucloud.images.lazy.mounter import LazyMounter
from gpucloud.images.lazy.trace import mark
from gpucloud.images.manifest import (
    Manifest,
    Platform,
    host_platform,
    parse_config,
    parse_manifest_or_index,
)
from gpucloud.images.pull import Image, ProgressCallback, Puller
from gpucloud.images.reference import ImageReference, parse_reference
from gpucloud.images.rootfs import RootfsBuilder, RootfsMode
from gpucloud.images.store import BlobStore, ImageIndex, ImageRecord


class ImageManager:
    """Pull, import, list and unpack images for pods on this node.

    ``credentials`` maps registries (``docker.io``, ``ghcr.io``, ``127.0.0.1:5000``) to
    their login; ``insecure`` lists non-loopback registries reached over plain HTTP;
    ``transport`` replaces the network in tests; ``platform`` overrides the host's;
    ``rootfs_mode`` forces overlay or copy (default: overlay when root and supported);
    ``lazy`` (a ``LazyfsClient``) mounts eStargz layers lazily instead of pulling them
    (overlay mode only; see ``images.lazy``).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        credentials: Mapping[str, Credentials] | None = None,
        insecure: Iterable[str] = (),
        transport: httpx.BaseTransport | None = None,
        platform: Platform | None = None,
        rootfs_mode: RootfsMode | None = None,
        max_parallel_downloads: int = 4,
        lazy: LazyfsClient | None = None,
    ) -> None:
        self.root = state_dir / "images"
        self.platform = platform or host_platform()
        self._blobs = BlobStore(self.root)
        self._index = ImageIndex(self.root)
        self._insecure = tuple(insecure)
        self._transport = transport
        self._max_parallel_downloads = max_parallel_downloads
        self._client = RegistryClient(
            credentials=credentials, insecure=self._insecure, transport=transport
        )
        self.lazy = None if lazy is None else LazyMounter(
            lazy, self._client, self._blobs, credentials or {}, self._insecure)
        self._skip = self.lazy.skips_download if self.lazy is not None else None
        self._puller = Puller(
            self._client, self._blobs, self._index, self.platform, max_parallel_downloads,
            self._skip,
        )
        self._rootfs_mode = rootfs_mode
        self._builder: RootfsBuilder | None = None

    def close(self) -> None:
        """Release network connections."""
        self._client.close()

    def __enter__(self) -> ImageManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def pull(
        self,
        image: str | ImageReference,
        *,
        always: bool = False,
        on_progress: ProgressCallback | None = None,
        credentials: Credentials | None = None,
    ) -> Image:
        """The image, from the store when present (unless ``always``), else from its registry.

        ``credentials`` (a pod's registry login) are used for this pull alone, in place of
        the node's for the image's registry, with a token cache of their own, so one pod's
        login never authorizes another's pull. An image already in the store is not
        fetched again, whoever pulled it (as Kubernetes' ``IfNotPresent``).

        Raises ``ImageNotFound``, ``RegistryUnauthorized``, ``RegistryUnavailable``,
        ``DigestMismatch``, ``NoMatchingPlatform`` or ``InvalidImage``.
        """
        ref = _as_reference(image)
        if not always:
            cached = self._cached(ref)
            if cached is not None:
                return cached
        if credentials is None:
            mark("images.pull.start")
            pulled = self._puller.pull(ref, on_progress)
            mark("images.pull.end")
            return pulled
        with RegistryClient(credentials={ref.registry: credentials}, insecure=self._insecure,
                            transport=self._transport) as client:
            puller = Puller(client, self._blobs, self._index, self.platform,
                            self._max_parallel_downloads, self._skip)
            return puller.pull(ref, on_progress)

    def get(self, image: str | ImageReference) -> Image:
        """The image from the local store only; ``ImageNotFound`` when it is not there."""
        ref = _as_reference(image)
        cached = self._cached(ref)
        if cached is None:
            raise ImageNotFound(f"image {ref} is not in the local image store")
        return cached

    def lazy_events(self, bundle: Path) -> list[tuple[str, str]]:
        """(reason, message) of lazy-pull events of the pod at ``bundle`` since last asked
        (fallbacks to a full pull, chunk digest mismatches, prefetch failures)."""
        return self.lazy.take_events(bundle) if self.lazy is not None else []

    def list_images(self) -> list[ImageRecord]:
        """Every image in the local store, by reference."""
        return self._index.all()

    def local_bytes(self, record: ImageRecord) -> tuple[int, int]:
        """(bytes on this node, bytes in all) of a stored image's layers: lazy layers count
        their cached chunks, pulled layers their blobs."""
        manifest = parse_manifest_or_index(self._blobs.read(record.manifest_digest))
        if not isinstance(manifest, Manifest):
            return 0, 0
        got = self.lazy.local_bytes(manifest.layers) if self.lazy is not None else None
        if got is not None:
            return got
        sizes = [(layer.size, self._blobs.has(layer.digest)) for layer in manifest.layers]
        return sum(size for size, here in sizes if here), sum(size for size, _ in sizes)

    def import_archive(self, path: Path, name: str | None = None) -> list[Image]:
        """Import an OCI layout (dir or tar) or ``docker save`` tarball; return its images.

        ``name`` names an image the archive leaves nameless (and adds a name otherwise).
        """
        importer = ArchiveImporter(self._blobs, self._index, self.platform)
        return importer.import_path(path, name)

    def prepare_rootfs(self, image: Image, bundle: Path,
                       credentials: Credentials | None = None) -> Path:
        """Create ``bundle/rootfs`` for a new pod of ``image``; return it. Fast when cached.

        ``credentials`` (the pod's registry login) are what its lazy mounts, and their
        fallback full pulls, fetch with."""
        if credentials is not None and self.lazy is not None:
            self.lazy.use_credentials(bundle, credentials)
        mark("rootfs.start")
        rootfs = self._rootfs().prepare(image, bundle)
        mark("rootfs.end")
        return rootfs

    def release_rootfs(self, bundle: Path) -> None:
        """Unmount and delete a pod's rootfs (after its container is gone)."""
        self._rootfs().release(bundle)

    @property
    def rootfs_mode(self) -> RootfsMode:
        """How pod root filesystems are composed on this node."""
        return self._rootfs().mode

    def _rootfs(self) -> RootfsBuilder:
        if self._builder is None:
            self._builder = RootfsBuilder(self._blobs, self.root, self.platform, self._rootfs_mode,
                                          self.lazy)
        return self._builder

    def _cached(self, ref: ImageReference) -> Image | None:
        record = self._index.get(str(ref))
        if record is None:
            return None
        manifest = parse_manifest_or_index(self._blobs.read(record.manifest_digest))
        if not isinstance(manifest, Manifest):
            raise InvalidImage(f"stored image {ref} has no image manifest")
        if not all(self._blobs.has(layer.digest) or (self._skip is not None and self._skip(layer))
                   for layer in manifest.layers):
            return None
        config = parse_config(self._blobs.read(record.config_digest))
        return Image(str(ref), record.manifest_digest, manifest, record.config_digest, config)


def _as_reference(image: str | ImageReference) -> ImageReference:
    return image if isinstance(image, ImageReference) else parse_reference(image)
