"""Lazy mounts under concurrency and misbehaving registries (real registry, real FUSE).

* several pods of one image mount it at once: one mount per layer, shared, and every file
  of every pod's root filesystem hashes to the original;
* a layer's mount in flight (its registry stalled) blocks neither another layer's reads nor
  the daemon's other requests;
* ``ranges_only``: a registry answering ``200`` (the whole blob) to the TOC's Range request
  is refused (``RangeUnsupported``: the layer is pulled whole, said in an event), and a
  ``200`` to a chunk's Range request after the mount is streamed and cut to the bytes asked
  for: never wrong bytes.

Needs root, /dev/fuse and libfuse3 (Debian fuse3); the registry is Debian's docker-registry.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpucloud.images import ImageManager, RootfsMode
from gpucloud.images.lazy.client import LazyfsClient, LazyfsError
from gpucloud.images.lazy.fetch import RangeFetcher, RangeUnsupported
from gpucloud.images.testing import directory, symlink
from tests.fixtures.registry import Registry
from tests.integration.images.lazy_testing import (
    ControlledProxy,
    LazyImage,
    estargz_image,
    expected_hashes,
    tree_hashes,
)

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs root and /dev/fuse")

Files = dict[str, bytes | str | object]

LOWER: Files = {
    **{f"lib/pkg{i // 10}/mod{i}.py": f"# module {i}\n" + "x = 1\n" * (i * 7) for i in range(60)},
    "models/w.bin": os.urandom((700 << 10) + 17),  # eleven 64 KiB chunks, the last short
    "lib/link.py": symlink("pkg0/mod1.py"),
    "etc/config.json": '{"layers": 12}\n',
    "opt/": directory(0o750),
}
UPPER: Files = {
    "etc/config.json": '{"layers": 24}\n',  # replaces the lower layer's
    "app/main.py": "print('hello')\n" * 300,
    "app/blob.bin": os.urandom(200 << 10),
}


def _regular_files(root: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(root).items() if not v.startswith("link:")}


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[LazyfsClient]:
    # A long read deadline: a held request must outlast the reads done meanwhile.
    client = LazyfsClient(tmp_path / "state", cache_limit=64 << 20, read_deadline=60.0)
    client.ensure_running()
    yield client
    client.shutdown()


def _mount(client: LazyfsClient, host: str, name: str, lazy: LazyImage, index: int,
           holder: str) -> Path:
    layer = lazy.image.layers[index]
    return client.mount(digest=layer.digest, registry=host, repository=name,
                        size=len(layer.data), toc_digest=lazy.toc_digests[index],
                        holder=holder)


def test_pods_of_one_image_mounted_at_once_all_serve_every_file(registry: Registry,
                                                                tmp_path: Path) -> None:
    lazy = estargz_image([LOWER, UPPER], tmp_path)
    lazy.image.push(registry.host, "lazy-many:v1")
    client = LazyfsClient(tmp_path / "node", cache_limit=64 << 20, read_deadline=20.0)
    bundles = [tmp_path / f"pod-{n}" for n in range(4)]
    want = expected_hashes({**LOWER, **UPPER})
    with ImageManager(tmp_path / "node", lazy=client, rootfs_mode=RootfsMode.OVERLAY) as images:
        try:
            image = images.pull(f"{registry.host}/lazy-many:v1")
            start = threading.Barrier(len(bundles))

            def pod(bundle: Path) -> dict[str, str]:
                start.wait(10)  # every pod asks for its mounts at the same moment
                rootfs = images.prepare_rootfs(image, bundle)
                return _regular_files(rootfs)  # read concurrently: single-flight fetches

            with ThreadPoolExecutor(len(bundles)) as pool:
                trees = list(pool.map(pod, bundles))
            for tree in trees:
                assert tree == want  # every file, hashed against the original
            for bundle in bundles:
                assert os.readlink(bundle / "rootfs" / "lib/link.py") == "pkg0/mod1.py"
                assert oct(os.stat(bundle / "rootfs" / "opt").st_mode & 0o7777) == "0o750"
            layers = client.status()["layers"]
            assert len(layers) == 2  # one mount per layer, shared by the four pods
            for layer in layers.values():
                assert sorted(layer["holders"]) == sorted(str(b) for b in bundles)
                assert layer["errors"] == 0 and layer["corrupt_chunks"] == 0
            for layer in lazy.image.layers:  # nothing fetched twice (single flight)
                got = layers[layer.digest]
                assert got["demand_fetched"] + got["prefetched"] < 2 * len(layer.data)
            for bundle in bundles[:-1]:
                images.release_rootfs(bundle)
            assert all(len(v["holders"]) == 1 for v in client.status()["layers"].values())
            assert _regular_files(bundles[-1] / "rootfs") == want  # the last pod still reads
            images.release_rootfs(bundles[-1])
            assert client.status()["layers"] == {}
        finally:
            for bundle in bundles:
                images.release_rootfs(bundle)
            client.shutdown()


def test_a_mount_in_flight_blocks_no_other_layers_reads(registry: Registry, tmp_path: Path,
                                                        lazyfs: LazyfsClient) -> None:
    lazy = estargz_image([LOWER, UPPER], tmp_path)
    lazy.image.push(registry.host, "lazy-inflight:v1")
    stalled = lazy.image.layers[1].digest
    with ControlledProxy.running(registry.host) as proxy:
        first = _mount(lazyfs, proxy.host, "lazy-inflight", lazy, 0, "pod-a")
        proxy.hold.add(stalled)  # the second layer's registry stops answering
        outcome: dict[str, Any] = {}

        def mount_second() -> None:
            try:
                outcome["path"] = _mount(lazyfs, proxy.host, "lazy-inflight", lazy, 1, "pod-a")
            except LazyfsError as exc:  # pragma: no cover - reported by the assert below
                outcome["error"] = exc

        thread = threading.Thread(target=mount_second, daemon=True)
        thread.start()
        assert proxy.arrived.wait(10), "the second layer's mount never reached the registry"
        # While it hangs: the first layer reads every file (its chunks come from the
        # registry now, none is cached yet), the daemon answers, the mount is shared.
        assert _regular_files(first) == expected_hashes(LOWER)
        status = lazyfs.status()
        assert list(status["layers"]) == [lazy.image.layers[0].digest]
        assert status["layers"][lazy.image.layers[0].digest]["errors"] == 0
        assert _mount(lazyfs, proxy.host, "lazy-inflight", lazy, 0, "pod-b") == first
        assert thread.is_alive(), outcome  # all of that happened while the mount was held
        assert proxy.ranged_gets(stalled) == []  # not even its TOC came back yet
        proxy.gate.set()
        thread.join(30)
        assert "error" not in outcome, outcome.get("error")
        assert _regular_files(outcome["path"]) == expected_hashes(UPPER)


def test_ranges_only_refuses_a_200_to_the_toc_request(registry: Registry,
                                                      tmp_path: Path) -> None:
    """The TOC's tail is fetched with ``ranges_only``: a registry that answers it with
    the whole blob is refused at once (its body is not read), the layer falls back to the
    full pull with an event, and the pod's files are the original ones."""
    files: Files = {"data/a.txt": "alpha\n", "data/b.bin": os.urandom(300 << 10)}
    lazy = estargz_image([files], tmp_path)
    lazy.image.push(registry.host, "lazy-200:v1")
    layer = lazy.image.layers[0]
    with ControlledProxy.running(registry.host) as proxy:
        proxy.ignore_range = lambda digest, before: digest == layer.digest and before == 0
        # The fetcher itself: ranges_only refuses the 200 without reading the blob; without
        # ranges_only the 200 is streamed and cut to exactly the bytes asked for.
        with httpx.Client() as http:
            url = f"http://{proxy.host}/v2/lazy-200/blobs/{layer.digest}"
            fetcher = RangeFetcher(http, http, url, len(layer.data))
            with pytest.raises(RangeUnsupported):
                fetcher.fetch(len(layer.data) - 4096, len(layer.data), ranges_only=True)
            assert fetcher.stats.bytes == 0
            proxy.ignore_range = lambda digest, before: digest == layer.digest
            assert fetcher.fetch(1000, 5000) == layer.data[1000:5000]
            assert proxy.ranged_gets(layer.digest)[-1][1] == 200  # it was a whole blob

        proxy.log.clear()
        proxy.ignore_range = lambda digest, before: digest == layer.digest and before == 0
        client = LazyfsClient(tmp_path / "node", read_deadline=20.0)
        bundle = tmp_path / "bundle"
        with ImageManager(tmp_path / "node", lazy=client,
                          rootfs_mode=RootfsMode.OVERLAY) as images:
            try:
                image = images.pull(f"{proxy.host}/lazy-200:v1")
                rootfs = images.prepare_rootfs(image, bundle)
                assert proxy.ranged_gets(layer.digest)[0][1] == 200  # the TOC's: refused
                assert images._blobs.has(layer.digest)  # pulled whole instead
                assert client.status()["layers"] == {}  # nothing was mounted lazily
                assert _regular_files(rootfs / "data") == {
                    k.split("/", 1)[1]: v for k, v in expected_hashes(files).items()}
                events = images.lazy_events(bundle)
                assert [reason for reason, _ in events] == ["LazyPullFallback"]
                assert "RangeUnsupported" in events[0][1]
            finally:
                images.release_rootfs(bundle)
                client.shutdown()


def test_a_200_to_a_chunk_request_after_the_mount_serves_exact_bytes(
        registry: Registry, tmp_path: Path, lazyfs: LazyfsClient) -> None:
    """Once mounted, chunk fetches accept a ``200`` (the issue: some registries answer a
    Range request with the whole blob): the body is streamed, the bytes before the span
    skipped, the rest cut off; each chunk is still verified before it is served."""
    lazy = estargz_image([LOWER], tmp_path)
    lazy.image.push(registry.host, "lazy-200-chunks:v1")
    digest = lazy.image.layers[0].digest
    with ControlledProxy.running(registry.host) as proxy:
        mnt = _mount(lazyfs, proxy.host, "lazy-200-chunks", lazy, 0, "pod-a")
        proxy.ignore_range = lambda d, before: d == digest  # from now on: whole blobs
        weights = (mnt / "models/w.bin").read_bytes()
        assert hashlib.sha256(weights).hexdigest() == expected_hashes(LOWER)["models/w.bin"]
        assert _regular_files(mnt) == expected_hashes(LOWER)
        answered = [status for _, status in proxy.ranged_gets(digest)]
        assert answered[0] == 206 and 200 in answered  # the TOC ranged, chunks whole
        layer = lazyfs.status()["layers"][digest]
        assert layer["errors"] == 0 and layer["corrupt_chunks"] == 0
