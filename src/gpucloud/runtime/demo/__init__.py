"""The demo program of ``make up``: ``gpucloud-demo``, a busybox-sh script that prints the
GPUs its container was given (environment and /run/gpucloud/gpus.json)."""

from __future__ import annotations

from pathlib import Path

DEMO_SCRIPT = Path(__file__).with_name("gpucloud-demo")
