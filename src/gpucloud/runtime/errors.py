"""Why a container could not be built, started or managed.

``RuntimeFailure.message`` is written for the pod's owner: the agent reports it as the pod's
reason (``command not found: foo``).
"""

from __future__ import annotations

from gpucloud.core.errors import GpucloudError


class RuntimeFailure(GpucloudError):
    """A container that cannot be built or run; the message is the pod's reason."""


class CommandNotFound(RuntimeFailure):
    def __init__(self, command: str) -> None:
        super().__init__(f"command not found: {command}")
        self.command = command


class BundleError(RuntimeFailure):
    """The image config and pod spec do not make a runnable container."""


class RuncError(RuntimeFailure):
    """runc refused an operation; the message carries runc's own error line."""
