"""A lazy layer whose registry goes away after the mount (real registry, real FUSE mount):
reads of what is not cached fail with ``EIO``, never wrong bytes, and the pods holding the
layer get a ``LazyReadFailed`` event, one per interval however often they retry.

Needs root, /dev/fuse and libfuse3 (Debian fuse3); the registry is Debian's docker-registry.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpucloud.images.lazy.cache import ChunkCache
from gpucloud.images.lazy.client import LazyfsClient
from gpucloud.images.lazy.estargz import read_toc_file
from tests.fixtures.registry import start_registry
from tests.integration.images.lazy_testing import estargz_image

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs root and /dev/fuse")

FILES: dict[str, bytes | str | object] = {
    "etc/hello.txt": "hello from a lazy layer\n",
    "data/big.bin": os.urandom(300 << 10),  # five 64 KiB chunks
    "data/other.bin": os.urandom(100 << 10),
}


def _read_fails_with_eio(path: Path) -> None:
    with pytest.raises(OSError) as exc:
        path.read_bytes()
    assert exc.value.errno == errno.EIO


def _read_failures(client: LazyfsClient) -> list[dict[str, object]]:
    return [e for e in client.events() if e["reason"] == "LazyReadFailed"]


def test_a_read_with_the_registry_gone_is_eio_and_one_event(tmp_path: Path) -> None:
    lazy = estargz_image([FILES], tmp_path)
    layer = lazy.image.layers[0]
    blob = tmp_path / "blob"
    blob.write_bytes(layer.data)
    toc = read_toc_file(blob, lazy.toc_digests[0])
    client = LazyfsClient(tmp_path / "state", cache_limit=64 << 20, read_deadline=2.0)
    try:
        with start_registry(tmp_path / "own-registry") as own:
            lazy.image.push(own.host, "lazy-gone:v1")
            mnt = client.mount(digest=layer.digest, registry=own.host, repository="lazy-gone",
                               size=len(layer.data), toc_digest=lazy.toc_digests[0],
                               holder="pod-a")
        # The registry is stopped (its process gone, its port closed). Nothing of the files
        # was fetched: no read yet, and the bulk prefetch waits 3 s after a mount.
        cache = ChunkCache(client.root / "cache", 1 << 30)
        chunks = [ref.digest for path in FILES for ref in toc.chunks_of(path)]
        assert not any(cache.has(digest) for digest in chunks)

        _read_fails_with_eio(mnt / "data/big.bin")
        failed = _read_failures(client)
        assert len(failed) == 1, failed
        message = str(failed[0]["message"])
        assert message.startswith(f"layer {layer.digest}: read of /data/big.bin failed")
        assert "\n" not in message and failed[0]["holders"] == ["pod-a"]

        for _ in range(2):  # a program retrying: EIO each time, no event per read
            _read_fails_with_eio(mnt / "data/other.bin")
            _read_fails_with_eio(mnt / "data/big.bin")
        assert _read_failures(client) == []
        assert client.status()["layers"][layer.digest]["errors"] >= 5
        assert not any(cache.has(digest) for digest in chunks)
    finally:
        client.shutdown()
