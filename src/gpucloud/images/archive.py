"""Importing images from files: an OCI image layout (directory or tar) or ``docker save``.

* OCI layout (``oci-layout`` + ``index.json`` + ``blobs/``): every blob is copied into the
  store and verified against its digest; an index is resolved for this host's platform.
  Names come from the ``io.containerd.image.name`` annotation (a full reference, written
  by Docker 25+, BuildKit and ``gpucloud.images.testing``) or ``org.opencontainers.image.
  ref.name`` (a full reference, or a bare tag when a name is given to the import).
* ``docker save`` (``manifest.json`` listing ``Config``, ``RepoTags`` and ``Layers``): the
  layer tarballs are stored as they are (their compression detected) and an OCI manifest
  is written for them; ``RepoTags`` give the names.

Member names from the archive are never trusted as paths: ``..`` and absolute names are
refused, so an archive cannot make the import read files outside itself.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from gpucloud.core.errors import InvalidInput
from gpucloud.images.client import sha256_digest
from gpucloud.images.errors import InvalidImage, UnsafeLayer
from gpucloud.images.manifest import (
    INDEX_TYPES,
    OCI_CONFIG,
    OCI_LAYER,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    Descriptor,
    Index,
    Manifest,
    Platform,
    parse_config,
    parse_manifest_or_index,
    select_platform,
)
from gpucloud.images.pull import Image
from gpucloud.images.reference import ImageReference, parse_reference
from gpucloud.images.store import BlobStore, ImageIndex, digest_hex

CONTAINERD_NAME = "io.containerd.image.name"
OCI_REF_NAME = "org.opencontainers.image.ref.name"


class _Archive(Protocol):
    def exists(self, name: str) -> bool: ...

    def open(self, name: str) -> AbstractContextManager[IO[bytes]]: ...


def _safe_name(name: str) -> str:
    clean = posixpath.normpath(name)
    if clean.startswith(("/", "../")) or clean == "..":
        raise UnsafeLayer(f"archive member {name!r} points outside the archive")
    return clean


class _DirArchive:
    def __init__(self, root: Path) -> None:
        self._root = root.resolve()

    def exists(self, name: str) -> bool:
        return (self._root / _safe_name(name)).is_file()

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        path = (self._root / _safe_name(name)).resolve()
        if not path.is_relative_to(self._root):
            raise UnsafeLayer(f"archive member {name!r} points outside the archive")
        try:
            with path.open("rb") as stream:
                yield stream
        except FileNotFoundError as exc:
            raise InvalidImage(f"archive has no {name!r}") from exc


class _TarArchive:
    def __init__(self, tar: tarfile.TarFile) -> None:
        self._tar = tar
        self._members = {posixpath.normpath(m.name): m for m in tar.getmembers()}

    def exists(self, name: str) -> bool:
        return _safe_name(name) in self._members

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        member = self._members.get(_safe_name(name))
        stream = self._tar.extractfile(member) if member is not None else None
        if stream is None:
            raise InvalidImage(f"archive has no file {name!r}")
        with stream:
            yield stream


@dataclass(frozen=True)
class _Found:
    """One image found in an archive: its manifest digest and the names it carries."""

    manifest_digest: str
    names: tuple[str, ...]


class ArchiveImporter:
    """Imports archives into a store and its index."""

    def __init__(self, blobs: BlobStore, index: ImageIndex, platform: Platform) -> None:
        self._blobs = blobs
        self._index = index
        self._platform = platform

    def import_path(self, path: Path, name: str | None = None) -> list[Image]:
        """Import every image in the archive at ``path``; ``name`` names a nameless one."""
        if path.is_dir():
            return self._import(_DirArchive(path), str(path), name)
        try:
            with tarfile.open(path, "r:*") as tar:
                return self._import(_TarArchive(tar), str(path), name)
        except (tarfile.TarError, OSError) as exc:
            raise InvalidImage(f"{path} is not an image archive: {exc}") from exc

    def _import(self, archive: _Archive, label: str, name: str | None) -> list[Image]:
        if archive.exists("oci-layout") and archive.exists("index.json"):
            found = self._import_oci(archive, label)
        elif archive.exists("manifest.json"):
            found = self._import_docker(archive, label)
        else:
            raise InvalidImage(f"{label} is neither an OCI image layout nor a docker save archive")
        if name is not None and len(found) > 1:
            raise InvalidImage(f"{label} holds {len(found)} images; one name cannot fit them all")
        return [self._record(item, ref) for item in found for ref in _names(item, name, label)]

    def _record(self, found: _Found, reference: ImageReference) -> Image:
        manifest = parse_manifest_or_index(self._blobs.read(found.manifest_digest))
        if not isinstance(manifest, Manifest):
            raise InvalidImage(f"{found.manifest_digest} is not an image manifest")
        config = parse_config(self._blobs.read(manifest.config.digest))
        size = sum(layer.size for layer in manifest.layers)
        self._index.put(str(reference), found.manifest_digest, manifest.config.digest, size)
        return Image(
            str(reference), found.manifest_digest, manifest, manifest.config.digest, config
        )

    # -- OCI image layout ---------------------------------------------------------------

    def _import_oci(self, archive: _Archive, label: str) -> list[_Found]:
        with archive.open("index.json") as stream:
            index = parse_manifest_or_index(stream.read(), None)
        if not isinstance(index, Index):
            raise InvalidImage(f"{label}: index.json is not an image index")
        return [self._import_oci_entry(archive, entry, label) for entry in index.manifests]

    def _import_oci_entry(self, archive: _Archive, entry: Descriptor, label: str) -> _Found:
        names = tuple(
            v for k, v in entry.annotations.items() if k in (CONTAINERD_NAME, OCI_REF_NAME)
        )
        descriptor = entry
        if entry.media_type in INDEX_TYPES:
            nested = parse_manifest_or_index(self._copy_blob(archive, entry))
            if not isinstance(nested, Index):
                raise InvalidImage(f"{label}: {entry.digest} is not an index")
            descriptor = select_platform(nested, label, self._platform)
        manifest = parse_manifest_or_index(self._copy_blob(archive, descriptor))
        if not isinstance(manifest, Manifest):
            raise InvalidImage(f"{label}: {descriptor.digest} is not an image manifest")
        for blob in (manifest.config, *manifest.layers):
            self._copy_blob(archive, blob)
        return _Found(descriptor.digest, names)

    def _copy_blob(self, archive: _Archive, descriptor: Descriptor) -> bytes:
        """Copy one blob into the store (verified); return it when it is small metadata."""
        if not self._blobs.has(descriptor.digest):
            with archive.open(f"blobs/sha256/{digest_hex(descriptor.digest)}") as stream:
                self._blobs.copy_in(descriptor.digest, stream)
        if descriptor.media_type in INDEX_TYPES or "manifest" in descriptor.media_type:
            return self._blobs.read(descriptor.digest)
        return b""

    # -- docker save --------------------------------------------------------------------

    def _import_docker(self, archive: _Archive, label: str) -> list[_Found]:
        with archive.open("manifest.json") as stream:
            entries = json.loads(stream.read())
        if not isinstance(entries, list):
            raise InvalidImage(f"{label}: manifest.json is not a list")
        return [self._import_docker_entry(archive, entry, label) for entry in entries]

    def _import_docker_entry(self, archive: _Archive, entry: Any, label: str) -> _Found:
        if not isinstance(entry, dict) or not isinstance(entry.get("Layers"), list):
            raise InvalidImage(f"{label}: malformed manifest.json entry")
        config = self._add_member(archive, str(entry.get("Config")), OCI_CONFIG)
        layers = [self._add_member(archive, str(n), OCI_LAYER) for n in entry["Layers"]]
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config.to_json(),
            "layers": [layer.to_json() for layer in layers],
        }
        data = json.dumps(manifest, separators=(",", ":")).encode()
        digest = sha256_digest(data)
        self._blobs.put_bytes(digest, data)
        return _Found(digest, tuple(str(tag) for tag in entry.get("RepoTags") or ()))

    def _add_member(self, archive: _Archive, name: str, media_type: str) -> Descriptor:
        with archive.open(name) as stream:
            digest, size = self._blobs.add_stream(stream)
        if media_type == OCI_LAYER:
            media_type = _layer_type(self._blobs.path(digest))
        return Descriptor(media_type, digest, size)


def _layer_type(path: Path) -> str:
    with path.open("rb") as stream:
        magic = stream.read(4)
    if magic.startswith(b"\x1f\x8b"):
        return OCI_LAYER_GZIP
    if magic == b"\x28\xb5\x2f\xfd":
        return OCI_LAYER_ZSTD
    return OCI_LAYER


def _names(found: _Found, name: str | None, label: str) -> list[ImageReference]:
    """The references to index an image under: its own full names, plus ``name`` if given.

    A bare tag (an OCI ``ref.name`` such as ``latest``) only means something together with
    a given name, whose repository it then tags.
    """
    given = parse_reference(name) if name is not None else None
    refs: list[ImageReference] = []
    for text in found.names:
        if "/" in text or ":" in text:
            refs.append(_parse_name(text, label))
        elif given is not None:
            refs.append(ImageReference(given.registry, given.repository, text, None))
    if given is not None:
        refs.append(given)
    if not refs:
        raise InvalidImage(f"{label} does not name its image; give it a name to import it under")
    return list(dict.fromkeys(refs))


def _parse_name(text: str, label: str) -> ImageReference:
    try:
        return parse_reference(text)
    except InvalidInput as exc:
        raise InvalidImage(f"{label} names its image {text!r}, which is not valid") from exc
