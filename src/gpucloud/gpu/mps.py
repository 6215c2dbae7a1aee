"""Fractional GPUs on the node: an MPS control daemon per shared GPU, or time-slicing.

With ``mps`` (the default) the agent starts one ``nvidia-cuda-mps-control -d`` per GPU that
has shared pods, with its own pipe and log directory (mounted into those pods), after
switching the GPU to EXCLUSIVE_PROCESS compute mode (only the MPS server may then open a
context on it). The limits are set on the daemon side, through its control pipe, before a
pod's container starts: ``set_default_active_thread_percentage`` from the milli-GPU share
and ``set_default_device_pinned_mem_limit`` from the memory limit. The same values are
also in the pod's environment (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), where a client can only lower them: the
environment is the tenant's, so it is never the only place a limit lives.

Limits of MPS that users must know (docs/gpus.md): every client of one daemon must run
under one user id; the daemon's defaults apply to the MPS server it spawns next, so pods
of one GPU with different shares get the defaults of the pod that started the server and
their own, lower, per-client caps; and one client's fatal GPU fault can kill every other
client on that GPU.

With ``time-slicing`` there is no daemon and no limit: pods share the GPU in turns and the
environment only says what they were given.

``MpsControl`` is how commands reach a daemon: ``ProcessMpsControl`` runs the real binary
(its path is a parameter, so tests can point it at a stand-in that records the control
pipe's input); ``SimulatedMpsControl`` models a daemon for simulated GPUs by recording what
it was told in ``daemon.json`` in the pipe directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from gpucloud.gpu.dmem import dmem_unified
from gpucloud.gpu.domain import GpuDevice
from gpucloud.runtime.errors import RuntimeFailure

log = logging.getLogger(__name__)

SharingMode = Literal["mps", "time-slicing"]
SHARING_MODES: tuple[SharingMode, ...] = ("mps", "time-slicing")
MPS_CONTROL = "nvidia-cuda-mps-control"
#: Where the pipe and log directories of the GPU's daemon appear in a shared pod.
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
SIMULATED_STATE = "daemon.json"
MiB = 1024**2
#: Said in ``pod get`` and the docs for every shared pod.
SHARED_FAULT_WARNING = ("shared GPU: a fatal GPU fault in another pod on this GPU "
                        "can end this pod too")


def thread_percentage(share_milli: int) -> int:
    """The SM percentage of a milli-GPU share, rounded up (a share never gets 0%)."""
    return max(1, min(100, math.ceil(share_milli / 10)))


def pinned_limit(memory_bytes: int) -> str:
    """A device memory limit in MPS's syntax (whole MiB, rounded down, at least 1)."""
    return f"{max(1, memory_bytes // MiB)}M"


def mps_commands(share_milli: int, memory_bytes: int | None) -> list[str]:
    """The control-pipe commands that set a pod's limits on its GPU's daemon."""
    commands = [f"set_default_active_thread_percentage {thread_percentage(share_milli)}"]
    if memory_bytes:
        commands.append(f"set_default_device_pinned_mem_limit 0 {pinned_limit(memory_bytes)}")
    return commands


class MpsControl(Protocol):
    """Starts, commands and stops the MPS control daemon of one GPU."""

    def start(self, gpu: GpuDevice, pipe_dir: Path, log_dir: Path) -> None: ...

    def send(self, pipe_dir: Path, command: str) -> str: ...

    def stop(self, gpu: GpuDevice, pipe_dir: Path) -> None: ...


def _daemon_env(gpu: GpuDevice, pipe_dir: Path, log_dir: Path | None) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid,
           "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    if log_dir is not None:
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    return env


@dataclass
class ProcessMpsControl:
    """The real daemon: ``nvidia-cuda-mps-control -d``; commands on its stdin, as the
    MPS documentation shows (``echo CMD | nvidia-cuda-mps-control``).

    ``set_compute_mode(gpu, exclusive)`` switches the GPU's compute mode (NVML's
    ``nvmlDeviceSetComputeMode``; root only).
    """

    set_compute_mode: Callable[[GpuDevice, bool], None]
    binary: str = MPS_CONTROL
    timeout: float = 10.0

    def start(self, gpu: GpuDevice, pipe_dir: Path, log_dir: Path) -> None:
        self.set_compute_mode(gpu, True)
        self._run([self.binary, "-d"], _daemon_env(gpu, pipe_dir, log_dir), None)

    def send(self, pipe_dir: Path, command: str) -> str:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
        return self._run([self.binary], env, command + "\n")

    def stop(self, gpu: GpuDevice, pipe_dir: Path) -> None:
        self.send(pipe_dir, "quit")
        self.set_compute_mode(gpu, False)

    def _run(self, argv: list[str], env: dict[str, str], stdin: str | None) -> str:
        try:
            done = subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True,
                                  timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeFailure(f"MPS control {' '.join(argv)}: {error}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeFailure(f"MPS control {' '.join(argv)} exited {done.returncode}"
                                 f"{': ' + detail[-1] if detail else ''}")
        return done.stdout


def nvml_compute_mode(nvml: Any) -> Callable[[GpuDevice, bool], None]:
    """``set_compute_mode`` through NVML: EXCLUSIVE_PROCESS for MPS, DEFAULT after."""

    def set_mode(gpu: GpuDevice, exclusive: bool) -> None:
        mode = (nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS if exclusive
                else nvml.NVML_COMPUTEMODE_DEFAULT)
        nvml.nvmlInit()
        try:
            nvml.nvmlDeviceSetComputeMode(nvml.nvmlDeviceGetHandleByUUID(gpu.uuid), mode)
        except nvml.NVMLError as error:
            raise RuntimeFailure(f"GPU {gpu.uuid}: setting the compute mode: {error}") from None
        finally:
            nvml.nvmlShutdown()

    return set_mode


class SimulatedMpsControl:
    """A daemon for simulated GPUs: what a real one would have been told, in
    ``<pipe dir>/daemon.json`` (compute mode, every command, the current defaults)."""

    def start(self, gpu: GpuDevice, pipe_dir: Path, log_dir: Path) -> None:
        self._write(pipe_dir, {"gpu": gpu.uuid, "running": True,
                               "compute_mode": "EXCLUSIVE_PROCESS", "log_dir": str(log_dir),
                               "commands": [], "default_active_thread_percentage": 100,
                               "default_device_pinned_mem_limit": {}})

    def send(self, pipe_dir: Path, command: str) -> str:
        state = self.state(pipe_dir)
        if not state.get("running"):
            raise RuntimeFailure(f"no MPS control daemon listens in {pipe_dir}")
        state["commands"].append(command)
        words = command.split()
        if words[0] == "set_default_active_thread_percentage":
            state["default_active_thread_percentage"] = int(words[1])
        elif words[0] == "set_default_device_pinned_mem_limit":
            state["default_device_pinned_mem_limit"][words[1]] = words[2]
        elif words[0] == "quit":
            state["running"] = False
            state["compute_mode"] = "DEFAULT"
        self._write(pipe_dir, state)
        return ""

    def stop(self, gpu: GpuDevice, pipe_dir: Path) -> None:
        del gpu  # the simulated GPU has no compute mode to restore beyond the state file
        self.send(pipe_dir, "quit")

    @staticmethod
    def state(pipe_dir: Path) -> dict[str, Any]:
        try:
            data = json.loads((pipe_dir / SIMULATED_STATE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _write(pipe_dir: Path, state: dict[str, Any]) -> None:
        path = pipe_dir / SIMULATED_STATE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state, indent=2) + "\n")
        temporary.replace(path)


@dataclass(frozen=True)
class ShareGrant:
    """What a shared pod's container gets: variables, bind mounts (host → container)."""

    env: Mapping[str, str]
    binds: tuple[tuple[Path, str], ...] = ()
    #: ``linux.resources.unified`` entries (``dmem.max`` where the node has cgroup dmem).
    unified: Mapping[str, str] = field(default_factory=dict)


@dataclass
class GpuSharing:
    """The node's sharing policy and the daemons of its shared GPUs.

    A daemon is started for a GPU's first shared pod and stopped (GPU back to DEFAULT
    compute mode) when its last one is released. ``clients`` is rebuilt as the agent
    adopts running pods after a restart (``admit`` of an adopted pod finds the daemon
    already running and only records it).
    """

    mode: SharingMode
    state_dir: Path
    control: MpsControl
    #: PCI bus id → dmem region (gpu/dmem; empty: no dmem controller or no region).
    dmem_regions: dict[str, str] = field(default_factory=dict)
    clients: dict[str, set[str]] = field(default_factory=dict)
    _gpus: dict[str, GpuDevice] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def directories(self, gpu: GpuDevice) -> tuple[Path, Path]:
        root = self.state_dir / "mps" / gpu.uuid
        return root / "pipe", root / "log"

    def admit(self, cid: str, gpu: GpuDevice, share_milli: int,
              memory_bytes: int | None) -> ShareGrant:
        """Set up ``gpu`` for the shared pod ``cid`` and say what its container gets."""
        env = {"GPUCLOUD_GPU_SHARE": f"{share_milli / 1000:g}",
               "GPUCLOUD_GPU_SHARING": self.mode,
               "GPUCLOUD_GPU_MEMORY_LIMIT": str(memory_bytes or gpu.memory_mib * MiB)}
        unified = dmem_unified(self.dmem_regions, gpu, memory_bytes)
        if self.mode == "time-slicing":
            return ShareGrant(env, unified=unified)
        pipe_dir, log_dir = self.directories(gpu)
        with self._lock:
            users = self.clients.setdefault(gpu.uuid, set())
            if not users and not self._running(pipe_dir):
                pipe_dir.mkdir(parents=True, exist_ok=True)
                log_dir.mkdir(parents=True, exist_ok=True)
                self.control.start(gpu, pipe_dir, log_dir)
                log.info("MPS control daemon started for GPU %s", gpu.uuid)
            for command in mps_commands(share_milli, memory_bytes):
                self.control.send(pipe_dir, command)
            users.add(cid)
            self._gpus[gpu.uuid] = gpu
        env |= {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
                "CUDA_MPS_LOG_DIRECTORY": CONTAINER_LOG_DIR,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage(share_milli))}
        if memory_bytes:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={pinned_limit(memory_bytes)}"
        return ShareGrant(env, ((pipe_dir, CONTAINER_PIPE_DIR), (log_dir, CONTAINER_LOG_DIR)),
                          unified)

    def adopt(self, cid: str, gpu: GpuDevice) -> None:
        """A running shared pod a previous agent process started: its daemon runs on."""
        if self.mode == "mps":
            with self._lock:
                self.clients.setdefault(gpu.uuid, set()).add(cid)
                self._gpus[gpu.uuid] = gpu

    def release(self, cid: str) -> None:
        """The pod ``cid`` ended: stop the daemon of each GPU it was the last client of."""
        with self._lock:
            for uuid, users in list(self.clients.items()):
                if cid not in users:
                    continue
                users.discard(cid)
                if not users:
                    del self.clients[uuid]
                    self._stop(self._gpus.pop(uuid))

    def _stop(self, gpu: GpuDevice) -> None:
        pipe_dir, _ = self.directories(gpu)
        try:
            self.control.stop(gpu, pipe_dir)
            log.info("MPS control daemon of GPU %s stopped", gpu.uuid)
        except RuntimeFailure as error:
            log.warning("stopping the MPS daemon of GPU %s: %s", gpu.uuid, error.message)

    def _running(self, pipe_dir: Path) -> bool:
        """A daemon a previous agent process left (simulated: its state says so; real:
        its control socket exists)."""
        if isinstance(self.control, SimulatedMpsControl):
            return bool(SimulatedMpsControl.state(pipe_dir).get("running"))
        return (pipe_dir / "control").exists()


def node_sharing(mode: SharingMode, state_dir: Path, provider: str,
                 nvml: Any = None, dmem_regions: dict[str, str] | None = None) -> GpuSharing:
    """The sharing of a node: simulated daemons for simulated GPUs, real ones otherwise."""
    control: MpsControl = (ProcessMpsControl(nvml_compute_mode(nvml))
                           if provider == "nvml" and nvml is not None
                           else SimulatedMpsControl())
    return GpuSharing(mode, state_dir, control, dict(dmem_regions or {}))
