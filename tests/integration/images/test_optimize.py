"""``gpucloud image optimize`` against the real registry: convert, push, read back lazily
(HTTP Range requests), full-pull equivalence, and ``--record`` with a real runc container."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.images import testing as t
from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.estargz import read_file, read_toc
from gpucloud.images.lazy.optimize import OptimizeOptions, optimize
from gpucloud.images.lazy.toc import (
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    TOC_DIGEST_ANNOTATION,
    UNCOMPRESSED_SIZE_ANNOTATION,
    Toc,
)
from gpucloud.images.manifest import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST
from tests.fixtures.registry import Registry

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runc and overlay need root")
APP_FILES: dict[str, bytes | str | t.Entry] = {
    "app": t.directory(),
    "app/lib": t.directory(),
    # READY, then the container keeps running: what it opens 3 s later is past the line
    "app/start.sh": t.file("#!/bin/sh\ncat /app/config.txt /app/lib/mod.py; echo READY\n"
                           "sleep 3; cat /app/late.txt; exec sleep 60\n", 0o755),
    "app/config.txt": "setting=1\n",
    "app/late.txt": "opened after the line\n",
    "app/lib/mod.py": "print('hi')\n",
    "app/weights.bin": t.file(os.urandom(5 << 20)),
    "app/lib/unused.py": "never read\n",
    "app/alias": t.hardlink("app/config.txt"),
    "bin/old": t.whiteout(),
}


def _repo() -> str:
    return f"optimize/{uuid.uuid4().hex[:10]}"


def _get(registry: Registry, repo: str, kind: str, ref: str, **headers: str) -> httpx.Response:
    accept = {"Accept": OCI_MANIFEST} if kind == "manifests" else {}
    response = httpx.get(f"{registry.url}/v2/{repo}/{kind}/{ref}", headers={**accept, **headers})
    response.raise_for_status()
    return response


def _range_fetcher(registry: Registry, repo: str, digest: str, log: list[int]) -> Any:
    def fetch(start: int, end: int) -> bytes:
        resp = _get(registry, repo, "blobs", digest, Range=f"bytes={start}-{end - 1}")
        assert resp.status_code == 206
        log.append(end - start)
        return resp.content

    return fetch


def _original_files(image: t.BuiltImage) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for layer in image.layers:
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer.data))) as tar:
            for m in tar.getmembers():
                if m.isreg():
                    out[m.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return out


def _pushed(registry: Registry, repo: str) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = _get(registry, repo, "manifests", "esgz").json()
    config = _get(registry, repo, "blobs", manifest["config"]["digest"]).json()
    return manifest, config


def test_optimize_pushes_an_estargz_image_readable_by_range(
    registry: Registry, tmp_path: Path
) -> None:
    repo = _repo()
    image = t.busybox_image(cmd=["sh"], extra_files=APP_FILES, docker=True)
    image.push(registry.host, f"{repo}:orig")
    with RegistryClient() as client:
        optimize(f"{registry.host}/{repo}:orig", f"{registry.host}/{repo}:esgz",
                 OptimizeOptions(level=1), client, tmp_path / "work")
    manifest, config = _pushed(registry, repo)
    assert manifest["mediaType"] == OCI_MANIFEST and manifest["config"]["mediaType"] == OCI_CONFIG
    originals = _original_files(image)
    read: dict[str, bytes] = {}
    for desc, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        assert desc["mediaType"] == OCI_LAYER_GZIP
        blob = _get(registry, repo, "blobs", desc["digest"]).content
        raw = gzip.decompress(blob)  # still an ordinary tar.gz
        assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
        assert desc["annotations"][UNCOMPRESSED_SIZE_ANNOTATION] == str(len(raw))
        sizes: list[int] = []
        toc = read_toc(_range_fetcher(registry, repo, desc["digest"], sizes), desc["size"],
                       desc["annotations"][TOC_DIGEST_ANNOTATION])
        assert toc.entry(NO_PREFETCH_LANDMARK) is not None
        read.update(_read_all(toc, _range_fetcher(registry, repo, desc["digest"], sizes)))
        assert len(sizes) >= 2
    assert {k: hashlib.sha256(v).hexdigest() for k, v in read.items()} == {
        k: hashlib.sha256(v).hexdigest() for k, v in originals.items()}


def _read_all(toc: Toc, fetch: Any) -> dict[str, bytes]:
    return {e.name: b"".join(read_file(fetch, toc, e.name))
            for e in toc.files() if e.type == "reg" and e.path not in
            (NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK)}


@needs_root
def test_record_prioritizes_what_the_container_opens(registry: Registry, tmp_path: Path) -> None:
    """The recording stops when ``--wait-on-line`` matches, long before ``--period``, while
    the container goes on running: the output says so, and what it opens after the line
    (``late.txt``, 3 s later) is neither recorded nor prioritized. (Were the line ignored,
    the recording would last the full 60 s period and hold ``late.txt``.)"""
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    repo = _repo()
    t.busybox_image(cmd=["sh"], extra_files=APP_FILES).push(registry.host, f"{repo}:orig")
    record_out = tmp_path / "recorded.txt"
    started = time.monotonic()
    result = CliRunner().invoke(app, [
        "image", "optimize", f"{registry.host}/{repo}:orig", f"{registry.host}/{repo}:esgz",
        "--record", "--period", "60s", "--wait-on-line", "^READY$", "--level", "1",
        "--record-out", str(record_out), "-o", "json", "--", "/app/start.sh"])
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["stopped_by"] == "line"
    assert elapsed < 40, f"optimize took {elapsed:.1f} s: the recording ran on past the line"
    recorded = record_out.read_text().splitlines()
    assert recorded == out["recorded"]
    assert {"/bin/busybox", "/app/start.sh", "/app/config.txt", "/app/lib/mod.py"} <= set(
        recorded)
    assert "/app/late.txt" not in recorded
    assert "/app/lib/unused.py" not in recorded and "/app/weights.bin" not in recorded
    assert recorded.index("/app/config.txt") < recorded.index("/app/lib/mod.py")
    manifest, _ = _pushed(registry, repo)
    app_layer = manifest["layers"][1]
    toc = read_toc(_range_fetcher(registry, repo, app_layer["digest"], []), app_layer["size"],
                   app_layer["annotations"][TOC_DIGEST_ANNOTATION])
    names = [e.name for e in toc.files()]
    first = names[:names.index(PREFETCH_LANDMARK)]
    # parents before children, files in access order; the rest after the landmark
    assert first.index("app/") < first.index("app/start.sh")
    assert first.index("app/config.txt") < first.index("app/lib/") < first.index(
        "app/lib/mod.py")
    assert "app/weights.bin" not in first and "app/lib/unused.py" not in first
    assert "app/late.txt" not in first and "app/late.txt" in names
    assert toc.prefetch_end() < (5 << 20)  # the prefetch range skips the weights
    assert out["layers"][1]["prioritized"] >= 3


def test_bad_input_is_one_line(registry: Registry, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["image", "optimize", str(tmp_path), f"{registry.host}/x:y"])
    assert res.exit_code == 1 and "not an OCI image layout" in res.output
    res = runner.invoke(app, ["image", "optimize", "a", "b", "--level", "12"])
    assert res.exit_code == 1 and "level" in res.output
    res = runner.invoke(app, ["image", "optimize", "a", "b", "--record", "--period", "x"])
    assert res.exit_code == 1 and "period" in res.output
