"""Image references: the parser lives in ``gpucloud.core.image_ref`` so that the API can
validate ``--image`` without importing the image machinery; re-exported here."""

from gpucloud.core.image_ref import (
    DEFAULT_TAG,
    DOCKER_HUB,
    DOCKER_HUB_API,
    ImageReference,
    is_digest,
    parse_reference,
)

__all__ = [
    "DEFAULT_TAG",
    "DOCKER_HUB",
    "DOCKER_HUB_API",
    "ImageReference",
    "is_digest",
    "parse_reference",
]
