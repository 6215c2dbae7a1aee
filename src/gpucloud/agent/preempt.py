"""The preemption notice on the node: the notice file and the early acknowledgement.

When an assignment carries a ``StopNotice`` (the server stops the pod for a preemption or
a drain), the pod worker writes it to the container's run dir (``preempt``, seen inside
as ``/run/gpucloud/preempt``) atomically — a reader sees nothing or the whole JSON — and
then asks the driver to SIGTERM the container's whole process group (a shell as PID 1
often does not forward SIGTERM to its children), SIGKILL after the grace. A program that
commits a checkpoint after the notice (``gpucloud-ckpt commit``) has acknowledged it: the
worker stops it at once instead of waiting out the grace. One that exits with code 75
(``EX_TEMPFAIL``) simply ends, and is requeued like any noticed pod.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from gpucloud.core.spot import NOTICE_FILE, StopNotice
from gpucloud.runtime.layout import write_json_atomic

#: The variable naming the notice file inside every container.
PREEMPT_FILE_VAR = "GPUCLOUD_PREEMPT_FILE"


class CommitWatcher(Protocol):
    """What the checkpoint uploader tells: whether a commit happened since ``t``."""

    def committed_since(self, t: float) -> bool: ...


def notice_path(run_dir: Path) -> Path:
    return run_dir / NOTICE_FILE


def write_notice(run_dir: Path, notice: StopNotice) -> float:
    """Write the notice file; returns the time (epoch seconds) it was given."""
    given = time.time()
    document = notice.model_dump(mode="json") | {"noticed_at": given}
    write_json_atomic(notice_path(run_dir), document)
    return given


class NoticeState:
    """One pod worker's notice: given (when), acknowledged (stopped at once)."""

    def __init__(self) -> None:
        self.given_at: float | None = None
        self.acknowledged = False

    def give(self, run_dir: Path, notice: StopNotice) -> None:
        self.given_at = write_notice(run_dir, notice)

    def newly_acknowledged(self, watcher: CommitWatcher | None) -> bool:
        """True once, when a commit after the notice is first seen."""
        if self.given_at is None or self.acknowledged or watcher is None:
            return False
        self.acknowledged = watcher.committed_since(self.given_at)
        return self.acknowledged
