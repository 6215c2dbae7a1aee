"""Errors of the image side of the node agent.

    GpucloudError (core)
    └── ImageError                 any failure to get or prepare an image; ``reason`` is the
        │                          short CamelCase word the agent puts on a ``Failed`` pod
        ├── ImageNotFound          the registry or the store has no such image (404)
        ├── RegistryUnauthorized   credentials missing or refused (401/403)
        ├── RegistryUnavailable    the registry cannot be reached or answers an error
        ├── DigestMismatch         content does not hash to its digest (corrupted blob)
        ├── NoMatchingPlatform     no variant of the image for this host's os/architecture
        ├── InvalidImage           malformed or unsupported manifest, config or archive
        └── UnsafeLayer            a layer entry that would escape the root filesystem

Every message is one line a user can act on; none carries a traceback's worth of detail.
"""

from __future__ import annotations

from typing import ClassVar

from gpucloud.core.errors import GpucloudError


class ImageError(GpucloudError):
    """Base of every image error; ``reason`` is a stable machine-readable word."""

    reason: ClassVar[str] = "ImagePullFailed"


class ImageNotFound(ImageError):
    """The image (or one of its blobs) does not exist where it was looked for."""

    reason = "ImageNotFound"


class RegistryUnauthorized(ImageError):
    """The registry (or its token service) refused the credentials, or asked for some."""

    reason = "RegistryUnauthorized"


class RegistryUnavailable(ImageError):
    """The registry could not be reached, or answered with an unexpected error."""

    reason = "RegistryUnavailable"


class DigestMismatch(ImageError):
    """Downloaded or imported content does not match its digest."""

    reason = "DigestMismatch"

    def __init__(self, expected: str, detail: str, what: str = "blob") -> None:
        super().__init__(f"{what} {expected} is corrupted: {detail}; refusing it")
        self.expected = expected
        self.detail = detail


class NoMatchingPlatform(ImageError):
    """The image has no variant for the host's platform."""

    reason = "NoMatchingPlatform"

    def __init__(self, image: str, wanted: str, available: list[str]) -> None:
        offered = ", ".join(available) if available else "none declared"
        super().__init__(
            f"image {image} has no variant for {wanted} (available platforms: {offered})"
        )
        self.wanted = wanted
        self.available = available


class InvalidImage(ImageError):
    """A manifest, config or archive that is malformed or of an unsupported kind."""

    reason = "InvalidImage"


class UnsafeLayer(ImageError):
    """A layer entry whose path or link target escapes the root filesystem."""

    reason = "UnsafeLayer"
