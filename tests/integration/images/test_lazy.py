"""Lazy pulls over real FUSE mounts from the real test registry (``gpucloud lazyfs``).

Needs root, /dev/fuse and libfuse3 (Debian fuse3); the registry is Debian's docker-registry.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.images import ImageManager, RootfsMode
from gpucloud.images.lazy.cache import OPEN_FILES, ChunkCache
from gpucloud.images.lazy.client import LazyfsClient, LazyfsError
from gpucloud.images.lazy.estargz import read_toc_file
from gpucloud.images.testing import (
    busybox_files,
    directory,
    file,
    hardlink,
    symlink,
    whiteout,
)
from tests.fixtures.registry import Registry, start_registry
from tests.integration.images.lazy_testing import (
    estargz_image,
    expected_hashes,
    rangeless_proxy,
    tree_hashes,
)
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs root and /dev/fuse")

BIG = os.urandom(300 << 10)  # five 64 KiB chunks, incompressible
FILES: dict[str, bytes | str | object] = {
    "etc/hello.txt": "hello from a lazy layer\n",
    "data/big.bin": BIG,
    "data/empty": b"",
    "data/small.py": "print('x')\n" * 200,
    "data/link": symlink("small.py"),
    "data/hard": hardlink("data/small.py"),
    "opt/": directory(0o700),
    "bin/tool": file(b"#!/bin/sh\necho tool\n", 0o755),
    "gone": whiteout(),
}


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[LazyfsClient]:
    client = LazyfsClient(tmp_path / "state", cache_limit=64 << 20, read_deadline=3.0)
    client.ensure_running()
    yield client
    client.shutdown()


def _push(registry: Registry, tmp_path: Path, name: str,
          layers: list[dict[str, bytes | str | object]] | None = None) -> tuple[object, str]:
    lazy = estargz_image(layers or [FILES], tmp_path)
    lazy.image.push(registry.host, f"{name}:v1")
    return lazy, lazy.toc_digests[0]


def _mount(client: LazyfsClient, host: str, name: str, lazy: object, toc: str,
           holder: str = "pod-a") -> Path:
    layer = lazy.image.layers[0]  # type: ignore[attr-defined]
    return client.mount(digest=layer.digest, registry=host, repository=name,
                        size=len(layer.data), toc_digest=toc, holder=holder)


def _blob_path(registry: Registry, digest: str) -> Path:
    hexd = digest.split(":", 1)[1]
    return (registry.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2]
            / hexd / "data")


def test_lazy_mount_serves_every_file_verified(registry: Registry, tmp_path: Path,
                                               lazyfs: LazyfsClient) -> None:
    lazy, toc = _push(registry, tmp_path, "lazy-basic")
    mnt = _mount(lazyfs, registry.host, "lazy-basic", lazy, toc)
    hashes = tree_hashes(mnt)
    want = expected_hashes(FILES)
    assert {k: hashes[k] for k in want} == want
    assert hashes["data/hard"] == hashes["data/small.py"]
    assert hashes["data/link"] == "link:small.py"
    assert os.stat(mnt / "data/hard").st_ino == os.stat(mnt / "data/small.py").st_ino
    small = os.stat(mnt / "data/small.py")  # the struct stat copied whole (stat_image)
    assert small.st_nlink == 2 and small.st_size == len("print('x')\n" * 200)
    assert small.st_mtime_ns == 1_700_000_000 * 10**9  # images.testing's entry mtime
    assert small.st_blocks == (small.st_size + 511) // 512
    assert oct(os.stat(mnt / "opt").st_mode & 0o7777) == "0o700"
    gone = os.lstat(mnt / "gone")  # whiteout in overlayfs form: char device 0:0
    assert (gone.st_mode & 0o170000) == 0o020000 and gone.st_rdev == 0
    assert not (mnt / "stargz.index.json").exists()
    assert not any(p.name.endswith(".landmark") for p in mnt.iterdir())
    line = next(x for x in Path("/proc/self/mountinfo").read_text().splitlines()
                if f" {mnt} " in x)
    assert " ro," in line and "fuse.estargz" in line
    assert "allow_other" in line and "default_permissions" in line
    with pytest.raises(OSError) as exc:
        (mnt / "etc/new").write_text("x")
    assert exc.value.errno in (errno.EROFS, errno.EACCES)


def test_cached_reads_are_served_zero_copy_and_exact(registry: Registry, tmp_path: Path,
                                                      lazyfs: LazyfsClient) -> None:
    """Once cached, reads are answered with chunk-file descriptors (``read_buf``): the
    bytes must be exact at every offset, across chunk boundaries, page cache dropped."""
    lazy, toc = _push(registry, tmp_path, "lazy-zero-copy")
    mnt = _mount(lazyfs, registry.host, "lazy-zero-copy", lazy, toc)
    assert (mnt / "data/big.bin").read_bytes() == BIG  # fetched (and cached) here
    fd = os.open(mnt / "data/big.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next reads reach lazyfs
        for offset, size in ((0, 1), ((64 << 10) - 7, 20), (100_000, 200_000),
                             (len(BIG) - 5, 100), (3 * (64 << 10), 64 << 10)):
            assert os.pread(fd, size, offset) == BIG[offset:offset + size]
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(BIG) + 10, 0) == BIG
    finally:
        os.close(fd)
    fetched = lazyfs.status()["layers"][lazy.image.layers[0].digest]  # type: ignore[attr-defined]
    assert fetched["demand_fetched"] + fetched["prefetched"] < 2 * len(BIG)  # not refetched


SEQ = os.urandom((3 << 20) + 123)  # 49 chunks of 64 KiB, the last one short


def test_cached_sequential_reads_are_spliced_exact_across_chunks(registry: Registry,
                                                                 tmp_path: Path,
                                                                 lazyfs: LazyfsClient) -> None:
    """Large (readahead-sized) requests over many cached chunks: each reply is a vector of
    chunk descriptors that libfuse splices (``init_with_config`` asks for it), and the
    chunk files ahead are advised into the page cache; the bytes must still be exact."""
    lazy, toc = _push(registry, tmp_path, "lazy-splice", [{"w.bin": SEQ}])
    mnt = _mount(lazyfs, registry.host, "lazy-splice", lazy, toc)
    path = mnt / "w.bin"
    assert path.read_bytes() == SEQ  # fetched and cached
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(2):  # the second pass: replies spliced from cached chunk files
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
            assert hashlib.sha256(got).digest() == hashlib.sha256(SEQ).digest()
            os.lseek(fd, 0, os.SEEK_SET)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for offset, size in (((64 << 10) * 7 - 1, (1 << 20) + 3), (len(SEQ) - 70_000, 1 << 20),
                             (len(SEQ) - 1, 10), (len(SEQ), 10), (12_345, 200_000)):
            assert os.pread(fd, size, offset) == SEQ[offset:offset + size]
    finally:
        os.close(fd)
    status = lazyfs.status()["layers"][lazy.image.layers[0].digest]  # type: ignore[attr-defined]
    assert status["errors"] == 0
    assert status["demand_fetched"] + status["prefetched"] < 2 * len(SEQ)  # never refetched


def test_cached_reads_give_their_descriptors_back(registry: Registry, tmp_path: Path,
                                                 lazyfs: LazyfsClient) -> None:
    """More cached files read than the cache keeps open (``OPEN_FILES``): the daemon's
    descriptors stay bounded. Each zero-copy reply holds its chunk files until the same
    libfuse thread's next request; a thread-local lost them (a fresh one per ctypes
    callback), so every file ever read stayed open, up to the process's limit."""
    files: dict[str, bytes | str | object] = {f"many/{n:04d}": f"file {n}\n" * (n % 7 + 1)
                                              for n in range(OPEN_FILES + 200)}
    lazy, toc = _push(registry, tmp_path, "lazy-fds", [files])
    mnt = _mount(lazyfs, registry.host, "lazy-fds", lazy, toc)
    for name, data in files.items():  # fetched, then served from the cache
        assert (mnt / name).read_bytes() == str(data).encode()
    fds = Path(f"/proc/{lazyfs.pid()}/fd")
    before = len(list(fds.iterdir()))
    for name in files:
        path = mnt / name
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read asks FUSE
            assert os.read(fd, 1 << 16)
        finally:
            os.close(fd)
    assert len(list(fds.iterdir())) < before + OPEN_FILES + 64  # the pool, and no more


MAPPED = os.urandom((1 << 20) + 4321)  # 17 chunks of 64 KiB, the last one short
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages the kernel's page cache holds, from a fresh open (a
    shared read-only mapping that is never touched: ``mincore`` reports the page cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_mmap_of_a_lazy_file_reads_exact_bytes(registry: Registry, tmp_path: Path,
                                               lazyfs: LazyfsClient) -> None:
    """The mount has no ``direct_io`` (with it, a shared mmap is refused: ENODEV) and keeps
    the kernel page cache: a read-only mmap of a file not fetched yet faults its pages in
    through FUSE, at random offsets first (chunks fetched out of order), then whole; again
    once its pages were dropped (now served from the chunk cache); and the pages a read
    left in the page cache are still there after the file is closed and opened again."""
    lazy, toc = _push(registry, tmp_path, "lazy-mmap", [{"w.bin": MAPPED}])
    mnt = _mount(lazyfs, registry.host, "lazy-mmap", lazy, toc)
    rng = random.Random(20240611)
    edges = [0, (64 << 10) - 1, 64 << 10, 5 * (64 << 10) - 3, len(MAPPED) - 1]
    with (mnt / "w.bin").open("rb") as stream, \
            mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert len(mapped) == len(MAPPED)
        for _ in range(2):
            for offset in [*(rng.randrange(len(MAPPED)) for _ in range(48)), *edges]:
                size = rng.randrange(1, 200_000)
                assert mapped[offset:offset + size] == MAPPED[offset:offset + size], offset
            assert hashlib.sha256(mapped).digest() == hashlib.sha256(MAPPED).digest()
            mapped.madvise(mmap.MADV_DONTNEED)  # unmap the pages, then drop them: the
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # next faults
            # reach lazyfs again
    status = lazyfs.status()["layers"][lazy.image.layers[0].digest]  # type: ignore[attr-defined]
    assert status["errors"] == 0
    pages = (len(MAPPED) + _PAGE - 1) // _PAGE
    assert (mnt / "w.bin").read_bytes() == MAPPED
    assert _resident_pages(mnt / "w.bin") == pages  # kept across close and open


def test_negative_lookups_stay_enoent(registry: Registry, tmp_path: Path,
                                      lazyfs: LazyfsClient) -> None:
    """Missing names are ENOENT, and still ENOENT when asked again (the kernel caches the
    negative entry a day): the cached answer must not turn into something else, nor hide
    the names that do exist beside it. Hidden root entries are missing names too."""
    lazy, toc = _push(registry, tmp_path, "lazy-negative")
    mnt = _mount(lazyfs, registry.host, "lazy-negative", lazy, toc)
    missing = ["nope", "etc/nope", "data/big.bin.orig", "opt/x", "stargz.index.json",
               ".no.prefetch.landmark", "data/nope/deeper"]
    for _ in range(2):
        for name in missing:
            with pytest.raises(OSError) as exc:
                os.stat(mnt / name)
            assert exc.value.errno == errno.ENOENT, name
        with pytest.raises(OSError) as exc:
            os.stat(mnt / "etc/hello.txt/x")
        assert exc.value.errno == errno.ENOTDIR
        assert (mnt / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
        assert sorted(os.listdir(mnt / "etc")) == ["hello.txt"]
        assert os.listdir(mnt / "opt") == []


def test_shared_mount_is_refcounted_and_prefetch_completes(registry: Registry, tmp_path: Path,
                                                           lazyfs: LazyfsClient) -> None:
    lazy, toc = _push(registry, tmp_path, "lazy-shared")
    first = _mount(lazyfs, registry.host, "lazy-shared", lazy, toc, "pod-a")
    second = _mount(lazyfs, registry.host, "lazy-shared", lazy, toc, "pod-b")
    assert first == second
    digest = lazy.image.layers[0].digest  # type: ignore[attr-defined]
    wait_until(lambda: lazyfs.status()["layers"][digest]["prefetch_done"], what="prefetch")
    layer = lazyfs.status()["layers"][digest]
    assert layer["local"] == layer["total"] == len(BIG) + 2200 + 20 + 24
    assert sorted(layer["holders"]) == ["pod-a", "pod-b"]
    lazyfs.release("pod-a")
    assert os.path.ismount(first)
    lazyfs.release("pod-b")
    assert not os.path.ismount(first)
    assert lazyfs.local(digest, toc) == (layer["total"], layer["total"])


def test_corrupted_chunk_is_refused_with_eio_and_an_event(registry: Registry, tmp_path: Path,
                                                          lazyfs: LazyfsClient) -> None:
    lazy, toc = _push(registry, tmp_path, "lazy-corrupt")
    layer = lazy.image.layers[0]  # type: ignore[attr-defined]
    blob = tmp_path / "blob"
    blob.write_bytes(layer.data)
    parsed = read_toc_file(blob, toc)
    chunk = parsed.chunks_of("data/big.bin")[2]
    stored = _blob_path(registry, layer.digest)
    data = bytearray(stored.read_bytes())
    middle = (chunk.offset + chunk.end) // 2
    data[middle] ^= 0xFF  # same size: the registry serves it as it is
    stored.write_bytes(bytes(data))
    mnt = _mount(lazyfs, registry.host, "lazy-corrupt", lazy, toc)
    with (mnt / "data/big.bin").open("rb") as stream:
        assert stream.read(64 << 10) == BIG[: 64 << 10]  # chunk 0 is fine
        stream.seek(chunk.chunk_offset)
        with pytest.raises(OSError) as exc:
            stream.read(100)
    assert exc.value.errno == errno.EIO
    assert hashlib.sha256((mnt / "etc/hello.txt").read_bytes()).hexdigest() == \
        expected_hashes(FILES)["etc/hello.txt"]
    reasons = {e["reason"] for e in lazyfs.events()}
    assert "ChunkDigestMismatch" in reasons
    cache = ChunkCache(lazyfs.root / "cache", 1 << 30)
    assert not cache.has(chunk.digest)


def test_rangeless_registry_is_refused_for_lazy_mounting(registry: Registry, tmp_path: Path,
                                                         lazyfs: LazyfsClient) -> None:
    lazy, toc = _push(registry, tmp_path, "lazy-norange")
    with rangeless_proxy(registry.host) as proxy, pytest.raises(LazyfsError) as exc:
        _mount(lazyfs, proxy, "lazy-norange", lazy, toc)
    assert exc.value.code == "RangeUnsupported"


def test_toc_digest_mismatch_is_refused(registry: Registry, tmp_path: Path,
                                        lazyfs: LazyfsClient) -> None:
    lazy, _ = _push(registry, tmp_path, "lazy-badtoc")
    with pytest.raises(LazyfsError) as exc:
        _mount(lazyfs, registry.host, "lazy-badtoc", lazy, "sha256:" + "0" * 64)
    assert exc.value.code == "DigestMismatch"


def test_daemon_restart_with_registry_down_serves_the_cache(tmp_path: Path) -> None:
    client = LazyfsClient(tmp_path / "state", cache_limit=64 << 20, read_deadline=1.0)
    try:
        with start_registry(tmp_path / "own-registry") as own:
            lazy, toc = _push(own, tmp_path, "lazy-restart")
            mnt = _mount(client, own.host, "lazy-restart", lazy, toc)
            assert (mnt / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
            old = client.pid()
        os.kill(old, signal.SIGKILL)  # the registry is gone too
        wait_until(lambda: not client.running(), what="daemon death")
        with pytest.raises(OSError) as dead:
            os.listdir(mnt / "opt")  # what the kernel has not cached needs the dead daemon
        assert dead.value.errno == errno.ENOTCONN
        status = client.status()  # starts a new daemon, which restores the mount
        assert client.pid() != old
        digest = lazy.image.layers[0].digest  # type: ignore[attr-defined]
        assert status["layers"][digest]["holders"] == ["pod-a"]
        assert (mnt / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
        # Was the prefetch done before the kill? Then everything is local; if not, the
        # uncached chunks answer EIO (registry down), never wrong bytes.
        try:
            data = (mnt / "data/big.bin").read_bytes()
        except OSError as exc:
            assert exc.errno == errno.EIO
        else:
            assert data == BIG
    finally:
        client.shutdown()


def test_agent_side_client_exit_leaves_the_daemon_and_mounts(registry: Registry,
                                                             tmp_path: Path) -> None:
    state = tmp_path / "state"
    lazy, toc = _push(registry, tmp_path, "lazy-agent")
    layer = lazy.image.layers[0]  # type: ignore[attr-defined]
    script = (
        "import sys; from pathlib import Path;"
        "from gpucloud.images.lazy.client import LazyfsClient;"
        f"c = LazyfsClient(Path({str(state)!r}));"
        f"print(c.mount(digest={layer.digest!r}, registry={registry.host!r},"
        f" repository='lazy-agent', size={len(layer.data)}, toc_digest={toc!r},"
        " holder='pod-a'), flush=True);"
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    agent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=False)
    assert agent.returncode == -signal.SIGKILL
    mnt = Path(agent.stdout.strip())
    client = LazyfsClient(state)
    try:
        assert os.path.ismount(mnt)
        assert (mnt / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
    finally:
        client.shutdown()


def test_chunk_cache_evicts_lru_and_survives_a_full_disk(tmp_path: Path) -> None:
    chunks = [os.urandom(40 << 10) for _ in range(6)]
    digests = ["sha256:" + hashlib.sha256(c).hexdigest() for c in chunks]
    cache = ChunkCache(tmp_path / "lru", 100 << 10)
    for digest, data in zip(digests[:2], chunks[:2], strict=True):
        assert cache.put(digest, data)
    assert cache.get(digests[0]) == chunks[0]  # 0 is now more recent than 1
    assert cache.put(digests[2], chunks[2])
    assert cache.has(digests[0]) and cache.has(digests[2]) and not cache.has(digests[1])
    assert cache.used <= 100 << 10 and cache.evictions == 1
    with pytest.raises(ValueError):
        cache.put(digests[3], chunks[4])
    assert not cache.has(digests[3])
    assert not cache.put("sha256:" + hashlib.sha256(b"x" * (200 << 10)).hexdigest(),
                         b"x" * (200 << 10))  # larger than the whole cache

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(small)], check=True)
    full = ChunkCache(small, 1 << 30)  # the limit is far above what the disk holds
    try:
        stored = [full.put(d, c) for d, c in zip(digests, chunks, strict=True)]
        assert stored.count(True) >= 1 and full.evictions >= 1
        for digest, data in zip(digests, chunks, strict=True):
            got = full.get(digest)
            assert got is None or got == data  # never a partial or wrong chunk
        assert list((small / "tmp").iterdir()) == []
    finally:
        full.close()  # its open chunk files would keep the tmpfs busy
        subprocess.run(["umount", "--lazy", str(small)], check=True)


def test_status_reports_fetch_stats(registry: Registry, tmp_path: Path,
                                    lazyfs: LazyfsClient) -> None:
    lazy, toc = _push(registry, tmp_path, "lazy-stats")
    _mount(lazyfs, registry.host, "lazy-stats", lazy, toc)
    status = lazyfs.status()
    digest = lazy.image.layers[0].digest  # type: ignore[attr-defined]
    assert status["layers"][digest]["requests"] >= 1  # the tail, also the Range probe
    assert json.dumps(status)


# -- a pod on a cold node: the image manager + lazyfs + overlay + runc --------------------

POD_FILES: dict[str, bytes | str | object] = {
    **busybox_files(),
    "data/weights.bin": os.urandom(200 << 10),
    "data/config.json": json.dumps({"layers": 12}),
    "data/tokenizer.txt": "a b c\n" * 500,
}


def _runc(bundle: Path, rootfs: Path, args: list[str]) -> str:
    """Run ``args`` in a real runc container on ``rootfs``; its stdout."""
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    config = json.loads((bundle / "config.json").read_text())
    config["process"]["terminal"] = False
    config["process"]["args"] = args
    config["root"] = {"path": str(rootfs), "readonly": False}
    (bundle / "config.json").write_text(json.dumps(config))
    name = f"lazy-{os.getpid()}-{time.monotonic_ns()}"
    done = subprocess.run(["runc", "run", "--bundle", str(bundle), name], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _pod_sums(out: str) -> dict[str, str]:
    return {line.split()[1].lstrip("/"): line.split()[0] for line in out.splitlines()}


def test_pod_on_a_cold_node_runs_from_an_estargz_image(registry: Registry,
                                                       tmp_path: Path) -> None:
    lazy = estargz_image([POD_FILES, {"data/extra.txt": "top layer\n"}], tmp_path)
    lazy.image.push(registry.host, "lazy-pod:v1")
    client = LazyfsClient(tmp_path / "node", cache_limit=64 << 20)
    bundle = tmp_path / "bundle"
    with ImageManager(tmp_path / "node", lazy=client, rootfs_mode=RootfsMode.OVERLAY) as images:
        try:
            image = images.pull(f"{registry.host}/lazy-pod:v1")
            assert not any(images._blobs.has(d.digest) for d in image.manifest.layers)
            rootfs = images.prepare_rootfs(image, bundle)
            record = images.list_images()[0]
            local, total = images.local_bytes(record)
            assert total > 200 << 10 and local <= total
            out = _runc(bundle, rootfs, ["/bin/sh", "-c",
                                         "sha256sum /data/* /bin/busybox /etc/passwd"])
            want = expected_hashes({**POD_FILES, "data/extra.txt": "top layer\n"})
            assert _pod_sums(out) == {k: want[k] for k in _pod_sums(out)}
            assert set(_pod_sums(out)) >= {"data/weights.bin", "data/extra.txt", "bin/busybox"}
            assert not (rootfs / "stargz.index.json").exists()
            mounts = [m for m in client.status()["layers"].values()]
            assert len(mounts) == 2 and all(m["holders"] == [str(bundle)] for m in mounts)
            images.release_rootfs(bundle)
            assert client.status()["layers"] == {}
        finally:
            images.release_rootfs(bundle)
            client.shutdown()


def test_rangeless_registry_falls_back_to_the_full_pull(registry: Registry,
                                                        tmp_path: Path) -> None:
    files: dict[str, bytes | str | object] = {"data/a.txt": "alpha\n",
                                              "data/b.bin": os.urandom(100 << 10)}
    lazy = estargz_image([files], tmp_path)
    lazy.image.push(registry.host, "lazy-fallback:v1")
    client = LazyfsClient(tmp_path / "node")
    with rangeless_proxy(registry.host) as proxy, ImageManager(
            tmp_path / "node", lazy=client, rootfs_mode=RootfsMode.OVERLAY) as images:
        try:
            image = images.pull(f"{proxy}/lazy-fallback:v1")
            rootfs = images.prepare_rootfs(image, tmp_path / "bundle")
            assert images._blobs.has(image.manifest.layers[0].digest)  # pulled whole
            assert tree_hashes(rootfs / "data") == {
                k.split("/", 1)[1]: v for k, v in expected_hashes(files).items()}
            assert not (rootfs / "stargz.index.json").exists()
            assert not (rootfs / ".no.prefetch.landmark").exists()
            events = images.lazy_events(tmp_path / "bundle")
            assert [r for r, _ in events] == ["LazyPullFallback"]
            assert "RangeUnsupported" in events[0][1]
        finally:
            images.release_rootfs(tmp_path / "bundle")
            client.shutdown()


def test_xattrs_are_served_only_by_layers_that_have_them(registry: Registry, tmp_path: Path,
                                                         lazyfs: LazyfsClient) -> None:
    """A layer without xattrs leaves getxattr to libfuse (ENOSYS: the kernel stops asking
    and answers EOPNOTSUPP, which overlayfs takes as none); one with an opaque directory
    serves ``trusted.overlay.opaque`` and ENODATA for the rest. Files read the same (no
    ``open`` callback either: the read finds its node by path)."""
    lazy, toc = _push(registry, tmp_path, "lazy-plain")
    plain = _mount(lazyfs, registry.host, "lazy-plain", lazy, toc)
    for _ in range(2):  # the second ask is the kernel's own answer
        with pytest.raises(OSError) as exc:
            os.getxattr(plain / "etc/hello.txt", "trusted.overlay.opaque")
        assert exc.value.errno == errno.EOPNOTSUPP
    assert (plain / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
    opaque_files: dict[str, bytes | str | object] = {"d/.wh..wh..opq": b"", "d/x": "x\n"}
    lazy, toc = _push(registry, tmp_path, "lazy-opaque", [opaque_files])
    mnt = _mount(lazyfs, registry.host, "lazy-opaque", lazy, toc)
    assert os.getxattr(mnt / "d", "trusted.overlay.opaque") == b"y"
    with pytest.raises(OSError) as exc:
        os.getxattr(mnt / "d/x", "trusted.overlay.opaque")
    assert exc.value.errno == errno.ENODATA
    assert (mnt / "d/x").read_text() == "x\n"


# -- a layer bigger than the node's chunk cache -------------------------------------------

SMALL_CACHE = 512 << 10


def test_layer_bigger_than_the_cache_is_pulled_whole_and_the_rest_mounts_lazily(
        registry: Registry, tmp_path: Path) -> None:
    """Mounted lazily, a layer larger than the whole chunk cache would be pushed through it
    by its prefetch, evicting its own chunks and everyone else's: the daemon refuses it
    (``LayerTooLarge``, naming both sizes) and the agent pulls that layer whole, with an
    event; the image's other layer, which fits, is still mounted lazily."""
    big: dict[str, bytes | str | object] = {"data/weights.bin": os.urandom(600 << 10),
                                            "data/a.txt": "alpha\n"}
    small: dict[str, bytes | str | object] = {"data/b.txt": "beta\n" * 1000,
                                              "etc/config.json": json.dumps({"layers": 12})}
    lazy = estargz_image([big, small], tmp_path)
    lazy.image.push(registry.host, "lazy-too-big:v1")
    client = LazyfsClient(tmp_path / "node", cache_limit=SMALL_CACHE)
    bundle = tmp_path / "bundle"
    with ImageManager(tmp_path / "node", lazy=client, rootfs_mode=RootfsMode.OVERLAY) as images:
        try:
            image = images.pull(f"{registry.host}/lazy-too-big:v1")
            rootfs = images.prepare_rootfs(image, bundle)
            big_layer, small_layer = image.manifest.layers
            assert images._blobs.has(big_layer.digest)  # pulled whole
            assert not images._blobs.has(small_layer.digest)  # left to the lazy mount
            want = {**expected_hashes(big), **expected_hashes(small)}
            got = tree_hashes(rootfs)
            assert {name: got.get(name) for name in want} == want
            events = images.lazy_events(bundle)
            assert [reason for reason, _ in events] == ["LazyPullFallback"]
            message = events[0][1]
            assert big_layer.digest in message and "LayerTooLarge" in message
            assert f"{(600 << 10) + 6:,} bytes" in message and f"{SMALL_CACHE:,} bytes" in message
            status = client.status()
            assert list(status["layers"]) == [small_layer.digest]
            assert status["cache"]["used"] < 64 << 10  # nothing of the big layer went in
        finally:
            images.release_rootfs(bundle)
            client.shutdown()


def test_a_layer_that_just_fits_the_cache_mounts_and_one_byte_more_is_refused(
        registry: Registry, tmp_path: Path) -> None:
    """The bound is the whole cache, counted in uncompressed chunk bytes (each distinct
    chunk once: the copy below costs nothing): a layer of exactly the limit mounts and reads
    back; one byte more does not."""
    weights = os.urandom(200 << 10)
    exact: dict[str, bytes | str | object] = {"w.bin": weights, "copy.bin": weights}
    over: dict[str, bytes | str | object] = {"w.bin": os.urandom(200 << 10), "x": b"!"}
    fits, fits_toc = _push(registry, tmp_path, "lazy-fits", [exact])
    too_big, too_big_toc = _push(registry, tmp_path, "lazy-over", [over])
    client = LazyfsClient(tmp_path / "state", cache_limit=200 << 10, read_deadline=3.0)
    try:
        mnt = _mount(client, registry.host, "lazy-fits", fits, fits_toc)
        assert tree_hashes(mnt) == expected_hashes(exact)
        with pytest.raises(LazyfsError) as refused:
            _mount(client, registry.host, "lazy-over", too_big, too_big_toc, holder="pod-b")
        assert refused.value.code == "LayerTooLarge"
        assert f"{(200 << 10) + 1:,} bytes" in refused.value.message
        digest = fits.image.layers[0].digest  # type: ignore[attr-defined]
        assert list(client.status()["layers"]) == [digest]
        assert tree_hashes(mnt) == expected_hashes(exact)
    finally:
        client.shutdown()
