"""Fixtures for real runc containers (see runc_testing)."""

from tests.integration.runtime.runc_testing import busybox_rootfs, driver

__all__ = ["busybox_rootfs", "driver"]
