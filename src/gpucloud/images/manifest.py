"""Manifests, indexes and image configs of both the OCI and the Docker v2 schema 2 flavour.

Parsing is strict where a wrong value would do harm (digests, media types, layer lists)
and lenient elsewhere: unknown fields are ignored, as both specs require of readers.
"""

from __future__ import annotations

import json
import platform as _platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpucloud.images.errors import InvalidImage, NoMatchingPlatform
from gpucloud.images.reference import is_digest

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+prettyjws"

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST])

# Layer media types we can unpack, by compression.
LAYER_COMPRESSION: Mapping[str, str] = {
    OCI_LAYER: "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    OCI_LAYER_GZIP: "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    DOCKER_LAYER_GZIP: "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
    OCI_LAYER_ZSTD: "zstd",
}

_ARCH_ALIASES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class Platform:
    """An ``os/architecture[/variant]`` triple as image indexes declare it."""

    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        text = f"{self.os}/{self.architecture}"
        return f"{text}/{self.variant}" if self.variant else text

    def matches(self, other: Platform) -> bool:
        """True when ``other`` (an offered platform) can run here; arm64's v8 is implied."""
        if (self.os, self.architecture) != (other.os, other.architecture):
            return False
        implied = {"", "v8"} if self.architecture == "arm64" else {""}
        return other.variant == self.variant or (
            other.variant in implied and self.variant in implied
        )


def host_platform() -> Platform:
    """The platform of this machine, from ``platform.machine()``."""
    machine = _platform.machine().lower()
    if machine.startswith("armv7"):
        return Platform("linux", "arm", "v7")
    return Platform("linux", _ARCH_ALIASES.get(machine, machine))


@dataclass(frozen=True)
class Descriptor:
    """A pointer to content: media type, digest and size, plus optional platform."""

    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The descriptor as it appears in a manifest."""
        data: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest}
        data["size"] = self.size
        if self.annotations:
            data["annotations"] = dict(self.annotations)
        return data


@dataclass(frozen=True)
class Manifest:
    """An image manifest: one config blob and the ordered layers (base first)."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Index:
    """An OCI image index or Docker manifest list: one manifest per platform."""

    media_type: str
    manifests: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """What the runtime needs from an image config, plus the layers' uncompressed digests."""

    os: str
    architecture: str
    variant: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    diff_ids: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def platform(self) -> Platform:
        """The platform the image was built for."""
        return Platform(self.os, self.architecture, self.variant)


def load_json(data: bytes, what: str) -> dict[str, Any]:
    """Decode a JSON object or raise ``InvalidImage`` naming ``what``."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidImage(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidImage(f"{what} is not a JSON object")
    return value


def detect_media_type(data: Mapping[str, Any], header_type: str | None) -> str:
    """The media type of a manifest: its own field, else the HTTP header, else by shape."""
    declared = data.get("mediaType") or header_type or ""
    if declared.split(";")[0].strip() in INDEX_TYPES | MANIFEST_TYPES:
        return str(declared).split(";")[0].strip()
    if data.get("schemaVersion") == 1 or declared == DOCKER_SCHEMA1:
        raise InvalidImage("Docker schema 1 manifests are not supported; rebuild the image")
    if "manifests" in data:
        return OCI_INDEX
    if "layers" in data and "config" in data:
        return OCI_MANIFEST
    raise InvalidImage(f"unsupported manifest media type {declared!r}")


def parse_manifest_or_index(data: bytes, header_type: str | None = None) -> Manifest | Index:
    """Parse manifest bytes into a ``Manifest`` or an ``Index``."""
    obj = load_json(data, "manifest")
    media_type = detect_media_type(obj, header_type)
    if media_type in INDEX_TYPES:
        entries = _list(obj, "manifests", "index")
        return Index(media_type, tuple(parse_descriptor(e, "index entry") for e in entries))
    config = parse_descriptor(obj.get("config"), "manifest config")
    layers = tuple(parse_descriptor(e, "layer") for e in _list(obj, "layers", "manifest"))
    for layer in layers:
        if layer.media_type not in LAYER_COMPRESSION:
            raise InvalidImage(f"layer {layer.digest} has unsupported type {layer.media_type}")
    return Manifest(media_type, config, layers)


def parse_descriptor(value: object, what: str) -> Descriptor:
    """Parse one descriptor object; the digest must be a sha256 digest."""
    if not isinstance(value, dict):
        raise InvalidImage(f"{what} is not a descriptor object")
    digest, size = value.get("digest"), value.get("size")
    if not isinstance(digest, str) or not is_digest(digest):
        raise InvalidImage(f"{what} has an invalid or unsupported digest {digest!r}")
    if not isinstance(size, int) or size < 0:
        raise InvalidImage(f"{what} {digest} has an invalid size {size!r}")
    plat = value.get("platform")
    return Descriptor(
        media_type=str(value.get("mediaType", "")),
        digest=digest,
        size=size,
        platform=_parse_platform(plat) if isinstance(plat, dict) else None,
        annotations={str(k): str(v) for k, v in (value.get("annotations") or {}).items()},
    )


def parse_config(data: bytes) -> ImageConfig:
    """Parse an image config blob (OCI and Docker configs share this shape)."""
    obj = load_json(data, "image config")
    inner = obj.get("config") or {}
    rootfs = obj.get("rootfs") or {}
    return ImageConfig(
        os=str(obj.get("os", "")),
        architecture=str(obj.get("architecture", "")),
        variant=str(obj.get("variant", "") or ""),
        entrypoint=_strings(inner.get("Entrypoint")),
        cmd=_strings(inner.get("Cmd")),
        env=_strings(inner.get("Env")),
        working_dir=str(inner.get("WorkingDir") or ""),
        user=str(inner.get("User") or ""),
        diff_ids=_strings(rootfs.get("diff_ids")),
        labels={str(k): str(v) for k, v in (inner.get("Labels") or {}).items()},
    )


def select_platform(index: Index, image: str, wanted: Platform) -> Descriptor:
    """The index entry for ``wanted``, or ``NoMatchingPlatform`` listing what there is."""
    offered = [d for d in index.manifests if d.media_type not in INDEX_TYPES or d.platform]
    for descriptor in offered:
        if descriptor.platform is not None and wanted.matches(descriptor.platform):
            return descriptor
    available = sorted(
        {str(d.platform) for d in offered if d.platform and d.platform.os != "unknown"}
    )
    raise NoMatchingPlatform(image, str(wanted), available)


def check_config_platform(config: ImageConfig, image: str, wanted: Platform) -> None:
    """Refuse a single-platform image built for another os or architecture."""
    built = (config.os, config.architecture)
    if config.os and config.architecture and built != (wanted.os, wanted.architecture):
        raise NoMatchingPlatform(image, str(wanted), [str(config.platform)])


def _parse_platform(value: Mapping[str, Any]) -> Platform:
    return Platform(
        str(value.get("os", "")),
        str(value.get("architecture", "")),
        str(value.get("variant", "") or ""),
    )


def _list(obj: Mapping[str, Any], key: str, what: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        raise InvalidImage(f"{what} has no {key} list")
    return value


def _strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    raise InvalidImage(f"expected a list of strings in the image config, got {value!r}")
