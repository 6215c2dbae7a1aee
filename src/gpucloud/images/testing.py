"""Building images with no network, for tests, benchmarks and ``make up``.

Files (a dict, or a directory tree) become deterministic layer tarballs; layers and a
config become an image; an image is written as an OCI layout (directory or tar), as a
``docker save`` tarball, or pushed to a registry through the distribution API (monolithic
or chunked uploads). ``busybox_image`` makes a small working image from the host's static
``/bin/busybox`` (Debian's ``busybox-static``)::

    image = busybox_image(cmd=["echo", "hello"], env={"A": "1"})
    image.push("127.0.0.1:5000", "demo/hello:latest")
    image.write_oci_layout(tmp_path / "hello.tar", "gpucloud/demo:latest", as_tar=True)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zstandard

from gpucloud.images.archive import CONTAINERD_NAME, OCI_REF_NAME
from gpucloud.images.auth import Credentials
from gpucloud.images.client import RegistryClient
from gpucloud.images.manifest import (
    DOCKER_CONFIG,
    DOCKER_LAYER_GZIP,
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    host_platform,
)
from gpucloud.images.reference import parse_reference

Compression = Literal["gzip", "zstd", "none"]
BUSYBOX = Path("/bin/busybox")
_EPOCH = 1_700_000_000


@dataclass(frozen=True)
class Entry:
    """One layer entry; build them with the helpers below (``file``, ``symlink`` …)."""

    kind: Literal["file", "dir", "symlink", "hardlink", "whiteout", "opaque", "fifo"]
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


def file(data: bytes | str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    """A regular file."""
    raw = data.encode() if isinstance(data, str) else data
    return Entry("file", raw, mode=mode, uid=uid, gid=gid)


def directory(mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    """A directory."""
    return Entry("dir", mode=mode, uid=uid, gid=gid)


def symlink(target: str) -> Entry:
    """A symbolic link to ``target`` (not checked here: tests use bad ones on purpose)."""
    return Entry("symlink", target=target, mode=0o777)


def hardlink(target: str) -> Entry:
    """A hard link to the entry named ``target`` (earlier in the same layer)."""
    return Entry("hardlink", target=target)


def whiteout() -> Entry:
    """Deletes the path from lower layers (written as ``.wh.NAME``)."""
    return Entry("whiteout")


def opaque() -> Entry:
    """Hides everything lower layers put in this directory (``DIR/.wh..wh..opq``)."""
    return Entry("opaque")


def fifo() -> Entry:
    """A named pipe."""
    return Entry("fifo", mode=0o644)


FileSpec = Mapping[str, "bytes | str | Entry"]


@dataclass(frozen=True)
class Layer:
    """A layer blob with its digests."""

    data: bytes
    media_type: str
    diff_id: str

    @property
    def digest(self) -> str:
        return _sha256(self.data)

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}


def layer_tar(files: FileSpec) -> bytes:
    """An uncompressed, deterministic tar of ``files`` (sorted, hard links last)."""
    entries = sorted((_as_entry(v).kind == "hardlink", k, _as_entry(v)) for k, v in files.items())
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for _, name, entry in entries:
            _add_entry(tar, name, entry)
    return stream.getvalue()


def make_layer(files: FileSpec, compression: Compression = "gzip", docker: bool = False) -> Layer:
    """A layer from a dict of paths to contents or ``Entry`` objects."""
    return compress_layer(layer_tar(files), compression, docker)


def layer_from_dir(root: Path, compression: Compression = "gzip") -> Layer:
    """A layer holding the tree under ``root`` (ownership as on disk)."""
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return compress_layer(stream.getvalue(), compression)


def compress_layer(tar: bytes, compression: Compression, docker: bool = False) -> Layer:
    """Wrap an uncompressed layer tar as a blob of the given compression."""
    diff_id = _sha256(tar)
    if compression == "gzip":
        media_type = DOCKER_LAYER_GZIP if docker else OCI_LAYER_GZIP
        return Layer(gzip.compress(tar, compresslevel=1, mtime=0), media_type, diff_id)
    if compression == "zstd":
        return Layer(zstandard.ZstdCompressor(level=1).compress(tar), OCI_LAYER_ZSTD, diff_id)
    return Layer(tar, OCI_LAYER, diff_id)


@dataclass(frozen=True)
class BuiltImage:
    """An image built in memory: config, manifest and layers, ready to write or push."""

    config: bytes
    manifest: bytes
    layers: tuple[Layer, ...]
    docker: bool = False
    architecture: str = ""

    @property
    def digest(self) -> str:
        """The manifest's digest."""
        return _sha256(self.manifest)

    @property
    def config_digest(self) -> str:
        return _sha256(self.config)

    @property
    def media_type(self) -> str:
        return DOCKER_MANIFEST if self.docker else OCI_MANIFEST

    def blobs(self) -> dict[str, bytes]:
        """Every blob but the manifest, by digest."""
        blobs = {self.config_digest: self.config}
        blobs.update({layer.digest: layer.data for layer in self.layers})
        return blobs

    def descriptor(self) -> dict[str, object]:
        return {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": len(self.manifest),
            "platform": {"os": "linux", "architecture": self.architecture},
        }

    def push(
        self,
        registry: str,
        reference: str,
        *,
        chunk_size: int | None = None,
        credentials: Credentials | None = None,
        client: RegistryClient | None = None,
    ) -> str:
        """Push blobs then the manifest as ``repository:tag``; return the manifest digest."""
        with _open_client(registry, credentials, client) as registry_client:
            repository, tag = _split_repo_tag(reference)
            _push_blobs(registry_client, registry, repository, self.blobs(), chunk_size)
            return registry_client.put_manifest(
                registry, repository, tag, self.manifest, self.media_type
            )

    def write_oci_layout(self, path: Path, name: str | None = None, as_tar: bool = False) -> Path:
        """Write an OCI image layout (a directory, or a tar of one) naming the image."""
        annotations = _name_annotations(name)
        entry = {"mediaType": self.media_type, "digest": self.digest, "size": len(self.manifest)}
        if annotations:
            entry["annotations"] = annotations
        blobs = {**self.blobs(), self.digest: self.manifest}
        return _write_layout(path, [entry], blobs, as_tar)

    def write_docker_archive(self, path: Path, repo_tags: Sequence[str] = ()) -> Path:
        """Write a ``docker save``-style tarball (uncompressed ``layer.tar`` per layer)."""
        files: dict[str, bytes] = {f"{self.config_digest[7:]}.json": self.config}
        layer_names = []
        for layer in self.layers:
            tar = _decompress(layer)
            name = f"{_sha256(tar)[7:]}/layer.tar"
            files[name] = tar
            layer_names.append(name)
        manifest = [
            {
                "Config": f"{self.config_digest[7:]}.json",
                "RepoTags": list(repo_tags),
                "Layers": layer_names,
            }
        ]
        files["manifest.json"] = json.dumps(manifest).encode()
        _write_tar(path, files)
        return path


@dataclass(frozen=True)
class BuiltIndex:
    """A multi-platform image index over several built images."""

    images: tuple[BuiltImage, ...]
    docker: bool = False
    data: bytes = field(default=b"")

    @classmethod
    def of(cls, images: Iterable[BuiltImage], docker: bool = False) -> BuiltIndex:
        items = tuple(images)
        index = {
            "schemaVersion": 2,
            "mediaType": DOCKER_LIST if docker else OCI_INDEX,
            "manifests": [image.descriptor() for image in items],
        }
        return cls(items, docker, json.dumps(index, indent=2).encode())

    @property
    def digest(self) -> str:
        return _sha256(self.data)

    def push(self, registry: str, reference: str, *, chunk_size: int | None = None) -> str:
        """Push every image by digest, then the index under the tag; return its digest."""
        repository, tag = _split_repo_tag(reference)
        with _open_client(registry, None, None) as client:
            for image in self.images:
                _push_blobs(client, registry, repository, image.blobs(), chunk_size)
                client.put_manifest(
                    registry, repository, image.digest, image.manifest, image.media_type
                )
            media_type = DOCKER_LIST if self.docker else OCI_INDEX
            return client.put_manifest(registry, repository, tag, self.data, media_type)


def build_image(
    layers: Sequence[Layer],
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    working_dir: str = "",
    user: str = "",
    architecture: str | None = None,
    docker: bool = False,
    labels: Mapping[str, str] | None = None,
) -> BuiltImage:
    """An image from layers and runtime settings; ``architecture`` defaults to the host's."""
    arch = architecture or host_platform().architecture
    config = {
        "architecture": arch,
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": {
            "Entrypoint": list(entrypoint) if entrypoint is not None else None,
            "Cmd": list(cmd) if cmd is not None else None,
            "Env": [f"{k}={v}" for k, v in (env or _DEFAULT_ENV).items()],
            "WorkingDir": working_dir,
            "User": user,
            "Labels": dict(labels or {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }
    config_bytes = json.dumps(config, indent=2).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
        "config": {
            "mediaType": DOCKER_CONFIG if docker else OCI_CONFIG,
            "digest": _sha256(config_bytes),
            "size": len(config_bytes),
        },
        "layers": [layer.descriptor() for layer in layers],
    }
    return BuiltImage(
        config_bytes, json.dumps(manifest, indent=2).encode(), tuple(layers), docker, arch
    )


_DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def busybox_files() -> dict[str, bytes | str | Entry]:
    """A minimal root filesystem: static busybox, its applet links, and the usual dirs."""
    files: dict[str, bytes | str | Entry] = {
        "bin/busybox": file(BUSYBOX.read_bytes(), 0o755),
        "tmp": directory(0o1777),
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
        "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    }
    for name in ("bin", "dev", "etc", "proc", "sys", "root", "usr/bin", "var", "run"):
        files[name] = directory(0o700 if name == "root" else 0o755)
    for applet in _busybox_applets():
        if applet != "busybox":
            files[f"bin/{applet}"] = symlink("busybox")
    return files


def busybox_image(
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = ("sh",),
    env: Mapping[str, str] | None = None,
    working_dir: str = "",
    extra_files: FileSpec | None = None,
    architecture: str | None = None,
    compression: Compression = "gzip",
    docker: bool = False,
) -> BuiltImage:
    """A small busybox image; ``extra_files`` become a second layer."""
    layers = [make_layer(busybox_files(), compression, docker)]
    if extra_files:
        layers.append(make_layer(extra_files, compression, docker))
    return build_image(
        layers,
        entrypoint=entrypoint,
        cmd=cmd,
        env={**_DEFAULT_ENV, **(env or {})},
        working_dir=working_dir,
        architecture=architecture,
        docker=docker,
    )


def random_image(total_bytes: int, layers: int = 4, seed: int = 0) -> BuiltImage:
    """An image of incompressible data (for pull benchmarks), split over ``layers``."""
    per_layer = total_bytes // layers
    built = []
    for number in range(layers):
        data = _random_bytes(per_layer, seed * 1000 + number)
        built.append(make_layer({f"data/blob{number}.bin": file(data)}, "gzip"))
    return build_image(built, cmd=["/bin/true"])


# -- helpers -----------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _random_bytes(size: int, seed: int) -> bytes:
    """Incompressible, reproducible bytes (not for cryptography: for benchmarks)."""
    return random.Random(seed).randbytes(size)


def _busybox_applets() -> list[str]:
    listing = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True)
    return sorted(line for line in listing.stdout.split() if "/" not in line)


def _as_entry(value: bytes | str | Entry) -> Entry:
    return value if isinstance(value, Entry) else file(value)


def _add_entry(tar: tarfile.TarFile, name: str, entry: Entry) -> None:
    parent, _, base = name.rstrip("/").rpartition("/")
    if entry.kind == "whiteout":
        name = f"{parent}/.wh.{base}" if parent else f".wh.{base}"
        entry = Entry("file")
    elif entry.kind == "opaque":
        name = f"{name.rstrip('/')}/.wh..wh..opq"
        entry = Entry("file")
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid, info.mtime = entry.mode, entry.uid, entry.gid, _EPOCH
    info.type = _TAR_TYPES[entry.kind]
    info.linkname = entry.target
    if entry.kind == "file":
        info.size = len(entry.data)
        tar.addfile(info, io.BytesIO(entry.data))
    else:
        tar.addfile(info)


_TAR_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def _decompress(layer: Layer) -> bytes:
    if layer.media_type in (OCI_LAYER_GZIP, DOCKER_LAYER_GZIP):
        return gzip.decompress(layer.data)
    if layer.media_type == OCI_LAYER_ZSTD:
        return zstandard.ZstdDecompressor().decompressobj().decompress(layer.data)
    return layer.data


def _name_annotations(name: str | None) -> dict[str, str]:
    if name is None:
        return {}
    ref = parse_reference(name)
    return {CONTAINERD_NAME: str(ref), OCI_REF_NAME: ref.tag or "latest"}


def _write_layout(
    path: Path, entries: list[dict[str, object]], blobs: Mapping[str, bytes], as_tar: bool
) -> Path:
    files = {f"blobs/sha256/{digest[7:]}": data for digest, data in blobs.items()}
    files["oci-layout"] = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
    files["index.json"] = json.dumps(index, indent=2).encode()
    if as_tar:
        _write_tar(path, files)
        return path
    for name, data in files.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return path


def _write_tar(path: Path, files: Mapping[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        with tarfile.open(fileobj=tmp, mode="w") as tar:
            for name in sorted(files):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(files[name]), _EPOCH, 0o644
                tar.addfile(info, io.BytesIO(files[name]))
    os.replace(tmp.name, path)


def _split_repo_tag(reference: str) -> tuple[str, str]:
    repository, _, tag = reference.rpartition(":")
    if not repository or "/" in tag:
        return reference, "latest"
    return repository, tag


def _push_blobs(
    client: RegistryClient,
    registry: str,
    repository: str,
    blobs: Mapping[str, bytes],
    chunk_size: int | None,
) -> None:
    for digest, data in blobs.items():
        if not client.blob_exists(registry, repository, digest):
            client.upload_blob(registry, repository, data, digest, chunk_size)


@contextmanager
def _open_client(
    registry: str, credentials: Credentials | None, given: RegistryClient | None
) -> Iterator[RegistryClient]:
    """The given client (left open), or a new one for this push (closed afterwards)."""
    if given is not None:
        yield given
        return
    with RegistryClient(credentials={registry: credentials} if credentials else None) as client:
        yield client
