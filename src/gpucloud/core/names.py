"""Validation of user-chosen names (pods, projects, nodes, keys)."""

from __future__ import annotations

import re

from gpucloud.core.errors import InvalidInput

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LENGTH = 63


def check_dns_label(field: str, name: str) -> str:
    """A DNS-1123 label: lower-case letters, digits and '-', at most 63 characters."""
    if not name:
        raise InvalidInput(field, "must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInput(field, f"must be at most {MAX_NAME_LENGTH} characters, got {len(name)}")
    if not _DNS_LABEL.match(name):
        raise InvalidInput(
            field,
            f"{name!r} is not a DNS label (lower-case letters, digits and '-', "
            "starting and ending with a letter or digit)",
        )
    return name
