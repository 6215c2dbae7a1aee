"""Container image references, parsed the way Docker parses them.

``busybox`` → ``docker.io/library/busybox:latest``; ``127.0.0.1:5000/a/b@sha256:…`` keeps its
registry and digest. The first path component is a registry when it contains a '.' or ':'
or is ``localhost``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpucloud.core.errors import InvalidInput

DEFAULT_REGISTRY = "docker.io"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-fA-F0-9]{32,}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::\d{1,5})?$")
MAX_REFERENCE_LENGTH = 255


@dataclass(frozen=True)
class ImageReference:
    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What a registry's manifest endpoint takes: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def _split_registry(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if not _HOST.match(first):
            raise InvalidInput("image", f"{first!r} is not a valid registry host")
        return first, rest
    return DEFAULT_REGISTRY, name


def parse_image_reference(text: str) -> ImageReference:
    """Parse ``[registry/]repo[:tag][@digest]``; InvalidInput("image", …) when malformed."""
    if not text or text != text.strip():
        raise InvalidInput("image", "must be a non-empty reference without surrounding spaces")
    if len(text) > MAX_REFERENCE_LENGTH:
        raise InvalidInput("image", f"must be at most {MAX_REFERENCE_LENGTH} characters")
    name, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise InvalidInput("image", f"{digest!r} is not a valid digest")
    registry, path = _split_registry(name)
    tag: str | None = None
    last_slash = path.rfind("/")
    colon = path.rfind(":")
    if colon > last_slash:
        path, tag = path[:colon], path[colon + 1 :]
        if not _TAG.match(tag):
            raise InvalidInput("image", f"{tag!r} is not a valid tag")
    components = path.split("/")
    if not path or not all(_COMPONENT.match(part) for part in components):
        raise InvalidInput(
            "image", f"{text!r} is not a valid image reference (expected e.g. ubuntu:22.04)"
        )
    if registry == DEFAULT_REGISTRY and len(components) == 1:
        path = f"library/{path}"
    if tag is None and not digest:
        tag = "latest"
    return ImageReference(registry, path, tag, digest or None)
