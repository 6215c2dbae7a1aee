"""Interoperability with containerd's own eStargz tools (Debian ``stargz-snapshotter``'s
``ctr-remote`` 0.12 with ``containerd`` 1.6), both directions, compared by TOC, digests and
file trees (not bytes: the compressors differ).

* theirs → ours: ``ctr-remote image convert --estargz --oci``; we verify the TOC against its
  annotation, read every file by chunks, and our TOC of the same layer has the same entries.
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
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpucloud.images import testing as t
from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.estargz import convert_layer, read_file, read_toc_file
from gpucloud.images.lazy.optimize import OptimizeOptions, optimize
from gpucloud.images.lazy.toc import HIDDEN_ROOT_NAMES, TOC_DIGEST_ANNOTATION, Toc

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
    image.write_oci_layout(tmp_path / "src.tar", NAME, as_tar=True)
    _run(str(CTR), *ctr, "images", "import", str(tmp_path / "src.tar"))
    _run(str(CTR_REMOTE), *ctr, "images", "convert", "--estargz", "--oci", NAME, NAME + "-esgz")
    _run(str(CTR), *ctr, "images", "export", str(tmp_path / "theirs.tar"), NAME + "-esgz")
    with tarfile.open(tmp_path / "theirs.tar") as tar:
        tar.extractall(tmp_path / "theirs", filter="data")
    manifest, blobs = _layout(tmp_path / "theirs")
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
