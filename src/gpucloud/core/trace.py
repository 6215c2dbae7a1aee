"""An opt-in timeline across processes (``GPUCLOUD_TRACE``): where a start spends its time.

When the environment variable names a file, ``mark`` appends one JSON object per line to it:
``{"t": <CLOCK_MONOTONIC seconds>, "pid": ..., "thread": ..., "event": ..., **fields}``.
``CLOCK_MONOTONIC`` is one clock for the whole machine, so the lines written by a benchmark,
the server, the agent, its container supervisors and the lazyfs daemon (all inherit the
variable) sort into a single timeline. ``bench/pod_start.py --trace`` (a cached start:
create, scheduling pass, bind, long poll, bundle, runc, log shipping) and
``bench/lazy_pull.py --trace`` (a lazy start: mounts and chunk fetches, with its summary in
``images/lazy/trace.py``) turn it on. The variable's old name ``GPUCLOUD_LAZY_TRACE`` is
read too. Unset, ``mark`` is one test of a global: nothing is written or formatted.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

TRACE_ENV = "GPUCLOUD_TRACE"
LEGACY_TRACE_ENV = "GPUCLOUD_LAZY_TRACE"
_lock = threading.Lock()
_path = os.environ.get(TRACE_ENV) or os.environ.get(LEGACY_TRACE_ENV) or None


def enabled() -> bool:
    return _path is not None


def set_path(path: str | None) -> None:
    """Trace this process to ``path`` from now on (None: stop); children started later
    follow it too (the variable is set, or unset, in ``os.environ``)."""
    global _path
    _path = path
    os.environ.pop(LEGACY_TRACE_ENV, None)
    if path is None:
        os.environ.pop(TRACE_ENV, None)
    else:
        os.environ[TRACE_ENV] = path


def mark(event: str, **fields: Any) -> None:
    """Append ``event`` with the current monotonic time (no-op unless tracing)."""
    if _path is None:
        return
    line = json.dumps({"t": round(time.monotonic(), 6), "pid": os.getpid(),
                       "thread": threading.current_thread().name, "event": event, **fields})
    with _lock:
        # O_APPEND: lines of several processes interleave whole (each is one write).
        fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode() + b"\n")
        finally:
            os.close(fd)


def load(path: str) -> list[dict[str, Any]]:
    """The trace's events in time order."""
    with open(path) as handle:
        events = [json.loads(line) for line in handle if line.strip()]
    return sorted(events, key=lambda e: float(e["t"]))
