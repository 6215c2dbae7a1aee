"""Interoperability with containerd's own eStargz tools (Debian ``stargz-snapshotter``'s
``ctr-remote`` 0.12 with ``containerd`` 1.6), both directions, compared by TOC, digests and
file trees (not bytes: the compressors differ).

* theirs → ours: ``ctr-remote image convert --estargz --oci``; we verify the TOC against its
  annotation, read every file by chunks, and our TOC of the same layer has the same entries.
* theirs → ours, lazily: the ``ctr-remote`` image pushed to the real test registry and
  pulled by our image manager with the node's ``lazyfs`` daemon: every layer is mounted
  through FUSE (never downloaded whole), and each mount's tree (file hashes, modes,
  owners, symlink targets, hard links, whiteouts) is the original layer's.
* ours → theirs: ``ctr import`` of ``gpucloud image optimize`` output; ``ctr-remote image
  get-toc-digest`` (which parses footer and TOC with the Go reader) gives our annotation,
  and ``ctr image mount`` (containerd's own unpacker) gives the original files.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import posixpath
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpucloud.images import ImageManager, RootfsMode
from gpucloud.images import testing as t
from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.client import LazyfsClient
from gpucloud.images.lazy.estargz import convert_layer, read_file, read_toc_file
from gpucloud.images.lazy.optimize import OptimizeOptions, optimize
from gpucloud.images.lazy.toc import (
    HIDDEN_ROOT_NAMES,
    TOC_DIGEST_ANNOTATION,
    UNCOMPRESSED_SIZE_ANNOTATION,
    Toc,
)
from tests.fixtures.registry import Registry

CTR_REMOTE, CONTAINERD, CTR = (shutil.which(n) for n in ("ctr-remote", "containerd", "ctr"))
pytestmark = pytest.mark.skipif(
    None in (CTR_REMOTE, CONTAINERD, CTR) or os.geteuid() != 0,
    reason="needs root and Debian's stargz-snapshotter + containerd")
NAME = "docker.io/gpucloud/interop:1"


@pytest.fixture
def ctr() -> Iterator[list[str]]:
    """A private containerd (own root, state and socket); yields the ``--address`` args."""
    base = Path(tempfile.mkdtemp(prefix="ctrd-", dir="/tmp"))
    sock = base / "c.sock"
    (base / "config.toml").write_text(
        f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
        f'[grpc]\n  address = "{sock}"\n'
        '[plugins."io.containerd.grpc.v1.cri"]\n  disable_tcp_service = true\n')
    with (base / "log").open("wb") as log:
        proc = subprocess.Popen([str(CONTAINERD), "--config", str(base / "config.toml")],
                                stdout=log, stderr=log)
    address = ["--address", str(sock)]
    try:
        deadline = time.monotonic() + 20
        while subprocess.run([str(CTR), *address, "version"], capture_output=True).returncode:
            assert proc.poll() is None and time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        subprocess.run(["umount", "-R", "-l", str(base / "root")], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _run(*argv: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _image() -> t.BuiltImage:
    return t.busybox_image(cmd=["sh"], extra_files={
        "app": t.directory(), "app/a.txt": "A\n", "app/big.bin": t.file(os.urandom(9 << 20)),
        "app/link": t.hardlink("app/a.txt"), "app/empty": "", "app/s": t.symlink("a.txt"),
        "app/secret": t.file("s", 0o600, uid=1000, gid=1000), "gone": t.whiteout()})


def _layout(root: Path) -> tuple[dict[str, Any], Path]:
    index = json.loads((root / "index.json").read_text())
    blobs = root / "blobs" / "sha256"
    return json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text()), blobs


def _entries(toc: Toc) -> list[tuple[Any, ...]]:
    return [(e.name, e.type, e.size, e.mode, e.uid, e.gid, e.linkName, e.digest, e.modtime,
             e.chunkOffset, e.chunkSize, e.chunkDigest, e.devMajor, dict(e.xattrs))
            for e in toc.entries]


def _fetch(path: Path) -> Any:
    data = path.read_bytes()
    return lambda start, end: data[start:end]


def test_their_estargz_reads_with_ours(ctr: list[str], tmp_path: Path) -> None:
    image = _image()
    raw_manifest, blobs = _convert_with_ctr_remote(ctr, image, tmp_path)
    manifest = json.loads(raw_manifest)
    for desc, original in zip(manifest["layers"], image.layers, strict=True):
        blob = blobs / desc["digest"][7:]
        toc = read_toc_file(blob, desc["annotations"][TOC_DIGEST_ANNOTATION])
        plain = gzip.decompress(original.data)
        (tmp_path / "l.tar").write_bytes(plain)
        with (tmp_path / "ours.esgz").open("wb") as out:
            ours = convert_layer(tmp_path / "l.tar", out)
        assert _entries(toc) == _entries(ours.toc)
        with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
            for m in (m for m in tar.getmembers() if m.isreg()):
                want = tar.extractfile(m).read()  # type: ignore[union-attr]
                assert b"".join(read_file(_fetch(blob), toc, m.name)) == want, m.name


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel in HIDDEN_ROOT_NAMES:
            continue
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not \
            path.is_symlink() else os.readlink(path) if path.is_symlink() else ""
        out[rel] = (st.st_mode, digest)
    return out


def test_our_estargz_reads_with_theirs(ctr: list[str], tmp_path: Path) -> None:
    image = _image()
    image.write_oci_layout(tmp_path / "src", NAME)
    with RegistryClient() as client:
        optimize(str(tmp_path / "src"), str(tmp_path / "ours"), OptimizeOptions(level=6),
                 client, tmp_path / "work")
    index = json.loads((tmp_path / "ours" / "index.json").read_text())
    index["manifests"][0]["annotations"] = {"io.containerd.image.name": NAME + "-ours"}
    (tmp_path / "ours" / "index.json").write_text(json.dumps(index))
    with tarfile.open(tmp_path / "ours.tar", "w") as tar:
        tar.add(tmp_path / "ours", arcname=".")
    _run(str(CTR), *ctr, "images", "import", str(tmp_path / "ours.tar"))
    manifest, _ = _layout(tmp_path / "ours")
    for desc in manifest["layers"]:
        got = _run(str(CTR_REMOTE), *ctr, "images", "get-toc-digest", desc["digest"]).strip()
        assert got == desc["annotations"][TOC_DIGEST_ANNOTATION]
    (tmp_path / "mnt").mkdir()
    (tmp_path / "orig").mkdir()
    _run(str(CTR), *ctr, "images", "mount", NAME + "-ours", str(tmp_path / "mnt"))
    try:
        image.write_oci_layout(tmp_path / "orig.tar", NAME + "-orig", as_tar=True)
        _run(str(CTR), *ctr, "images", "import", str(tmp_path / "orig.tar"))
        _run(str(CTR), *ctr, "images", "mount", NAME + "-orig", str(tmp_path / "orig"))
        try:
            assert _tree(tmp_path / "mnt") == _tree(tmp_path / "orig")
        finally:
            _run(str(CTR), *ctr, "images", "unmount", str(tmp_path / "orig"))
    finally:
        _run(str(CTR), *ctr, "images", "unmount", str(tmp_path / "mnt"))


# -- theirs → ours, lazily: ctr-remote's layers mounted through lazyfs -------------------

CHUNK = 4 << 20  # ctr-remote's default chunk size


def _convert_with_ctr_remote(ctr: list[str], image: t.BuiltImage, tmp: Path
                             ) -> tuple[bytes, Path]:
    """``ctr-remote``'s eStargz conversion of ``image``: (manifest bytes, blob directory)."""
    image.write_oci_layout(tmp / "src.tar", NAME, as_tar=True)
    _run(str(CTR), *ctr, "images", "import", str(tmp / "src.tar"))
    _run(str(CTR_REMOTE), *ctr, "images", "convert", "--estargz", "--oci", NAME, NAME + "-esgz")
    _run(str(CTR), *ctr, "images", "export", str(tmp / "theirs.tar"), NAME + "-esgz")
    with tarfile.open(tmp / "theirs.tar") as tar:
        tar.extractall(tmp / "theirs", filter="data")
    index = json.loads((tmp / "theirs" / "index.json").read_text())
    blobs = tmp / "theirs" / "blobs" / "sha256"
    return (blobs / index["manifests"][0]["digest"][7:]).read_bytes(), blobs


def _as_pushable(manifest: bytes, blobs: Path) -> t.BuiltImage:
    """Their image, byte for byte (manifest and blobs as exported), ready to push."""
    doc = json.loads(manifest)
    config = (blobs / doc["config"]["digest"][7:]).read_bytes()
    diff_ids = json.loads(config)["rootfs"]["diff_ids"]
    layers = tuple(t.Layer((blobs / d["digest"][7:]).read_bytes(), d["mediaType"], diff_id)
                   for d, diff_id in zip(doc["layers"], diff_ids, strict=True))
    return t.BuiltImage(config, manifest, layers)


Shape = tuple[int, int, int, str]
"""(st_mode, uid, gid, what): a file's sha256, a symlink's target, a device's rdev."""


def _layer_tree(layer_tar: bytes) -> tuple[dict[str, Shape], dict[str, str]]:
    """What a lower-layer view of ``layer_tar`` must show, by path: whiteouts as the
    character device 0:0 of their name (overlayfs form); symlinks' and whiteouts' permission
    bits are masked (nothing uses them); and the hard links, name → target."""
    tree: dict[str, Shape] = {}
    links: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(layer_tar)) as tar:
        members = tar.getmembers()
        data = {m.name: tar.extractfile(m).read() for m in members  # type: ignore[union-attr]
                if m.isreg()}
    by_name = {m.name: m for m in members}
    for m in members:
        name = m.name.strip("/")
        base = posixpath.basename(name)
        if base == ".wh..wh..opq":
            continue  # an xattr of its directory, not an entry
        if base.startswith(".wh."):
            tree[posixpath.join(posixpath.dirname(name), base[4:])] = (stat.S_IFCHR, 0, 0, "0")
        elif m.isreg():
            tree[name] = (stat.S_IFREG | m.mode, m.uid, m.gid,
                          hashlib.sha256(data[m.name]).hexdigest())
        elif m.islnk():
            target = by_name[m.linkname]
            links[name] = m.linkname.strip("/")
            tree[name] = (stat.S_IFREG | target.mode, target.uid, target.gid,
                          hashlib.sha256(data[m.linkname]).hexdigest())
        elif m.issym():
            tree[name] = (stat.S_IFLNK, m.uid, m.gid, m.linkname)
        elif m.isdir():
            tree[name] = (stat.S_IFDIR | m.mode, m.uid, m.gid, "")
        else:
            raise AssertionError(f"unexpected member {m.name} in the test image")
    return tree, links


def _mounted_tree(root: Path) -> dict[str, Shape]:
    """The same shape, read through the mount (every regular file read whole)."""
    out: dict[str, Shape] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = path.lstat()
            special = stat.S_ISLNK(st.st_mode) or stat.S_ISCHR(st.st_mode)
            mode = st.st_mode & ~0o7777 if special else st.st_mode  # bits nobody uses
            if stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            elif stat.S_ISCHR(st.st_mode):
                what = str(st.st_rdev)
            else:
                what = ""
            out[str(path.relative_to(root))] = (mode, st.st_uid, st.st_gid, what)
    return out


def test_their_estargz_runs_lazily_on_ours(ctr: list[str], registry: Registry,
                                           tmp_path: Path) -> None:
    """``ctr-remote``'s conversion (4 MiB chunks, its own TOC), pushed to the real registry
    and pulled by our image manager on a node with ``lazyfs``: each layer is mounted lazily
    (no blob downloaded, no fallback), and every file read through FUSE is the original."""
    image = _image()
    manifest, blobs = _convert_with_ctr_remote(ctr, image, tmp_path)
    theirs = _as_pushable(manifest, blobs)
    descriptors = json.loads(manifest)["layers"]
    assert all(TOC_DIGEST_ANNOTATION in d["annotations"] and UNCOMPRESSED_SIZE_ANNOTATION in
               d["annotations"] for d in descriptors)
    toc = read_toc_file(blobs / descriptors[1]["digest"][7:],
                        descriptors[1]["annotations"][TOC_DIGEST_ANNOTATION])
    assert [c.chunk_size for c in toc.chunks_of("app/big.bin")] == [CHUNK, CHUNK, 1 << 20]
    theirs.push(registry.host, "interop/theirs-lazy:v1")

    client = LazyfsClient(tmp_path / "node", cache_limit=64 << 20, read_deadline=10.0)
    bundle = tmp_path / "bundle"
    with ImageManager(tmp_path / "node", lazy=client, rootfs_mode=RootfsMode.OVERLAY) as images:
        try:
            pulled = images.pull(f"{registry.host}/interop/theirs-lazy:v1")
            rootfs = images.prepare_rootfs(pulled, bundle)
            assert images.lazy_events(bundle) == []  # no LazyPullFallback
            assert not any(images._blobs.has(d.digest) for d in pulled.manifest.layers)
            layers = client.status()["layers"]
            assert sorted(layers) == sorted(d["digest"] for d in descriptors)
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(image.layers[1].data))) as tar:
                big = tar.extractfile("app/big.bin").read()  # type: ignore[union-attr]
            mounted_big = Path(layers[descriptors[1]["digest"]]["path"]) / "app/big.bin"
            with mounted_big.open("rb") as stream:  # across their 4 MiB chunk boundaries
                for offset in (CHUNK - 3, 2 * CHUNK - 1, len(big) - 2, 17):
                    stream.seek(offset)
                    assert stream.read(CHUNK) == big[offset:offset + CHUNK]
            for desc, original in zip(descriptors, image.layers, strict=True):
                mnt = Path(layers[desc["digest"]]["path"])
                want, links = _layer_tree(gzip.decompress(original.data))
                got = _mounted_tree(mnt)
                assert {name: got.get(name) for name in want} == want
                extra = {n: s for n, s in got.items() if n not in want}
                assert all(stat.S_ISDIR(s[0]) for s in extra.values()), extra  # parents only
                assert not any(n in got for n in HIDDEN_ROOT_NAMES)
                for name, target in links.items():
                    assert (mnt / name).stat().st_ino == (mnt / target).stat().st_ino
            assert (rootfs / "app/big.bin").read_bytes() == big  # through the overlay too
            assert (rootfs / "app/s").read_text() == "A\n"
            assert not (rootfs / "gone").exists()
            status = client.status()["layers"]
            assert all(s["errors"] == 0 for s in status.values())
        finally:
            images.release_rootfs(bundle)
            client.shutdown()
