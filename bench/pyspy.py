"""Sampling profiles of running bench processes with py-spy (PyPI ``py-spy``), summarised.

``Profiler(pid, path).start()`` samples a process (a server replica, an agent worker) at
``rate`` Hz without pausing it; ``stop()`` ends the recording and returns its summary: the
samples per thread, and the functions with most samples on top of the stack (self) and
anywhere in it (inclusive). py-spy counts the samples of threads it sees running (not
idle: a thread blocked on a socket, a lock or a sleep is left out), so a function's share
is roughly its share of the process's busy time, CPU and C calls (libpq) alike.

    .venv/bin/python bench/pyspy.py /tmp/x.raw     # summarise a recording again
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*)\)$")
_THREAD = re.compile(r"^(?:process \d+:\".*?\";)?thread \((?P<id>0x[0-9A-Fa-f]+)\)$")


def available() -> bool:
    return _binary() is not None


def _binary() -> str | None:
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


class Profiler:
    """One py-spy recording of process ``pid`` into ``path`` (py-spy's raw format)."""

    def __init__(self, pid: int, path: Path, rate: int = 50) -> None:
        self.pid, self.path, self.rate = pid, path, rate
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Profiler:
        binary = _binary()
        if binary is None:
            raise RuntimeError("py-spy is not installed (.venv/bin/pip install py-spy)")
        self.process = subprocess.Popen(
            [binary, "record", "--pid", str(self.pid), "--format", "raw", "--nolineno",
             "--threads", "--nonblocking", "--rate", str(self.rate), "--output",
             str(self.path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def stop(self, top: int = 25) -> dict[str, Any]:
        """End the recording (SIGINT: py-spy writes what it has) and summarise it."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            _, stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
        if not self.path.exists():
            return {"error": stderr.decode(errors="replace")[-500:]}
        return summarize(self.path.read_text(), top) | {"raw": str(self.path)}


def _function(frame: str) -> str:
    found = _FRAME.match(frame)
    if not found:
        return frame
    return f"{found['function']} ({found['file']})"


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """Samples per thread and the ``top`` functions by self and inclusive samples."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0] if _THREAD.match(frames[0]) or frames[0].startswith(
            ("thread", "process")) else "?"
        functions = [_function(f) for f in frames if f != thread]
        if not functions:
            continue
        total += count
        # the thread by its outermost Python frame (the loop it runs), not its raw id
        threads[functions[0]] += count
        self_counts[functions[-1]] += count
        for function in set(functions):
            inclusive[function] += count

    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    return {"samples": total, "threads_pct": share(threads)[:8], "self_pct": share(self_counts),
            "inclusive_pct": share(inclusive)}


def main() -> None:
    print(json.dumps(summarize(Path(sys.argv[1]).read_text()), indent=1))


if __name__ == "__main__":
    main()
