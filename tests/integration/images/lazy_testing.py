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
from collections.abc import Callable, Iterator
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


@dataclasses.dataclass
class ControlledProxy:
    """A loopback proxy to a registry whose blob requests a test can steer, for the lazy
    tests: ``hold`` (blob digests whose requests wait until ``gate`` is set; ``arrived`` is
    set when one is waiting), ``ignore_range`` (decides per request whether the ``Range``
    header is dropped, so the registry answers ``200`` with the whole blob), and a log
    of every blob request (method, digest, the Range asked for, the status answered)."""

    upstream: str
    hold: set[str] = dataclasses.field(default_factory=set)
    gate: threading.Event = dataclasses.field(default_factory=threading.Event)
    arrived: threading.Event = dataclasses.field(default_factory=threading.Event)
    ignore_range: Callable[[str, int], bool] | None = None
    """Called with (digest, how many ranged GETs of it came before); True: drop Range."""
    log: list[tuple[str, str, str, int]] = dataclasses.field(default_factory=list)
    port: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _http: httpx.Client = dataclasses.field(default_factory=lambda: httpx.Client(timeout=60))

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ranged_gets(self, digest: str) -> list[tuple[str, int]]:
        """(Range asked for, status answered) of the GETs of ``digest`` that had a Range."""
        with self._lock:
            return [(r, s) for m, d, r, s in self.log if m == "GET" and d == digest and r]

    @classmethod
    @contextmanager
    def running(cls, upstream: str) -> Iterator[ControlledProxy]:
        proxy = cls(upstream)
        handler = type("Handler", (_ControlledHandler,), {"proxy": proxy})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        proxy.port = int(server.server_address[1])
        try:
            yield proxy
        finally:
            proxy.gate.set()  # nothing stays held past the test
            server.shutdown()
            server.server_close()
            proxy._http.close()


class _ControlledHandler(http.server.BaseHTTPRequestHandler):
    proxy: ControlledProxy
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._forward("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._forward("HEAD")

    def _forward(self, method: str) -> None:
        proxy = self.proxy
        last = self.path.rsplit("/", 1)[-1]
        digest = last if "/blobs/" in self.path else ""
        asked = self.headers.get("Range", "")
        if digest in proxy.hold:
            proxy.arrived.set()
            proxy.gate.wait(60)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "connection")}
        if digest and asked and method == "GET" and proxy.ignore_range is not None:
            before = len(proxy.ranged_gets(digest))
            if proxy.ignore_range(digest, before):
                headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        with proxy._http.stream(method, f"http://{proxy.upstream}{self.path}",
                                headers=headers) as response:
            with proxy._lock:
                proxy.log.append((method, digest, asked, response.status_code))
            self.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in ("transfer-encoding", "connection", "date"):
                    self.send_header(key, value)
            if "content-length" not in response.headers:
                body = response.read()
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body if method == "GET" else b"")
                return
            self.end_headers()
            if method == "GET":
                try:
                    for part in response.iter_raw():
                        self.wfile.write(part)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client had what it wanted (a 200 cut short)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass
