"""Typed Python SDK over httpx (the CLI and the agent use it; the transport is injectable)."""

from gpucloud.client.sdk import ApiError, GpucloudClient

__all__ = ["ApiError", "GpucloudClient"]
