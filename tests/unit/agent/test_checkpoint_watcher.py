"""The checkpoint watcher's commit markers and what counts as acknowledging a notice.

The uploads are a stand-in (the server side is tested elsewhere); what is under test is
the watcher: a commit asked for while an upload runs is not swallowed by that upload, and
only a commit asked for after a notice acknowledges it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from gpucloud.agent.checkpoints import CheckpointWatcher, PodCheckpoints
from gpucloud.core.checkpoints import COMMITTED_MARKER, DONE_MARKER, CheckpointOut


class Uploads(PodCheckpoints):
    """Records each upload; ``during`` runs in the middle of the next one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.name, self.pod_id, self.attempt = "p", "pod-1", 1
        self.marks: list[float] = []
        self.during: Callable[[], None] | None = None

    def upload(self, marked_at: float) -> CheckpointOut:
        self.marks.append(marked_at)
        if self.during is not None:
            self.during()
            self.during = None
        seq = len(self.marks)
        return CheckpointOut(id=f"1-{seq}", project="p", key="pod-1", attempt=1, seq=seq,
                             state="committed", size_bytes=1, files=1, chunks=1,
                             bytes_sent=1, created_at=datetime.now(UTC))


def _watcher(tmp_path: Path) -> tuple[CheckpointWatcher, Uploads]:
    uploads = Uploads(tmp_path)
    return CheckpointWatcher(uploads, 60.0, threading.Event()), uploads


def _touch(path: Path, at: float) -> None:
    path.touch()
    os.utime(path, (at, at))


def test_a_commit_asked_for_during_an_upload_waits_for_the_next(tmp_path: Path) -> None:
    watcher, uploads = _watcher(tmp_path)
    marker = tmp_path / DONE_MARKER
    _touch(marker, time.time() - 5)
    uploads.during = lambda: _touch(marker, time.time())  # `gpucloud-ckpt commit` again
    assert watcher.flush() is not None
    assert marker.exists()  # not taken for the one just uploaded
    assert (tmp_path / COMMITTED_MARKER).read_text().strip() == "1-1"
    assert watcher.flush() is not None
    assert not marker.exists() and len(uploads.marks) == 2
    assert watcher.flush() is None  # nothing pending


def test_only_a_commit_asked_for_after_the_notice_acknowledges_it(tmp_path: Path) -> None:
    watcher, uploads = _watcher(tmp_path)
    marker = tmp_path / DONE_MARKER
    noticed = time.time()
    _touch(marker, noticed - 2)  # under way when the notice came
    assert watcher.flush() is not None
    assert not watcher.committed_since(noticed)  # committed after it, asked for before
    _touch(marker, noticed + 0.5)
    assert watcher.flush() is not None
    assert watcher.committed_since(noticed)
