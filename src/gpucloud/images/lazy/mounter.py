"""The image manager's lazy path: which layers are mounted lazily, and the fallback.

A layer is mounted lazily when its descriptor carries the eStargz TOC annotation and its
blob is not already in the store. Anything that stops the lazy mount (a registry without
Range support, a TOC that does not match the annotation, an external TOC, a layer whose
files exceed the node's whole chunk cache, a daemon that cannot start) falls back, for
that layer alone, to the ordinary full pull and unpack, and says so in an event
(``LazyPullFallback``, with the daemon's code and message). Once a layer is mounted there
is no fallback: errors reach the reader as ``EIO``. The pods' bundles are the holders of
the mounts, so a released pod drops its references and the daemon unmounts layers nobody
uses.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpucloud.images.auth import Credentials
from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.client import LazyfsClient, LazyfsError
from gpucloud.images.lazy.toc import TOC_DIGEST_ANNOTATION
from gpucloud.images.manifest import Descriptor
from gpucloud.images.pull import Image
from gpucloud.images.reference import ImageReference, parse_reference
from gpucloud.images.store import BlobStore

log = logging.getLogger(__name__)


#: What a pod holding lazy mounts is told when the daemon serving them died (docs/lazy.md).
RESTARTED_MESSAGE = (
    "the node's lazyfs daemon stopped and was started again: this pod's lazily mounted "
    "image layers were served by the old one, so its reads of files the kernel has not "
    "cached fail (ENOTCONN) until the pod is restarted")


def node_lazyfs(state_dir: Path, *, cache_limit: int | None = None,
                read_deadline: float | None = None) -> LazyfsClient | None:
    """The node's lazyfs client when lazy mounts can work here (root and /dev/fuse), else
    None (every layer is then pulled whole); the daemon it starts gets ``cache_limit``
    bytes of chunk cache and ``read_deadline`` (None: the daemon's defaults)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        return None
    return LazyfsClient(state_dir, cache_limit=cache_limit, read_deadline=read_deadline)


def is_lazy_candidate(layer: Descriptor) -> bool:
    """True for layers annotated with an eStargz TOC digest."""
    return bool(layer.annotations.get(TOC_DIGEST_ANNOTATION))


class LazyMounter:
    """Mounts eStargz layers through the node's lazyfs daemon, or pulls them whole."""

    def __init__(
        self,
        client: LazyfsClient,
        registry: RegistryClient,
        blobs: BlobStore,
        credentials: Mapping[str, Credentials],
        insecure: Iterable[str],
    ) -> None:
        self.client = client
        self._registry = registry
        self._blobs = blobs
        self._credentials = dict(credentials)
        self._insecure = frozenset(insecure)
        self._lock = threading.Lock()
        self._events: dict[str, list[tuple[str, str]]] = {}
        self._pod_credentials: dict[str, Credentials] = {}
        self._restart_lock = threading.Lock()

    def use_credentials(self, bundle: Path, credentials: Credentials) -> None:
        """The pod at ``bundle`` pulls with its own registry login: its lazy mounts (and
        their fallback downloads) use it in place of the node's, until ``release``."""
        with self._lock:
            self._pod_credentials[str(bundle)] = credentials

    def skips_download(self, layer: Descriptor) -> bool:
        """Whether a pull leaves this layer's blob to the lazy mount."""
        return is_lazy_candidate(layer)

    def mount(self, image: Image, layer: Descriptor, bundle: Path) -> Path | None:
        """The lazy mount of ``layer`` for the pod at ``bundle``; None: use the blob (now
        downloaded into the store when the lazy mount was refused)."""
        if not is_lazy_candidate(layer) or self._blobs.has(layer.digest):
            return None
        ref = parse_reference(image.reference)
        with self._lock:
            own = self._pod_credentials.get(str(bundle))
        try:
            return self.client.mount(
                digest=layer.digest, registry=ref.api_registry, repository=ref.repository,
                size=layer.size, toc_digest=layer.annotations[TOC_DIGEST_ANNOTATION],
                holder=str(bundle), insecure=ref.registry in self._insecure,
                credentials=own or self._credentials.get(ref.registry))
        except LazyfsError as exc:
            self.event("LazyPullFallback", f"layer {layer.digest} of {image.reference}: "
                       f"{exc.code}: {exc.message}; pulling it whole", str(bundle))
        self._download(ref, layer, own)
        return None

    def release(self, bundle: Path) -> None:
        """Drop the pod's references to its lazy mounts."""
        with self._lock:
            self._pod_credentials.pop(str(bundle), None)
            self._events.pop(str(bundle), None)
        try:
            self.client.release(str(bundle))
        except (LazyfsError, OSError) as exc:
            log.warning("lazyfs release of %s failed: %s", bundle, exc)

    def local_bytes(self, layers: Iterable[Descriptor]) -> tuple[int, int] | None:
        """(local, total) bytes of ``layers`` when any is lazy, else None. Lazy layers count
        their cached chunks (uncompressed); stored blobs count whole (compressed)."""
        local = total = 0
        lazy = False
        for layer in layers:
            if self._blobs.has(layer.digest) or not is_lazy_candidate(layer):
                size = layer.size
                local += size if self._blobs.has(layer.digest) else 0
                total += size
                continue
            lazy = True
            got = self._lazy_local(layer)
            local += got[0] if got else 0
            total += got[1] if got else layer.size
        return (local, total) if lazy else None

    def take_events(self, bundle: Path) -> list[tuple[str, str]]:
        """The events of the pod at ``bundle``: its fallbacks, and the daemon's events
        (chunk digest mismatches, prefetch failures, registry errors) of layers it holds.
        The daemon's queue is node-wide: what it returns is sorted out per holder here."""
        if self.client.running():
            for event in self.client.events():
                for holder in event.get("holders") or []:
                    self._queue(holder, (event["reason"], event["message"]))
        else:
            self._restart_under(bundle)
        with self._lock:
            return self._events.pop(str(bundle), [])

    def _restart_under(self, bundle: Path) -> None:
        """The agent's supervision of the daemon: every running pod asks for its events
        each watch period, so a pod holding lazy mounts (by the daemon's own record,
        which an agent restart keeps) notices a dead daemon within one. The daemon is
        started again (it mounts the held layers again, for new pods) and every holder
        is told that its overlay still sits on the dead mounts (``LazyfsRestarted``)."""
        holders = self.client.holders()
        if str(bundle) not in holders:
            return
        with self._restart_lock:
            if self.client.running():
                return  # another pod's watch started it: its event is queued already
            try:
                self.client.ensure_running()
            except LazyfsError as exc:
                self.event(exc.code, f"the node's lazyfs daemon is down and did not start "
                           f"again: {exc.message}", str(bundle))
                return
            for holder in holders:
                self._queue(holder, ("LazyfsRestarted", RESTARTED_MESSAGE))
        log.warning("lazyfs daemon was down under %d pods; started again", len(holders))

    def event(self, reason: str, message: str, holder: str) -> None:
        log.warning("%s: %s", reason, message)
        self._queue(holder, (reason, message))

    def _queue(self, holder: str, event: tuple[str, str]) -> None:
        with self._lock:
            self._events.setdefault(holder, []).append(event)
            del self._events[holder][:-100]

    def _lazy_local(self, layer: Descriptor) -> tuple[int, int] | None:
        if not self.client.running():
            return None
        return self.client.local(layer.digest, layer.annotations[TOC_DIGEST_ANNOTATION])

    def _download(self, ref: ImageReference, layer: Descriptor,
                  credentials: Credentials | None) -> None:
        """The full pull of one layer, with the pod's own login when it has one."""
        if credentials is None:
            self._blobs.ingest(layer.digest, lambda sink: self._registry.fetch_blob(
                ref, layer, sink), durable=False)
            return
        with RegistryClient(credentials={ref.registry: credentials},
                            insecure=self._insecure) as client:
            self._blobs.ingest(layer.digest, lambda sink: client.fetch_blob(ref, layer, sink),
                               durable=False)
