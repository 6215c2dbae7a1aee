"""The checkpoint chunk staging's striped upload locks: the lock folder is made once per
staging (and one staging per home), not on every chunk piece."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpucloud import checkpoints


def test_the_lock_folder_is_made_once_per_home(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Path] = []
    real_mkdir = Path.mkdir

    def counting_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", counting_mkdir)
    staging = checkpoints.staging(tmp_path)
    assert checkpoints.staging(tmp_path) is staging  # what a service call gets each time
    with staging.locked("00000001"):
        pass
    folder = tmp_path / "checkpoints" / "uploads" / ".locks"
    assert folder in made
    made.clear()
    for digest in ("00000402", "00000001"):  # stripes 2 (1026 % 1024) and 1 again
        with checkpoints.staging(tmp_path).locked(digest):
            pass
    assert made == []
    assert sorted(p.name for p in folder.iterdir()) == ["0001", "0002"]
