"""NVIDIA's ``cuda-checkpoint`` around a transparent checkpoint of a GPU container.

CRIU cannot dump GPU state. ``cuda-checkpoint --toggle --pid P`` (driver 550 and later)
suspends a CUDA process: it locks the driver APIs that launch work, waits for submitted
work, copies device memory to host memory and releases the GPU; the process's CPU side
keeps running and CRIU can then dump it like any other. The same toggle on a suspended
process (after ``runc restore``, or after a dump that leaves the container running)
re-acquires the GPU and copies the memory back to the same addresses.

So around ``runc checkpoint`` of a container with GPUs: suspend every process of the
container that holds a GPU device open, dump, and resume them when the container keeps
running (or when the dump failed); after ``runc restore``, resume them. CRIU 4's CUDA
plugin does the same from inside CRIU; Debian's CRIU 3.17 has none, so the agent does it.
Not supported by cuda-checkpoint, and refused before placement: MIG instances, MPS clients
(shares of a GPU), UVM and IPC memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from gpucloud.runtime.errors import RuncError

BINARY = "cuda-checkpoint"
GPU_DEVICE_PREFIX = "/dev/nvidia"
TOGGLE_TIMEOUT_SECONDS = 300.0


def find_binary() -> str | None:
    return shutil.which(BINARY)


def container_pids(runc: Sequence[str], container_id: str) -> list[int]:
    """Every process of the container (``runc ps``), host pids."""
    result = subprocess.run([*runc, "ps", "--format", "json", container_id],
                            capture_output=True, text=True, check=False,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuncError(f"runc ps {container_id} failed: {result.stderr.strip()}")
    return [int(pid) for pid in json.loads(result.stdout or "[]")]


def gpu_pids(pids: Iterable[int], device_prefix: str = GPU_DEVICE_PREFIX,
             proc: Path = Path("/proc")) -> list[int]:
    """The processes among ``pids`` with a GPU device (``/dev/nvidia*``) open: the CUDA
    processes ``cuda-checkpoint`` must suspend. A process that ends meanwhile is skipped."""
    holding = []
    for pid in pids:
        try:
            fds = list((proc / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(device_prefix):
                holding.append(pid)
                break
    return holding


def toggle(binary: str, pids: Iterable[int]) -> list[int]:
    """``cuda-checkpoint --toggle`` each process (suspend a running one, resume a suspended
    one); the pids toggled. Raises RuncError naming the process on the first failure."""
    done = []
    for pid in pids:
        try:
            result = subprocess.run([binary, "--toggle", "--pid", str(pid)],
                                    capture_output=True, text=True, check=False,
                                    stdin=subprocess.DEVNULL, timeout=TOGGLE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            raise RuncError(f"cuda-checkpoint --toggle of pid {pid} did not finish in "
                            f"{TOGGLE_TIMEOUT_SECONDS:g}s") from None
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
            raise RuncError(f"cuda-checkpoint --toggle of pid {pid} failed: {detail}")
        done.append(pid)
    return done


class SuspendedGpus:
    """The CUDA processes of one container, suspended for a dump (``with`` block: resumed
    on leaving unless ``keep_suspended()`` was called, i.e. the container ended dumped)."""

    def __init__(self, binary: str, pids: Sequence[int]) -> None:
        self.binary = binary
        self.pids = list(pids)
        self._resume = True

    def __enter__(self) -> SuspendedGpus:
        suspended: list[int] = []
        try:
            for pid in self.pids:
                suspended += toggle(self.binary, [pid])
        except RuncError:
            toggle(self.binary, suspended)  # back to running what was suspended
            raise
        return self

    def keep_suspended(self) -> None:
        self._resume = False

    def __exit__(self, *_exc: object) -> None:
        if self._resume:
            toggle(self.binary, self.pids)


def resume_restored(binary: str, runc: Sequence[str], container_id: str) -> list[int]:
    """After ``runc restore`` of a container dumped suspended: resume its CUDA processes
    (they hold the GPU device open again: CRIU restored the file descriptors)."""
    return toggle(binary, gpu_pids(container_pids(runc, container_id)))
