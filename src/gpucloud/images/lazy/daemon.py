"""``gpucloud lazyfs``: the node's FUSE daemon for lazily pulled layers (one per node).

Why a separate process: an agent restart, upgrade or stall must not take the pods' root
filesystems with it (stargz-snapshotter #151, #1520). The agent starts this daemon in its
own session (so the agent's signals and exit do not reach it) and talks to it over a
root-only Unix socket, ``<state>/lazyfs/control.sock``, one JSON object per line:

* ``mount`` {digest, registry, repository, size, toc_digest, holder, insecure,
  username?, password?}: mount the layer (once; later callers share the mount and are
  counted as holders) at ``<state>/lazyfs/mnt/<hex>``; answers {path} or {error, message}
  (e.g. ``LayerTooLarge``: the layer's files exceed the whole chunk cache, see
  ``check_fits``).
* ``release`` {holder}: drop the holder from every layer; a layer nobody holds is
  unmounted (its chunks stay in the cache).
* ``status``: per layer {local, total, holders, demand_fetched, prefetched, ...}.
* ``events``: the events since the last call ({reason, message}), for the agent to report.
* ``local`` {digest, toc_digest}: (local, total) bytes of a layer whose TOC is cached;
  ``ping``: the daemon's pid; ``shutdown``: unmount everything and exit.

Restart behaviour (decided): the mounts live as long as this process. When it dies, the
kernel aborts its FUSE connections and readers in pods on those mounts get ``ENOTCONN``;
the libfuse used here cannot take over an initialised ``/dev/fuse`` connection, so
Nydus-style fd hand-over is not attempted. A new daemon lazily detaches the dead mounts
and mounts again, from ``layers.json``, every layer that still has holders, with the TOC
from the cache, so it starts without the registry and serves whatever the cache holds
(uncached chunks give ``EIO`` until the registry is back). New pods get the new mounts;
pods that were running on the old ones must be restarted. An *agent* restart changes
nothing: the daemon and its mounts keep running and the new agent reconnects.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socketserver
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpucloud.images.auth import Credentials, RegistryAuth
from gpucloud.images.client import is_loopback
from gpucloud.images.errors import ImageError
from gpucloud.images.lazy.cache import ChunkCache
from gpucloud.images.lazy.client import lazyfs_root
from gpucloud.images.lazy.fetch import RangeFetcher, RangeUnsupported
from gpucloud.images.lazy.fs import raise_readahead, serve
from gpucloud.images.lazy.layer import LazyLayer, check_toc_offsets, read_toc
from gpucloud.images.lazy.scheduler import FetchScheduler
from gpucloud.images.lazy.toc import Toc, parse_toc
from gpucloud.images.lazy.trace import mark
from gpucloud.images.rootfs import unmount
from gpucloud.images.store import digest_hex

log = logging.getLogger(__name__)

DEFAULT_CACHE_LIMIT = 20 << 30
MOUNT_TIMEOUT = 10.0
_MAX_EVENTS = 200


class LayerTooLarge(ImageError):
    """The layer's files need more room than the node's whole chunk cache. Mounted lazily,
    its background prefetch would push the layer through the LRU cache, evicting its own
    chunks (fetched again on every later read) and every other pod's; the agent pulls it
    whole instead."""

    reason = "LayerTooLarge"


@dataclass
class LayerSpec:
    """What the daemon needs to (re)mount a layer; persisted without credentials."""

    digest: str
    registry: str
    repository: str
    size: int
    toc_digest: str
    insecure: bool = False
    holders: list[str] = field(default_factory=list)


@dataclass
class _Mounted:
    spec: LayerSpec
    layer: LazyLayer
    path: Path
    thread: threading.Thread
    stop: threading.Event


class LazyfsDaemon:
    """The mounts of one node, their shared chunk cache and their registry clients."""

    def __init__(self, state_dir: Path, cache_limit: int = DEFAULT_CACHE_LIMIT,
                 read_deadline: float = 30.0) -> None:
        self.root = lazyfs_root(state_dir)
        self.mnt = self.root / "mnt"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.cache = ChunkCache(self.root / "cache", cache_limit)
        # One for the node (demand anywhere pauses prefetch); two prefetch fetches on the
        # wire at once, each place with a second thread that decodes the last one's chunks
        # (scheduler.py). A reader waits at most the read deadline for its chunks, then gets EIO.
        self.scheduler = FetchScheduler(
            prefetch_workers=2, read_deadline=read_deadline)
        self._read_deadline = read_deadline
        self._lock = threading.RLock()
        self._mounts: dict[str, _Mounted] = {}
        self._pending: dict[str, threading.Event] = {}  # mounts in flight, by digest
        self._events: list[dict[str, Any]] = []
        # One TLS context for every client, made now: building one (CA bundle load) per
        # registry client cost tens of ms inside a pod's first mount.
        self._tls = ssl.create_default_context()
        self._storage = httpx.Client(timeout=httpx.Timeout(read_deadline, connect=10.0),
                                     verify=self._tls)
        self._registries: dict[tuple[str, str, str], httpx.Client] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def restore(self) -> None:
        """Detach mounts a dead daemon left; mount again the layers that have holders."""
        for path in _mounts_under(self.mnt):
            log.info("lazyfs: detaching stale mount %s", path)
            _detach(path)  # a dead FUSE mount cannot even be stat'ed (ENOTCONN)
        with self._lock:
            for spec in self._load_state():
                if not spec.holders:
                    continue
                try:
                    mounted = self._mounts[spec.digest] = self._mount(spec, None)
                    mounted.spec.holders = list(spec.holders)
                except (ImageError, OSError) as exc:
                    self.event("LazyRestoreFailed", f"layer {spec.digest}: {exc}")
            self._save_state()

    def shutdown(self) -> None:
        """Unmount everything (daemon stop)."""
        with self._lock:
            for digest in list(self._mounts):
                self._unmount(digest)
        self.scheduler.close()
        self.cache.close()

    # -- requests ------------------------------------------------------------------------

    def mount(self, spec: LayerSpec, credentials: Credentials | None) -> Path:
        """Mount (or share) the layer for ``spec.holders[0]``; return its path.

        The daemon's lock covers the bookkeeping only, never the mount itself (TOC fetch,
        FUSE mount): the layers of an image are mounted concurrently, and a mount in
        flight blocks neither another layer's mount nor a read, status or release. Two
        requests for one layer share one mount: the second waits for the first (and
        tries itself if that one failed: it may hold other credentials)."""
        holder = spec.holders[0]
        while True:
            with self._lock:
                current = self._mounts.get(spec.digest)
                if current is not None:
                    self._hold(current, holder)
                    return current.path
                pending = self._pending.get(spec.digest)
                if pending is None:
                    pending = self._pending[spec.digest] = threading.Event()
                    break
            pending.wait()
        try:
            mounted = self._mount(spec, credentials)
        finally:
            with self._lock:
                self._pending.pop(spec.digest, None)
            pending.set()
        with self._lock:
            self._mounts[spec.digest] = mounted
            self._hold(mounted, holder)
            return mounted.path

    def _hold(self, mounted: _Mounted, holder: str) -> None:
        """Count ``holder`` on ``mounted`` and persist (under the lock)."""
        if holder not in mounted.spec.holders:
            mounted.spec.holders.append(holder)
        self._save_state()

    def release(self, holder: str) -> None:
        """Drop ``holder`` everywhere; unmount layers left without holders."""
        with self._lock:
            for digest, mounted in list(self._mounts.items()):
                if holder in mounted.spec.holders:
                    mounted.spec.holders.remove(holder)
                if not mounted.spec.holders:
                    self._unmount(digest)
            self._save_state()

    def status(self) -> dict[str, Any]:
        """Per-layer figures, plus the cache's."""
        layers = {}
        with self._lock:
            mounts = list(self._mounts.values())
        for m in mounts:
            local, total = m.layer.local_bytes()
            layers[m.spec.digest] = {"local": local, "total": total, "holders": m.spec.holders,
                                     "path": str(m.path), **asdict(m.layer.stats),
                                     "requests": m.layer.fetcher.stats.requests
                                     if m.layer.fetcher else 0}
        return {"layers": layers, "cache": {"used": self.cache.used, "limit": self.cache.limit,
                                            "evictions": self.cache.evictions}}

    def local_bytes(self, digest: str, toc_digest: str) -> tuple[int, int] | None:
        """(local, total) uncompressed bytes of a layer known by its cached TOC."""
        kept = self.cache.get_toc(toc_digest)
        if kept is None:
            return None
        toc = parse_toc(kept[0], kept[1], kept[1])
        layer = LazyLayer(digest, toc, None, self.cache, self.event, self.scheduler)
        return layer.local_bytes()

    def event(self, reason: str, message: str, digest: str = "") -> None:
        """Queue an event for the agent (and log it), with the holders (pod bundles) of
        layer ``digest`` so the agent can put it on those pods' events."""
        log.warning("lazyfs: %s: %s", reason, message)
        with self._lock:
            mounted = self._mounts.get(digest)
            holders = list(mounted.spec.holders) if mounted is not None else []
            self._events.append({"reason": reason, "message": message, "holders": holders})
            del self._events[:-_MAX_EVENTS]

    def take_events(self) -> list[dict[str, Any]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    # -- mounting ------------------------------------------------------------------------

    def _mount(self, spec: LayerSpec, credentials: Credentials | None) -> _Mounted:
        """Fetch the TOC, mount the FUSE view and start its prefetch (the caller records
        the mount; this runs without the daemon's lock)."""
        mark("daemon.mount.start", digest=spec.digest)
        fetcher = self._fetcher(spec, credentials)
        toc = self._toc(spec, fetcher)
        mark("daemon.mount.toc", digest=spec.digest)
        layer = LazyLayer(spec.digest, toc, fetcher, self.cache,
                          lambda reason, message: self.event(reason, message, spec.digest),
                          self.scheduler)
        check_fits(layer, self.cache.limit)
        path = self.mnt / digest_hex(spec.digest)
        path.mkdir(parents=True, exist_ok=True)
        stop, ready = threading.Event(), threading.Event()
        thread = threading.Thread(target=self._serve, args=(layer, path, stop, ready),
                                  daemon=True, name=f"fuse-{digest_hex(spec.digest)[:12]}")
        thread.start()
        self.scheduler.touch()  # a start is under way: the bulk waits for it to go quiet
        try:
            _wait_mounted(path, thread, ready)
        except ImageError:
            stop.set()
            layer.close()
            raise
        mark("daemon.mount.fuse", digest=spec.digest)
        # The prefetch of the prioritized files starts once the mount serves, beside the
        # container's start (the scheduler holds it back whenever a demand read is queued).
        # Not earlier: its decompressing and hashing took the GIL from the tree building
        # and FUSE handshake that the pod's overlay waits for (0.3-0.9 s on a large TOC),
        # and the start's first reads come after overlay, bundle and runc anyway.
        # The readahead is raised first: its stat is a FUSE request to this process, which
        # waited behind the prefetch's threads for the GIL (0.1 s with two prefetch fetches).
        raise_readahead(str(path))
        mounted = _Mounted(LayerSpec(**{**asdict(spec), "holders": []}), layer, path, thread,
                           stop)
        threading.Thread(target=layer.prefetch, args=(stop,), daemon=True,
                         name=f"prefetch-{digest_hex(spec.digest)[:12]}").start()
        mark("daemon.mount.end", digest=spec.digest)
        return mounted

    def _serve(self, layer: LazyLayer, path: Path, stop: threading.Event,
               ready: threading.Event) -> None:
        """Serve the mount; when it ends (unmounted by us or from outside, e.g. a node
        clean-up), its prefetch stops too: nothing fetches for a layer nobody can read."""
        try:
            serve(layer, str(path), on_init=ready.set)
        except RuntimeError as exc:
            self.event("LazyMountFailed", f"layer {layer.digest}: FUSE ended: {exc}")
        finally:
            stop.set()
            layer.close()

    def _toc(self, spec: LayerSpec, fetcher: RangeFetcher) -> Toc:
        """The verified TOC: from the cache (no registry needed), else from the blob."""
        kept = self.cache.get_toc(spec.toc_digest)
        if kept is not None:
            toc = parse_toc(kept[0], spec.size, kept[1])
        else:
            try:  # the tail's Range request is the Range-support check too
                toc, data = read_toc(fetcher, spec.toc_digest, ranges_only=True)
            except RangeUnsupported as exc:
                raise RangeUnsupported(f"registry {spec.registry} ignores Range requests"
                                       ) from exc
            self.cache.put_toc(spec.toc_digest, data, toc.toc_offset)
        check_toc_offsets(toc, spec.size)
        return toc

    def _fetcher(self, spec: LayerSpec, credentials: Credentials | None) -> RangeFetcher:
        scheme = "http" if spec.insecure or is_loopback(spec.registry) else "https"
        url = f"{scheme}://{spec.registry}/v2/{spec.repository}/blobs/{spec.digest}"
        key = (spec.registry, credentials.username if credentials else "",
               credentials.password if credentials else "")
        with self._lock:
            client = self._registries.get(key)
            if client is None:
                auth = RegistryAuth({spec.registry: credentials} if credentials else {})
                client = httpx.Client(auth=auth, follow_redirects=False, verify=self._tls,
                                      timeout=httpx.Timeout(self._read_deadline, connect=10.0),
                                      headers={"User-Agent": "gpucloud-lazyfs"})
                self._registries[key] = client
        return RangeFetcher(client, self._storage, url, spec.size, deadline=self._read_deadline)

    def _unmount(self, digest: str) -> None:
        mounted = self._mounts.pop(digest)
        mounted.stop.set()
        mounted.layer.close()
        try:
            unmount(mounted.path)
        except OSError:
            _detach(mounted.path)
        mounted.thread.join(timeout=5)

    # -- state ---------------------------------------------------------------------------

    def _save_state(self) -> None:
        data = [asdict(m.spec) for m in self._mounts.values()]
        tmp = self.root / "layers.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.root / "layers.json")

    def _load_state(self) -> list[LayerSpec]:
        try:
            raw = json.loads((self.root / "layers.json").read_text())
        except (FileNotFoundError, ValueError):
            return []
        return [LayerSpec(**item) for item in raw if isinstance(item, dict)]


def check_fits(layer: LazyLayer, cache_limit: int) -> None:
    """``LayerTooLarge`` unless the whole layer fits in the chunk cache. Checked on the TOC
    (``LazyLayer.total_bytes``), not on the blob's compressed size known before it: the
    cache holds uncompressed chunks, which text-heavy layers have 3-4 times more of, and a
    refused layer's TOC (a small tail read) costs little beside the full pull that follows."""
    need = layer.total_bytes()
    if need > cache_limit:
        raise LayerTooLarge(
            f"the layer's files need {need:,} bytes of chunk cache (uncompressed), more "
            f"than the node's whole cache limit of {cache_limit:,} bytes (--cache-limit)")


def _mounts_under(root: Path) -> list[Path]:
    """Mount points below ``root`` per /proc/self/mountinfo (dead FUSE mounts included)."""
    prefix = str(root) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            found.append(Path(point))
    return sorted(found, reverse=True)


def _detach(path: Path) -> None:
    """Last resort for a mount ``unmount`` could not stat: ``umount2(MNT_DETACH)``."""
    ctypes.CDLL(None, use_errno=True).umount2(os.fsencode(path), 2)


def _wait_mounted(path: Path, thread: threading.Thread, ready: threading.Event) -> None:
    """Until the kernel's FUSE ``INIT`` has been answered (``ready``, set by the
    filesystem's init: the mount exists and serves), instead of polling mountinfo."""
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while time.monotonic() < deadline:
        if ready.wait(0.05):
            return
        if not thread.is_alive():
            raise ImageError(f"FUSE mount of {path} failed")
    raise ImageError(f"FUSE mount of {path} did not appear within {MOUNT_TIMEOUT} s")


# -- control socket ----------------------------------------------------------------------


class _Handler(socketserver.StreamRequestHandler):
    daemon: LazyfsDaemon

    def handle(self) -> None:
        for line in _lines(self.rfile):
            try:
                reply = self._answer(json.loads(line))
            except (ImageError, OSError, ValueError, KeyError, TypeError) as exc:
                reply = {"error": getattr(exc, "reason", type(exc).__name__),
                         "message": str(exc)}
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()

    def _answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "mount":
            creds = (Credentials(req["username"], req["password"])
                     if req.get("username") else None)
            spec = LayerSpec(req["digest"], req["registry"], req["repository"],
                             int(req["size"]), req["toc_digest"], bool(req.get("insecure")),
                             [req["holder"]])
            return {"path": str(self.daemon.mount(spec, creds))}
        if op == "release":
            self.daemon.release(req["holder"])
            return {"ok": True}
        if op == "status":
            return self.daemon.status()
        if op == "local":
            got = self.daemon.local_bytes(req["digest"], req["toc_digest"])
            return {"local": got[0], "total": got[1]} if got else {"local": None}
        if op == "events":
            return {"events": self.daemon.take_events()}
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "shutdown":
            threading.Thread(target=self.server.shutdown, daemon=True).start()
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}")


def _lines(stream: Any) -> Iterator[bytes]:
    while line := stream.readline():
        yield line


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def run(state_dir: Path, cache_limit: int = DEFAULT_CACHE_LIMIT,
        read_deadline: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT; unmounts on the way out."""
    daemon = LazyfsDaemon(state_dir, cache_limit, read_deadline)
    daemon.restore()
    sock = daemon.root / "control.sock"
    sock.unlink(missing_ok=True)
    handler = type("Handler", (_Handler,), {"daemon": daemon})
    old = os.umask(0o077)
    try:
        server = _Server(str(sock), handler)
    finally:
        os.umask(old)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        daemon.shutdown()


def main(argv: list[str] | None = None) -> None:
    """``python -m gpucloud.images.lazy.daemon --state-dir DIR`` (= ``gpucloud lazyfs``)."""
    parser = argparse.ArgumentParser(prog="gpucloud lazyfs")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--cache-limit", type=int, default=DEFAULT_CACHE_LIMIT)
    parser.add_argument("--read-deadline", type=float, default=30.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lazyfs %(message)s")
    # FUSE requests are short and handed between threads (readers, prefetch, libfuse's
    # workers): a 1 ms GIL switch interval, not 5 ms, keeps a read from waiting behind a
    # busy thread's time slice.
    sys.setswitchinterval(0.001)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per chunk fetch
    _install_term_handler()
    run(args.state_dir, args.cache_limit, args.read_deadline)


def _install_term_handler() -> None:
    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
