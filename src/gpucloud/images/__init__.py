"""Images for pods: an OCI distribution client, a content-addressed store, unpacking.

The agent uses ``ImageManager``; the control plane validates ``--image`` with
``parse_reference``. Everything that can fail raises an ``ImageError`` subclass whose
``reason`` and message can be shown on a ``Failed`` pod as they are.
"""

from gpucloud.images.auth import Credentials
from gpucloud.images.errors import (
    DigestMismatch,
    ImageError,
    ImageNotFound,
    InvalidImage,
    NoMatchingPlatform,
    RegistryUnauthorized,
    RegistryUnavailable,
    UnsafeLayer,
)
from gpucloud.images.manager import ImageManager
from gpucloud.images.manifest import ImageConfig, Platform, host_platform
from gpucloud.images.pull import Image
from gpucloud.images.reference import ImageReference, parse_reference
from gpucloud.images.rootfs import RootfsMode
from gpucloud.images.store import ImageRecord

__all__ = [
    "Credentials",
    "DigestMismatch",
    "Image",
    "ImageConfig",
    "ImageError",
    "ImageManager",
    "ImageNotFound",
    "ImageRecord",
    "ImageReference",
    "InvalidImage",
    "NoMatchingPlatform",
    "Platform",
    "RegistryUnauthorized",
    "RegistryUnavailable",
    "RootfsMode",
    "UnsafeLayer",
    "host_platform",
    "parse_reference",
]
