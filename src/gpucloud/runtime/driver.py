"""The runc driver: start, adopt, stop, inspect and remove containers.

Every container is run by its own supervisor process (see ``supervisor``), which outlives
the agent. All state lives in files under the agent's state directory, so a new driver
object — after an agent restart — sees the same containers: running ones keep running and
logging, and their exit records appear when they end. ``containers()`` is adoption: it
returns every container the state directory holds, with its current state.

Each agent has its own runc ``--root`` and cgroup parent (derived from its state directory),
so several agents on one machine never see each other's containers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.trace import mark
from gpucloud.gpu.cdi import ContainerEdits
from gpucloud.runtime import criu, cuda_checkpoint
from gpucloud.runtime.bundle import Bundle, ContainerSpec, ImageConfig, build_bundle
from gpucloud.runtime.cuda_checkpoint import SuspendedGpus
from gpucloud.runtime.errors import RuncError
from gpucloud.runtime.layout import CONTAINER_ID, ContainerPaths, read_json, write_json_atomic
from gpucloud.runtime.supervisor import has_private_network, runc_error
from gpucloud.runtime.zygote import Zygote, ZygoteUnavailable

log = logging.getLogger(__name__)

DEFAULT_RUNC = "/usr/bin/runc"
DEFAULT_GRACE_SECONDS = 30.0
START_TIMEOUT_SECONDS = 120.0
OOM_REASON = "OOMKilled"


class ContainerState(StrEnum):
    CREATED = "created"  # bundle written, not started
    CREATING = "creating"  # supervisor running, container not started yet
    RUNNING = "running"
    EXITED = "exited"  # exit.json written: exit code (or start error) known
    LOST = "lost"  # supervisor gone without an exit record: the exit status is unknown


@dataclass(frozen=True)
class ExitInfo:
    """How a container ended. ``exit_code`` is 128+N when killed by signal N (as Docker);
    None with ``error`` set when the container never ran."""

    exit_code: int | None
    signal: int | None = None
    oom_killed: bool = False
    stop_requested: bool = False
    killed_after_grace: bool = False
    #: Ended by ``runc checkpoint`` (``dump``): its processes are in the dump.
    checkpointed: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ExitInfo:
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in record.items() if key in known})

    @property
    def reason(self) -> str | None:
        """The pod's reason: ``OOMKilled``, the start error, or None for a plain exit."""
        if self.oom_killed:
            return OOM_REASON
        return self.error

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not self.oom_killed


@dataclass(frozen=True)
class ContainerStatus:
    container_id: str
    state: ContainerState
    pid: int | None = None
    exit: ExitInfo | None = None
    labels: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None


def _pid_alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs and is the supervisor of the container directory ``marker``
    (no pid reuse): a supervisor works in its container's directory, and one started by
    ``python -m`` names it on its command line too (one forked by the zygote does not)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return (cwd == marker or marker.encode() in cmdline) and not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


class RuncDriver:
    def __init__(
        self,
        state_dir: Path,
        *,
        runc: str = DEFAULT_RUNC,
        python: str = sys.executable,
        start_timeout: float = START_TIMEOUT_SECONDS,
        zygote: bool = True,
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.runc = runc
        self.python = python
        self.start_timeout = start_timeout
        #: Starts supervisors by forking one kept interpreter (runtime/zygote); None: each
        #: start runs ``python -m gpucloud.runtime.supervisor``.
        self.zygote = Zygote(python) if zygote else None
        self.runc_root = self.state_dir / "runc"
        self.containers_dir = self.state_dir / "containers"
        self.containers_dir.mkdir(parents=True, exist_ok=True)
        self.runc_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.scope = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        #: Whether each container built by this object and not started yet has a network
        #: namespace of its own: its supervisor is told (``_supervise``) instead of
        #: reading the bundle's ``config.json`` back on the start's critical path.
        self._private_network: dict[str, bool] = {}

    # -- naming -------------------------------------------------------------------------

    def paths(self, container_id: str) -> ContainerPaths:
        if not CONTAINER_ID.match(container_id):
            raise InvalidInput("container_id", f"{container_id!r} is not a valid container id")
        return ContainerPaths(self.containers_dir / container_id)

    def cgroup_path(self, container_id: str) -> str:
        """The container's cgroup, under a parent private to this agent's state dir."""
        return f"/gpucloud/{self.scope}/{container_id}"

    # -- lifecycle ----------------------------------------------------------------------

    def build(
        self,
        spec: ContainerSpec,
        rootfs: Path,
        image: ImageConfig,
        cdi_edits: Sequence[ContainerEdits] = (),
    ) -> Bundle:
        """Write the bundle for a new container (raises CommandNotFound, BundleError)."""
        paths = self.paths(spec.container_id)
        if paths.supervisor_pid.exists() or paths.exit_record.exists():
            raise Conflict(f"container {spec.container_id} already exists")
        bundle = build_bundle(paths, rootfs, image, spec,
                              cgroup_path=self.cgroup_path(spec.container_id),
                              cdi_edits=cdi_edits)
        self._private_network[spec.container_id] = has_private_network(bundle.config)
        return bundle

    def start(self, container_id: str, *, pipe_log: bool = False,
              restore_from: Path | None = None) -> ContainerStatus:
        """Start a built container under a new supervisor; return once its process runs.

        ``pipe_log``: its stdio through pipes, so that it can be dumped (``dump``) and
        restored elsewhere; ``restore_from``: ``runc restore`` its processes from that
        dump instead of starting its command (see the supervisor). Raises RuncError with
        runc's message when the container cannot start.
        """
        extra = ["--pipe-log"] if pipe_log else []
        if restore_from is not None:
            extra += ["--restore", str(restore_from)]
        return self._supervise(container_id, gated=False, extra=extra)

    def dump(self, container_id: str, image_dir: Path, *, leave_running: bool,
             gpus: bool = False) -> None:
        """``runc checkpoint`` the container into ``image_dir`` (emptied first); without
        ``leave_running`` it ends, recorded as ``checkpointed``. Only a container started
        with ``pipe_log`` can be restored on another node. ``gpus``: its CUDA processes
        are suspended with cuda-checkpoint first (and resumed when it keeps running).
        Raises RuncError with CRIU's (or cuda-checkpoint's) first error."""
        paths = self.paths(container_id)
        shutil.rmtree(image_dir, ignore_errors=True)
        work = paths.root / "criu-dump"
        shutil.rmtree(work, ignore_errors=True)
        runc = [self.runc, "--root", str(self.runc_root)]
        if not leave_running:
            write_json_atomic(paths.checkpointed, {"at": time.time()})
        try:
            with self._gpus_suspended(container_id, gpus) as suspended:
                criu.checkpoint(runc, container_id, image_dir, work,
                                leave_running=leave_running)
                if suspended is not None and not leave_running:
                    suspended.keep_suspended()  # dumped suspended: restore resumes them
        except (criu.CanaryFailed, RuncError) as error:
            paths.checkpointed.unlink(missing_ok=True)
            raise RuncError(str(error)) from None

    def _gpus_suspended(self, container_id: str, gpus: bool
                        ) -> contextlib.AbstractContextManager[SuspendedGpus | None]:
        """Around a dump of a GPU container: its CUDA processes suspended with
        ``cuda-checkpoint`` (runtime/cuda_checkpoint); nothing for a CPU container."""
        if not gpus:
            return contextlib.nullcontext()
        binary = cuda_checkpoint.find_binary()
        if binary is None:
            raise RuncError("a GPU container's transparent checkpoint needs NVIDIA's "
                            "cuda-checkpoint, which is not installed on this node")
        runc = [self.runc, "--root", str(self.runc_root)]
        pids = cuda_checkpoint.container_pids(runc, container_id)
        return SuspendedGpus(binary, cuda_checkpoint.gpu_pids(pids))

    def create(self, container_id: str) -> ContainerStatus:
        """Create a built container (state CREATING) whose command waits for ``release``:
        the start barrier of a job's members. Raises RuncError like ``start``."""
        return self._supervise(container_id, gated=True)

    def release(self, container_id: str) -> ContainerStatus:
        """Let a created container's command start; return once it runs (or ended)."""
        paths = self.paths(container_id)
        write_json_atomic(paths.start_release, {"released_at": time.time()})
        deadline = time.monotonic() + self.start_timeout
        delay = 0.005
        while True:
            status = self.status(container_id)
            if status.state is not ContainerState.CREATING or time.monotonic() > deadline:
                return status
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def prestart(self) -> None:
        """Start the supervisor zygote ahead of the first container (agent start)."""
        if self.zygote is not None:
            self.zygote.prestart()

    def _supervise(self, container_id: str, gated: bool,
                   extra: Sequence[str] = ()) -> ContainerStatus:
        paths = self.paths(container_id)
        if not paths.config.exists():
            raise NotFound(f"container {container_id} has no bundle")
        if paths.supervisor_pid.exists():
            raise Conflict(f"container {container_id} was already started")
        private = self._private_network.pop(container_id, None)
        argv = ["--runc", self.runc, "--root", str(self.runc_root),
                *(["--gated"] if gated else []), *extra,
                *([] if private is None else ["--private-network", "yes" if private else "no"]),
                str(paths.root)]
        mark("driver.supervise")
        try:
            line, stderr = self._start_supervisor(argv)
        except (subprocess.TimeoutExpired, TimeoutError):
            raise RuncError(f"container {container_id} did not start in time") from None
        if not line.startswith("created" if gated else "started"):
            detail = line.removeprefix("error: ") or stderr or "unknown error"
            if not line.startswith("error: "):
                detail += f" (see {paths.supervisor_log})"
            raise RuncError(f"container failed to start: {detail}")
        return self.status(container_id)

    def _start_supervisor(self, argv: list[str]) -> tuple[str, str]:
        """The supervisor's status line (and what it wrote to stderr, if known)."""
        if self.zygote is not None:
            try:
                line = self.zygote.start_supervisor(argv, self.start_timeout)
                return line or "error: supervisor ended without reporting", ""
            except ZygoteUnavailable as error:
                log.warning("%s; starting the supervisor directly", error)
        # cwd "/": ``python -m`` puts the working directory first on sys.path.
        result = subprocess.run([self.python, "-m", "gpucloud.runtime.supervisor", *argv],
                                capture_output=True, text=True, check=False,
                                timeout=self.start_timeout, stdin=subprocess.DEVNULL, cwd="/")
        lines = result.stdout.strip().splitlines()
        return (lines[-1] if lines else ""), result.stderr.strip()

    def status(self, container_id: str) -> ContainerStatus:
        paths = self.paths(container_id)
        if not paths.root.is_dir():
            raise NotFound(f"container {container_id} does not exist")
        labels = read_json(paths.meta) or {}
        record = read_json(paths.exit_record)
        if record is not None:
            return ContainerStatus(container_id, ContainerState.EXITED,
                                   exit=ExitInfo.from_record(record), labels=labels,
                                   log_path=paths.log)
        started = read_json(paths.started)
        pid = started["pid"] if started else None
        if self._supervised(paths):
            state = ContainerState.RUNNING if started else ContainerState.CREATING
        else:
            state = self._unsupervised_state(paths)
        return ContainerStatus(container_id, state, pid=pid, labels=labels, log_path=paths.log)

    def containers(self) -> list[ContainerStatus]:
        """Every container in the state dir: what a restarted agent adopts."""
        statuses = []
        for entry in sorted(self.containers_dir.iterdir()):
            if entry.is_dir() and CONTAINER_ID.match(entry.name):
                statuses.append(self.status(entry.name))
        return statuses

    def stop(self, container_id: str, grace_seconds: float = DEFAULT_GRACE_SECONDS, *,
             group: bool = False) -> None:
        """Ask the container to stop: SIGTERM now, SIGKILL after ``grace_seconds``.
        ``group``: SIGTERM to every process of the container, not only its PID 1 (a
        preemption notice: a shell as PID 1 often does not forward it).

        Returns at once; the supervisor enforces the grace period even if the agent
        restarts meanwhile. Use ``wait`` for the outcome. Stopping an exited container
        does nothing.
        """
        paths = self.paths(container_id)
        state = self.status(container_id).state
        if state is ContainerState.EXITED:
            return
        write_json_atomic(paths.stop_request, {"grace_seconds": grace_seconds,
                                               "requested_at": time.time(), "group": group})
        supervisor = read_json(paths.supervisor_pid)
        if isinstance(supervisor, int) and self._supervised(paths):
            os.kill(supervisor, signal.SIGUSR1)
            return
        self._stop_unsupervised(container_id, grace_seconds)

    def wait(self, container_id: str, timeout: float | None = None) -> ExitInfo | None:
        """The container's exit once known, or None if ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            status = self.status(container_id)
            if status.exit is not None:
                return status.exit
            if status.state is ContainerState.LOST:
                return None
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def remove(self, container_id: str) -> None:
        """Delete an ended container's runc state and directory (logs included)."""
        paths = self.paths(container_id)
        self._private_network.pop(container_id, None)
        if not paths.root.is_dir():
            return
        if self.status(container_id).state in (ContainerState.RUNNING, ContainerState.CREATING):
            raise Conflict(f"container {container_id} is still running; stop it first")
        self._runc("delete", "--force", container_id, check=False)
        _remove_tree(paths.root)

    def log_path(self, container_id: str) -> Path:
        return self.paths(container_id).log

    def signal(self, container_id: str, sig: str) -> bool:
        """Send ``sig`` (``SIGUSR1``, ``USR1``) to the container's main process with
        ``runc kill``: a checkpoint request. False when the container does not run (it
        ended meanwhile); raises InvalidInput for a name that is not a signal."""
        name = sig.upper().removeprefix("SIG")
        if not name.isalnum() or not hasattr(signal, f"SIG{name}"):
            raise InvalidInput("checkpoint_signal", f"{sig!r} is not a signal")
        self.paths(container_id)  # validates the id
        return self._runc("kill", container_id, name, check=False).returncode == 0

    def exec_command(self, container_id: str, argv: Sequence[str], *, tty: bool = False,
                     env: Mapping[str, str] | None = None, pid_file: Path | None = None,
                     process_file: Path | None = None) -> list[str]:
        """The ``runc exec`` command line running ``argv`` in a running container, with the
        container's own environment (plus ``env``), working directory and user.

        With ``tty`` runc gives the process a terminal of its own and relays it to its own
        stdin/stdout, which must then be a terminal. With ``process_file`` (written by the
        caller from ``exec_process``) the process comes from that file instead of ``argv``
        and ``env``: the only way to size the terminal before the process starts.
        ``pid_file`` receives the host pid of the process (to kill it if the caller goes
        away: runc cannot forward SIGKILL).
        """
        self.paths(container_id)  # validates the id
        command = [self.runc, "--root", str(self.runc_root), "exec"]
        if tty:
            command.append("--tty")
        if pid_file is not None:
            command += ["--pid-file", str(pid_file)]
        if process_file is not None:
            return [*command, "--process", str(process_file), container_id]
        for key, value in (env or {}).items():
            command += ["--env", f"{key}={value}"]
        return [*command, container_id, *argv]

    def exec_process(self, container_id: str, argv: Sequence[str], *, tty: bool = False,
                     env: Mapping[str, str] | None = None,
                     console_size: tuple[int, int] | None = None) -> dict[str, Any]:
        """The OCI process for ``runc exec --process``: the container's own (user, cwd,
        capabilities, environment), running ``argv``; ``console_size`` is (width, height)."""
        config = read_json(self.paths(container_id).config)
        if not isinstance(config, dict) or not isinstance(config.get("process"), dict):
            raise NotFound(f"container {container_id} has no bundle")
        process: dict[str, Any] = dict(config["process"])
        merged = dict(item.partition("=")[::2] for item in process.get("env") or [])
        merged.update(env or {})
        process.update(args=list(argv), terminal=tty,
                       env=[f"{key}={value}" for key, value in merged.items()])
        process.pop("consoleSize", None)
        if tty and console_size is not None and all(console_size):
            process["consoleSize"] = {"width": console_size[0], "height": console_size[1]}
        return process

    def prune_cgroups(self, cgroup_root: Path = Path("/sys/fs/cgroup")) -> None:
        """Remove this agent's empty cgroup parents (runc removes only the containers')."""
        parent = self.cgroup_path("x").rsplit("/", 1)[0].lstrip("/")
        for directory in sorted(cgroup_root.glob(f"*/{parent}")) + [cgroup_root / parent]:
            for candidate in (directory, directory.parent):
                try:
                    candidate.rmdir()
                except OSError:
                    pass  # busy (containers still running, or another agent's), or absent

    # -- helpers ------------------------------------------------------------------------

    def _supervised(self, paths: ContainerPaths) -> bool:
        pid = read_json(paths.supervisor_pid)
        return isinstance(pid, int) and _pid_alive(pid, str(paths.root))

    def _runc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        log = self.state_dir / "runc-driver.log"
        command = [self.runc, "--root", str(self.runc_root), "--log", str(log),
                   "--log-format", "json", *args]
        result = subprocess.run(command, capture_output=True, text=True, check=False,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuncError(runc_error(log, result.stderr.strip() or f"runc {args[0]} failed"))
        return result

    def _runc_state(self, container_id: str) -> str | None:
        result = self._runc("state", container_id, check=False)
        if result.returncode != 0:
            return None
        return str(json.loads(result.stdout).get("status"))

    def _unsupervised_state(self, paths: ContainerPaths) -> ContainerState:
        """The state of a container whose supervisor is gone (killed, or host trouble).

        Its process may still run (runc knows), but its exit status will be lost.
        """
        if not paths.supervisor_pid.exists():
            return ContainerState.CREATED if paths.config.exists() else ContainerState.LOST
        if self._runc_state(paths.container_id) in ("running", "created", "paused"):
            return ContainerState.RUNNING
        return ContainerState.LOST

    def _stop_unsupervised(self, container_id: str, grace_seconds: float) -> None:
        """Without a supervisor, enforce the grace period here (this call blocks)."""
        self._runc("kill", container_id, "TERM", check=False)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline:
            if self._runc_state(container_id) not in ("running", "created", "paused"):
                return
            time.sleep(0.1)
        self._runc("kill", container_id, "KILL", check=False)


def _remove_tree(root: Path, attempts: int = 50) -> None:
    """``rmtree`` that tolerates the container's supervisor finishing its last writes
    (the exit record is there before its final files are closed and renamed): a
    directory that refills while it is removed is removed again, for about a second."""
    for attempt in range(attempts):
        try:
            shutil.rmtree(root)
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.ENOTEMPTY or attempt == attempts - 1:
                raise
            time.sleep(0.02)
