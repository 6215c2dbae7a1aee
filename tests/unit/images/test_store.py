"""The blob store: verified, atomic, and one download per digest under concurrency."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from gpucloud.images.errors import DigestMismatch
from gpucloud.images.store import BlobStore, ImageIndex

DATA = b"some layer" * 1000
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


def test_concurrent_ingests_of_one_digest_fetch_it_once(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    fetches: list[int] = []
    barrier = threading.Barrier(4)

    def write(sink: BinaryIO) -> None:
        fetches.append(1)
        sink.write(DATA)

    def worker() -> None:
        barrier.wait()
        store.ingest(DIGEST, write)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fetches) == 1
    assert store.read(DIGEST) == DATA


def test_a_failed_write_leaves_neither_blob_nor_temporary_file(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)

    def corrupt(sink: BinaryIO) -> None:
        sink.write(b"partial")
        raise DigestMismatch(DIGEST, "its content hashed to something else")

    with pytest.raises(DigestMismatch):
        store.ingest(DIGEST, corrupt)
    assert not store.has(DIGEST)
    assert list(store.tmp.iterdir()) == []


def test_put_bytes_and_copy_in_verify_the_digest(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    with pytest.raises(DigestMismatch, match=DIGEST):
        store.put_bytes(DIGEST, b"not it")
    src = tmp_path / "src"
    src.write_bytes(b"not it either")
    with src.open("rb") as stream, pytest.raises(DigestMismatch, match=DIGEST):
        store.copy_in(DIGEST, stream)
    assert not store.has(DIGEST)
    store.put_bytes(DIGEST, DATA)
    assert store.has(DIGEST)


def test_index_maps_references_to_manifests(tmp_path: Path) -> None:
    BlobStore(tmp_path)
    index = ImageIndex(tmp_path)
    index.put("docker.io/library/a:1", DIGEST, DIGEST, 10)
    index.put("docker.io/library/b:1", DIGEST, DIGEST, 20)
    index.put("docker.io/library/a:1", DIGEST, DIGEST, 30)
    assert [(r.reference, r.size) for r in ImageIndex(tmp_path).all()] == [
        ("docker.io/library/a:1", 30),
        ("docker.io/library/b:1", 20),
    ]
    assert index.remove("docker.io/library/a:1") and index.get("docker.io/library/a:1") is None
