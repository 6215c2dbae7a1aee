"""Pulling an image into the store: resolve, verify, download layers in parallel.

Order matters for failing fast: the manifest (and the index, resolved for this host's
platform) and then the small config blob come first, so a missing image, refused
credentials or the wrong architecture are reported before a single layer is downloaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gpucloud.images.client import RegistryClient
from gpucloud.images.errors import InvalidImage
from gpucloud.images.manifest import (
    Descriptor,
    ImageConfig,
    Index,
    Manifest,
    Platform,
    check_config_platform,
    parse_config,
    parse_manifest_or_index,
    select_platform,
)
from gpucloud.images.reference import ImageReference
from gpucloud.images.store import BlobStore, ImageIndex

ProgressCallback = Callable[[int, int], None]
"""Called with (bytes downloaded so far, total bytes of the layers to download)."""


@dataclass(frozen=True)
class Image:
    """An image in the local store: what the runtime needs to build a bundle from it."""

    reference: str
    manifest_digest: str
    manifest: Manifest
    config_digest: str
    config: ImageConfig

    @property
    def size(self) -> int:
        """Bytes of the (compressed) layers."""
        return sum(layer.size for layer in self.manifest.layers)


class _Progress:
    """Thread-safe byte counter feeding an optional callback."""

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self._total = total
        self._done = 0
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        if self._callback is None:
            return
        with self._lock:
            self._done += count
            done = self._done
        self._callback(done, self._total)


class Puller:
    """Pulls images with one shared client into one store."""

    def __init__(
        self,
        client: RegistryClient,
        blobs: BlobStore,
        index: ImageIndex,
        platform: Platform,
        max_workers: int = 4,
        skip: Callable[[Descriptor], bool] | None = None,
    ) -> None:
        """``skip`` names layers not to download (lazily mounted eStargz layers)."""
        self._client = client
        self._blobs = blobs
        self._index = index
        self._platform = platform
        self._max_workers = max_workers
        self._skip = skip

    def pull(self, image: ImageReference, on_progress: ProgressCallback | None = None) -> Image:
        """Fetch ``image`` (by tag or digest), store it and index it under its reference."""
        manifest_digest, manifest = self._resolve(image)
        config_data = self._fetch_small(image, manifest.config)
        config = parse_config(config_data)
        check_config_platform(config, str(image), self._platform)
        missing = [d for d in manifest.layers if not self._blobs.has(d.digest)
                   and not (self._skip is not None and self._skip(d))]
        progress = _Progress(sum(d.size for d in missing), on_progress)
        self._download_layers(image, missing, progress)
        self._index.put(
            str(image),
            manifest_digest,
            manifest.config.digest,
            sum(d.size for d in manifest.layers),
        )
        return Image(str(image), manifest_digest, manifest, manifest.config.digest, config)

    def _resolve(self, image: ImageReference) -> tuple[str, Manifest]:
        """The platform manifest's digest and content (stored), following an index."""
        fetched = self._client.get_manifest(image)
        parsed = parse_manifest_or_index(fetched.data, fetched.media_type)
        if isinstance(parsed, Index):
            chosen = select_platform(parsed, str(image), self._platform)
            fetched = self._client.get_manifest(image, chosen.digest)
            parsed = parse_manifest_or_index(fetched.data, fetched.media_type)
            if isinstance(parsed, Index):
                raise InvalidImage(f"image {image}: an index inside an index is not supported")
        self._blobs.put_bytes(fetched.digest, fetched.data)
        return fetched.digest, parsed

    def _fetch_small(self, image: ImageReference, descriptor: Descriptor) -> bytes:
        self._fetch(image, descriptor, None)
        return self._blobs.read(descriptor.digest)

    def _fetch(
        self, image: ImageReference, descriptor: Descriptor, progress: _Progress | None
    ) -> None:
        """Download one blob into the store unless it is there (or another pull has it).

        Layers (fetched with progress) are not fsynced: see ``BlobStore.ingest``.
        """
        on_bytes = progress.add if progress is not None else None
        self._blobs.ingest(
            descriptor.digest,
            lambda sink: self._client.fetch_blob(image, descriptor, sink, on_bytes),
            durable=progress is None,
        )

    def _download_layers(
        self, image: ImageReference, layers: list[Descriptor], progress: _Progress
    ) -> None:
        """Download layers on worker threads; the first failure cancels what has not begun."""
        if not layers:
            return
        workers = min(self._max_workers, len(layers))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pull") as pool:
            futures = [pool.submit(self._fetch, image, layer, progress) for layer in layers]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
