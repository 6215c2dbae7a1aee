"""Helpers for the lazy-pull tests: eStargz images pushed to the real test registry, and a
loopback proxy that strips Range support (as some registries' storage does)."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import io
import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from gpucloud.images.lazy.estargz import convert_layer
from gpucloud.images.lazy.toc import TOC_DIGEST_ANNOTATION, UNCOMPRESSED_SIZE_ANNOTATION
from gpucloud.images.testing import BuiltImage, Entry, Layer, build_image, layer_tar

ESTARGZ_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclasses.dataclass(frozen=True)
class LazyImage:
    """A pushed eStargz image and what its layers hold."""

    image: BuiltImage
    toc_digests: tuple[str, ...]


def estargz_layer(files: dict[str, bytes | str | object], tmp: Path,
                  prioritized: tuple[str, ...] = (), chunk_size: int = 64 << 10
                  ) -> tuple[Layer, str, int]:
    """(layer, toc digest, uncompressed size) of ``files`` converted to eStargz."""
    tar_path = tmp / f"layer-{os.urandom(4).hex()}.tar"
    tar_path.write_bytes(layer_tar(files))  # type: ignore[arg-type]
    out = io.BytesIO()
    converted = convert_layer(tar_path, out, prioritized=prioritized, chunk_size=chunk_size,
                              level=1, workers=2)
    layer = Layer(out.getvalue(), ESTARGZ_MEDIA_TYPE, converted.diff_id)
    return layer, converted.toc_digest, converted.uncompressed_size


def estargz_image(layers: list[dict[str, bytes | str | object]], tmp: Path,
                  cmd: list[str] | None = None) -> LazyImage:
    """An image whose layers are eStargz, annotated as converters annotate them."""
    built = [estargz_layer(files, tmp) for files in layers]
    image = build_image([layer for layer, _, _ in built], cmd=cmd)
    manifest = json.loads(image.manifest)
    for descriptor, (_, toc_digest, size) in zip(manifest["layers"], built, strict=True):
        descriptor["annotations"] = {TOC_DIGEST_ANNOTATION: toc_digest,
                                     UNCOMPRESSED_SIZE_ANNOTATION: str(size)}
    data = json.dumps(manifest, indent=2).encode()
    return LazyImage(dataclasses.replace(image, manifest=data),
                     tuple(toc for _, toc, _ in built))


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (symlinks by target), by relative path."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def expected_hashes(files: dict[str, bytes | str | object]) -> dict[str, str]:
    """sha256 of the regular files of a layer spec (bytes, str or ``file(...)``)."""
    out = {}
    for name, value in files.items():
        if isinstance(value, Entry) and value.kind == "file":
            value = value.data
        if isinstance(value, str):
            value = value.encode()
        if isinstance(value, bytes):
            out[name] = hashlib.sha256(value).hexdigest()
    return out


class _RangelessHandler(http.server.BaseHTTPRequestHandler):
    """Forwards to the registry without the ``Range`` header: every blob GET is a 200."""

    upstream = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._forward("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._forward("HEAD")

    def _forward(self, method: str) -> None:
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("range", "host", "connection")}
        with httpx.Client() as client, client.stream(
                method, f"http://{self.upstream}{self.path}", headers=headers) as response:
            body = response.read()
            self.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in ("transfer-encoding", "connection", "content-length",
                                       "accept-ranges", "content-encoding"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method == "GET":
                self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@contextmanager
def rangeless_proxy(upstream: str) -> Iterator[str]:
    """A loopback HTTP proxy to ``upstream`` that ignores Range; yields ``127.0.0.1:PORT``."""
    handler = type("Handler", (_RangelessHandler,), {"upstream": upstream})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert isinstance(host, str)
        yield f"{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
