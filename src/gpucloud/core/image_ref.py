"""Image references, parsed and normalized the way Docker does it.

``busybox`` is ``docker.io/library/busybox:latest``; ``ghcr.io/a/b@sha256:…`` keeps its
registry; the first path component is a registry only when it looks like a host (contains
``.`` or ``:``, or is ``localhost``). The grammar is the one of the distribution project's
``reference`` package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpucloud.core.errors import InvalidInput

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
DEFAULT_TAG = "latest"
_MAX_NAME_LENGTH = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
)
_PATH_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST_RE = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}")
_SHA256_RE = re.compile(r"sha256:[a-f0-9]{64}")
_HEX64_RE = re.compile(r"[a-f0-9]{64}")


@dataclass(frozen=True)
class ImageReference:
    """A normalized image reference. ``tag`` and ``digest`` may both be set."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def api_registry(self) -> str:
        """The host:port to talk to: Docker Hub's API lives on another name."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def reference(self) -> str:
        """What to ask the manifests endpoint for: the digest when pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def name(self) -> str:
        """``registry/repository`` without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def with_tag_default(self) -> ImageReference:
        """The same reference with ``latest`` filled in when it has neither tag nor digest."""
        if self.tag or self.digest:
            return self
        return ImageReference(self.registry, self.repository, DEFAULT_TAG, None)

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> ImageReference:
    """Parse ``text`` like ``docker pull`` would; raise ``InvalidInput("image", …)`` if bad.

    A reference without tag or digest gets the tag ``latest``.
    """
    if not text or text != text.strip():
        raise InvalidInput("image", f"invalid image reference {text!r}: empty or padded")
    remainder, digest = _split_digest(text)
    remainder, tag = _split_tag(remainder, text)
    registry, path = _split_registry(remainder)
    _check_registry(registry, text)
    _check_path(path, text)
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if len(f"{registry}/{path}") > _MAX_NAME_LENGTH:
        raise InvalidInput("image", f"image name {text!r} is longer than {_MAX_NAME_LENGTH}")
    return ImageReference(registry, path, tag, digest).with_tag_default()


def is_digest(text: str) -> bool:
    """True for a well-formed ``sha256:<64 hex>`` digest (the only algorithm we verify)."""
    return _SHA256_RE.fullmatch(text) is not None


def _split_digest(text: str) -> tuple[str, str | None]:
    if "@" not in text:
        return text, None
    remainder, digest = text.rsplit("@", 1)
    if not _DIGEST_RE.fullmatch(digest):
        raise InvalidInput("image", f"invalid digest {digest!r} in image reference {text!r}")
    if not is_digest(digest):
        raise InvalidInput("image", f"unsupported digest {digest!r}: only sha256 is supported")
    return remainder, digest


def _split_tag(remainder: str, text: str) -> tuple[str, str | None]:
    colon = remainder.rfind(":")
    if colon <= remainder.rfind("/"):
        return remainder, None
    tag = remainder[colon + 1 :]
    if not _TAG_RE.fullmatch(tag):
        raise InvalidInput("image", f"invalid tag {tag!r} in image reference {text!r}")
    return remainder[:colon], tag


def _split_registry(remainder: str) -> tuple[str, str]:
    first, sep, rest = remainder.partition("/")
    looks_like_host = any(c in first for c in ".:") or first == "localhost"
    if not sep or not (looks_like_host or first != first.lower()):
        return DOCKER_HUB, remainder
    if first == "index.docker.io":
        return DOCKER_HUB, rest
    return first, rest


def _check_registry(registry: str, text: str) -> None:
    if not _DOMAIN_RE.fullmatch(registry):
        raise InvalidInput("image", f"invalid registry {registry!r} in image reference {text!r}")


def _check_path(path: str, text: str) -> None:
    if _HEX64_RE.fullmatch(path):
        raise InvalidInput("image", f"invalid image reference {text!r}: a bare image id")
    if path != path.lower():
        raise InvalidInput("image", f"invalid image reference {text!r}: name must be lowercase")
    for component in path.split("/"):
        if not _PATH_COMPONENT_RE.fullmatch(component):
            raise InvalidInput(
                "image", f"invalid image reference {text!r}: bad name component {component!r}"
            )
