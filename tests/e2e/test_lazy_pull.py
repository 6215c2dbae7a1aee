"""Lazy pulling end to end: a pod created through the API on a cold node (a real agent
process, its ``gpucloud lazyfs`` daemon and real FUSE mounts) runs from an image converted
to eStargz by ``gpucloud image optimize``'s own code and pushed to the real registry, and
every file it reads hashes as the original did (issue 11's "Done when").

Needs root, runc, busybox, Debian's docker-registry (as every e2e test), plus /dev/fuse and
libfuse3 (Debian fuse3) for the lazy mounts.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.client import LazyfsClient, lazyfs_root
from gpucloud.images.lazy.optimize import OptimizedImage, OptimizeOptions, optimize
from gpucloud.images.lazy.toc import NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK
from gpucloud.images.store import BlobStore, digest_hex
from gpucloud.images.testing import (
    Entry,
    FileSpec,
    busybox_files,
    busybox_image,
    directory,
    file,
    hardlink,
    symlink,
)
from tests.e2e.cluster import Cloud, wait_for
from tests.fixtures.registry import Registry

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"),
                                reason="lazy mounts need /dev/fuse")

#: Small enough that the tree's larger files (and busybox itself) span several chunks, so
#: chunk boundaries, a file of exactly two chunks and one a byte over one chunk are read.
CHUNK = 128 << 10
_random = random.Random(11)
#: The image's second layer: files of varied sizes (empty, tiny, exactly chunk-sized,
#: chunked, compressible and not), nested directories, an empty one, symlinks (absolute and
#: relative), a hard link, a name with a space and an executable script.
TREE: dict[str, bytes | str | Entry] = {
    "tree": directory(),
    "tree/empty": b"",
    "tree/small.txt": "hello from a lazy layer\n",
    "tree/with space.txt": "a name with a space\n",
    "tree/over-one-chunk.bin": _random.randbytes(CHUNK + 1),
    "tree/run.sh": file("#!/bin/sh\necho script-ran-from-lazy-layer\n", 0o755),
    "tree/a/big.bin": _random.randbytes(5 * CHUNK + 12_345),
    "tree/a/empty-too": b"",
    "tree/a/b/exact.bin": _random.randbytes(2 * CHUNK),
    "tree/a/b/text.log": "".join(f"line {n}: the quick brown fox\n" for n in range(25_000)),
    "tree/a/b/c/deep.txt": "deep down\n",
    "tree/a/b/c/up": symlink("../../../small.txt"),
    "tree/link-to-big": symlink("/tree/a/big.bin"),
    "tree/hard": hardlink("tree/small.txt"),
    "tree/void": directory(0o700),
    **{f"tree/many/f{n:02d}": _random.randbytes(n * 97) for n in range(40)},
}
DONE = "END-OF-TREE"
#: Hash every regular file of the root filesystem (``-xdev``: not /proc, /sys, /dev), list
#: the tree's symlinks and directories, run the script, then wait until stopped. ``set -e``
#: and xargs' status: a read error (EIO from the mount) fails the pod.
PROBE = f"""set -e
trap 'exit 0' TERM
find / -xdev -type f -print0 | xargs -0 sha256sum
find /tree -type l | while read -r l; do echo "L $l $(readlink "$l")"; done
find /tree -type d | sed 's/^/D /'
/tree/run.sh
echo {DONE}
while :; do sleep 1 & wait $!; done
"""


def _sha256(value: bytes | str | Entry) -> str | None:
    """The hash of a regular file's content (None for anything else)."""
    if isinstance(value, Entry):
        if value.kind != "file":
            return None
        value = value.data
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).hexdigest()


def _expected(layers: list[FileSpec]) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """(hash by path of every regular file, symlink targets, the tree's directories)."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    dirs: set[str] = set()
    for spec in layers:
        for name, value in spec.items():
            digest = _sha256(value)
            if digest is not None:
                files[name] = digest
            elif isinstance(value, Entry) and value.kind == "symlink":
                links[name] = value.target
            elif isinstance(value, Entry) and value.kind == "dir":
                dirs.add(name)
            if name.startswith("tree/"):
                parent = name
                while "/" in parent:
                    parent = parent.rpartition("/")[0]
                    dirs.add(parent)
        for name, value in spec.items():
            if isinstance(value, Entry) and value.kind == "hardlink":
                files[name] = files[value.target]
    return files, links, {d for d in dirs if d == "tree" or d.startswith("tree/")}


def _parse(log: str) -> tuple[dict[str, str], dict[str, str], set[str], list[str]]:
    """The pod's (hashes, symlinks, directories, other lines), paths without the ``/``."""
    hashes: dict[str, str] = {}
    links: dict[str, str] = {}
    dirs: set[str] = set()
    other: list[str] = []
    for line in log.splitlines():
        if line.startswith("L /"):
            path, _, target = line[3:].partition(" ")
            links[path] = target
        elif line.startswith("D /"):
            dirs.add(line[3:])
        elif len(line) > 66 and line[64:67] == "  /":
            hashes[line[67:]] = line[:64]
        else:
            other.append(line)
    return hashes, links, dirs, other


def _mountinfo() -> dict[str, tuple[str, set[str], str]]:
    """(filesystem type, mount options, super options) by mount point (/proc/self/mountinfo)."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        fstype, _, rest = tail.partition(" ")
        parts = fields.split(" ")
        out[parts[4].replace("\\040", " ")] = (fstype, set(parts[5].split(",")),
                                                rest.partition(" ")[2])
    return out


def _optimize(registry: Registry, tmp_path: Path) -> tuple[str, OptimizedImage]:
    """The image built as an ordinary gzip image, then converted and pushed as
    ``gpucloud image optimize`` does."""
    busybox_image(extra_files=TREE).push(registry.host, "e2e/lazy-tree:plain")
    reference = f"{registry.host}/e2e/lazy-tree:estargz"
    with RegistryClient() as client:
        result = optimize(f"{registry.host}/e2e/lazy-tree:plain", reference,
                          OptimizeOptions(level=1, chunk_size=CHUNK), client, tmp_path / "opt")
    tree_toc = result.layers[1].toc
    assert len(tree_toc.chunks_of("tree/a/big.bin")) == 6  # really chunked
    assert len(tree_toc.chunks_of("tree/a/b/exact.bin")) == 2
    assert len(tree_toc.chunks_of("tree/over-one-chunk.bin")) == 2
    assert tree_toc.chunks_of("tree/empty") == []
    assert len(result.layers[0].toc.chunks_of("bin/busybox")) > 1
    return reference, result


def test_a_pod_on_a_cold_node_reads_every_file_of_a_lazily_mounted_estargz_image(
    cloud: Cloud, registry: Registry, tmp_path: Path
) -> None:
    reference, optimized = _optimize(registry, tmp_path)
    lazy_layers = {layer.digest for layer in optimized.layers}
    want_files, want_links, want_dirs = _expected([busybox_files(), TREE])
    agent = cloud.agent("cold")
    blobs = BlobStore(agent.state_dir / "images")
    assert not any(blobs.has(digest) for digest in lazy_layers)  # the node never saw it

    cloud.create_pod("reader", reference, ["sh", "-c", PROBE])
    log = cloud.wait_log("reader", DONE, timeout=120)
    pod = cloud.client.get_pod("reader")
    assert (pod.phase, pod.node) == ("Running", "cold"), (pod.reason, pod.message)

    # Lazily mounted, not pulled: one FUSE mount per layer under the agent's lazyfs
    # daemon, held by this pod's bundle and used as its overlay's lower dirs, and no
    # layer blob in the node's store.
    lazyfs = LazyfsClient(agent.state_dir)
    assert lazyfs.running()
    status = lazyfs.status()["layers"]
    assert set(status) == lazy_layers
    mounts = _mountinfo()
    points = {digest: str(lazyfs_root(agent.state_dir) / "mnt" / digest_hex(digest))
              for digest in lazy_layers}
    for digest, point in points.items():
        assert status[digest]["path"] == point
        fstype, flags, _ = mounts[point]
        assert fstype == "fuse.estargz" and "ro" in flags, mounts[point]
    holders = {holder for layer in status.values() for holder in layer["holders"]}
    assert len(holders) == 1
    rootfs = f"{holders.pop()}/rootfs"
    fstype, _, options = mounts[rootfs]
    lower = next(o for o in options.split(",") if o.startswith("lowerdir="))
    lowers = {os.path.realpath(d) for d in lower.removeprefix("lowerdir=").split(":")}
    assert fstype == "overlay" and lowers == set(points.values()), (lower, lowers)
    assert not any(blobs.has(digest) for digest in lazy_layers)
    assert not list((agent.state_dir / "images" / "layers").glob("*/*"))  # none unpacked
    events = cloud.client.pod_events("reader")
    assert not [e for e in events if e.reason.startswith("Lazy")], events

    # Every file of the image, read inside the pod through the mounts, hashes as the
    # original; nothing of the eStargz format shows, and nothing else appears in the tree.
    hashes, links, dirs, other = _parse(log)
    assert {name: hashes.get(name) for name in want_files} == want_files
    assert not [n for n in hashes if n.startswith("tree/") and n not in want_files]
    assert not [n for n in hashes if n.rpartition("/")[2] in
                ("stargz.index.json", PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK)]
    assert links == {name: target for name, target in want_links.items()
                     if name.startswith("tree/")}
    assert dirs == want_dirs
    assert other == ["script-ran-from-lazy-layer", DONE]

    cloud.client.stop_pod("reader")
    assert cloud.wait_pod("reader", "Stopped", timeout=60).exit_code == 0

    def released() -> bool:
        mounted = _mountinfo()
        return lazyfs.status()["layers"] == {} and not any(p in mounted
                                                           for p in points.values())

    wait_for(released, 60, "the pod's lazy mounts to be released and unmounted")
    assert not any(blobs.has(digest) for digest in lazy_layers)  # never pulled whole
