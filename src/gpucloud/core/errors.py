"""The one exception tree of gpucloud.

    GpucloudError                 base; carries a one-line, user-readable message
    ├── InvalidInput              bad input; ``field`` names what was wrong (API: 422)
    ├── NotFound                  missing, or not visible to the caller (API: 404)
    ├── Conflict                  duplicate name, wrong state, stale version (API: 409)
    │   └── StaleFencingToken     an agent write with an outdated fencing token (API: 409)
    ├── Unauthorized              no key or a wrong key (API: 401)
    ├── Forbidden                 valid key, not allowed (API: 403)
    └── InvalidTransition         a phase change the transition table forbids (API: 409)

Expected scheduling outcomes are not exceptions: the scheduler returns a typed Status.
"""

from __future__ import annotations


class GpucloudError(Exception):
    """Base of every error gpucloud raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(GpucloudError):
    """Input that fails validation; ``field`` is the dotted name of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(GpucloudError):
    """The object does not exist or belongs to another project."""


class Conflict(GpucloudError):
    """The request conflicts with the current state."""


class StaleFencingToken(Conflict):
    """An agent wrote with a fencing token older than the node's current grant."""


class Unauthorized(GpucloudError):
    """Missing or unknown credentials."""


class Forbidden(GpucloudError):
    """The caller is known but may not do this."""


class InvalidTransition(Conflict):
    """A phase change not allowed by the transition table."""
