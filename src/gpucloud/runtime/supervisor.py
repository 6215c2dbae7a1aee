"""The per-container supervisor: runs one container and records how it ended.

runc keeps no exit status for detached containers, and the agent must be able to restart
without stopping its pods. So each container gets this small process, started by the agent
and detached from it (fork + setsid, so it survives the agent):

1. it makes itself a child subreaper, then ``runc create`` with the log file as the
   container's stdout and stderr (runc passes them through to the container's PID 1, so
   output keeps flowing to the file whatever happens to the agent or to this process);
   once runc create exits, the container's PID 1 is re-parented to this process;
2. it brings up loopback in a private network namespace, then ``runc start``; a *gated*
   supervisor (``--gated``, the start barrier of jobs) first reports ``created PID`` and
   waits for ``start.release`` (or a stop request) before starting the command. When
   nothing has to happen between the two (not gated, no restore, no private namespace:
   the agent's namespaces have loopback up), one ``runc run --detach`` does both, one
   runc process fewer on a pod's start; a stop that arrives meanwhile applies once it runs;
3. it waits for PID 1 with ``waitpid`` (an exact exit status), reads the memory cgroup's
   OOM counter before the cgroup goes away, writes ``exit.json``, and ``runc delete``s.

A stop request is ``stop.json`` (the grace period) plus SIGUSR1: SIGTERM to PID 1 now,
SIGKILL when the grace period ends. SIGTERM, SIGINT and SIGHUP are ignored so that stopping
the agent's process group does not take pods down. Only the standard library and the two
stdlib-only runtime modules are imported, to keep start-up fast.

Transparent checkpoints (``--pipe-log``, ``--restore IMAGE_DIR``): CRIU restores a
regular file by its path, which a new attempt on another node does not have, but runc hands
pipes on the container's stdio over to ``runc restore``'s own. So a container that may be
dumped gets pipes for its stdio (stdin: one at end of file), and this process copies its
stdout/stderr pipe into the log; with ``--restore`` it runs ``runc restore --detach`` from
the dump instead of create and start, and the restored processes write into the new pipe.
Such a container's output stops flowing if its supervisor is killed (the others' does not).
A container ended by ``runc checkpoint`` (``checkpointed.json`` written first) is recorded
with ``checkpointed`` true.

Usage: python -m gpucloud.runtime.supervisor --runc PATH --root DIR [--gated] [--pipe-log]
       [--restore IMAGE_DIR] [--private-network yes|no] CONTAINER_DIR
       python -m gpucloud.runtime.supervisor --zygote FD   (see ``serve``: the driver's)
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import functools
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from gpucloud.core.trace import mark
from gpucloud.runtime import cuda_checkpoint
from gpucloud.runtime.cgroups import memory_cgroup_dir, oom_killed
from gpucloud.runtime.errors import RuncError
from gpucloud.runtime.layout import ContainerPaths, read_json, write_json_atomic

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
DEFAULT_GRACE_SECONDS = 30.0
RUNC_TIMEOUT_SECONDS = 120.0
RELEASE_POLL_SECONDS = 0.05
#: How long the zygote is idle, with no start under way, before it makes the next spare
#: supervisor (``serve``): one forked while a start is under way would compete with it for
#: the CPU.
SPARE_IDLE_SECONDS = 0.05
#: The longest a start the zygote took counts as under way without the driver saying it
#: is over (``zygote.START_OVER``): a driver that never says gets its spares late, not never.
START_SECONDS = 10.0


class SupervisorError(Exception):
    """A step before the container ran failed; the message becomes the pod's reason."""


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def runc_error(runc_log: Path, fallback: str) -> str:
    """The last error runc logged (its JSON log), else ``fallback``."""
    try:
        lines = runc_log.read_text(errors="replace").splitlines()
    except OSError:
        return fallback
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
            return str(entry.get("msg", fallback))
    return fallback


def wait_exit(process: subprocess.Popen[Any], timeout: float) -> int:
    """Wait for ``process`` to end, at most ``timeout`` seconds (then kill it and raise
    TimeoutExpired); its exit status.

    ``Popen.wait(timeout)`` polls with sleeps growing to 50 ms, which a container start
    pays twice (runc create, runc start); a pidfd is readable the moment the process
    ends, so this returns at once. Kernels without pidfds (before 5.3) get the polling.
    """
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:
        return process.wait(timeout)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(timeout * 1000):  # EINTR is retried with the time left
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(process.args, timeout)
    finally:
        os.close(pidfd)
    return process.wait()


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once a process (the zygote loads it before it forks:
    ``warm``); a fresh ``CDLL`` took 0.3–0.4 ms of a forked supervisor's hand-over."""
    return ctypes.CDLL(None, use_errno=True)


def _loopback_up(pid: int) -> None:
    """Set ``lo`` up in the network namespace of ``pid`` (runc leaves it down).

    Done in a forked child so this process never leaves its own namespace.
    """
    child = os.fork()
    if child == 0:
        code = 1
        try:
            libc = _libc()
            namespace = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            if libc.setns(namespace, CLONE_NEWNET) == 0:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    request = struct.pack("16sH22x", b"lo", 0)
                    flags = struct.unpack("16sH22x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
                    fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        _log(f"could not bring up loopback in the network namespace of {pid}")


def has_private_network(config: dict[str, Any]) -> bool:
    """Whether a bundle's container (its ``config.json``) gets a network namespace of its
    own (only loopback, which runc leaves down): the driver asks of the config it built,
    and the supervisor of the bundle's file for a request that does not say
    (``--private-network``)."""
    namespaces = config.get("linux", {}).get("namespaces", [])
    return any(ns.get("type") == "network" and not ns.get("path") for ns in namespaces)


class Supervisor:
    def __init__(self, paths: ContainerPaths, runc: str, runc_root: Path, *,
                 pipe_log: bool = False, restore_from: Path | None = None,
                 private_network: bool | None = None) -> None:
        self.paths = paths
        #: Whether the container's network namespace is its own (None: not said, read
        #: from the bundle when needed: ``_private_network``).
        self.private_network = private_network
        self.pipe_log = pipe_log or restore_from is not None
        self.restore_from = restore_from
        self._relay: threading.Thread | None = None
        self.runc_command = [runc, "--root", str(runc_root), "--log", str(paths.runc_log),
                             "--log-format", "json"]
        self.container_pid: int | None = None
        #: ``runc run --detach`` instead of create, then start: one runc process fewer
        #: when nothing has to happen in between (see ``run``).
        self.at_once = False
        self.exited = False
        #: The stop request reached the container (SIGTERM sent, grace timer set).
        self.stop_applied = False
        self.stop_requested = False
        self.killed_after_grace = False
        self.cgroup_dir: Path | None = None

    # -- signals ------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for ignored in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(ignored, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, self._on_stop_request)
        signal.signal(signal.SIGALRM, self._on_grace_over)

    def _on_stop_request(self, _signum: int, _frame: FrameType | None) -> None:
        request = read_json(self.paths.stop_request) or {}
        grace = max(0.0, float(request.get("grace_seconds", DEFAULT_GRACE_SECONDS)))
        group = bool(request.get("group", False))
        self.stop_requested = True
        if self.container_pid is None or self.exited:
            return
        self.stop_applied = True
        _log(f"stop requested, grace {grace}s" + (", process group" if group else ""))
        if group:
            self._signal_all(signal.SIGTERM)
        else:
            os.kill(self.container_pid, signal.SIGTERM)
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        if remaining == 0 or grace < remaining:
            signal.setitimer(signal.ITIMER_REAL, max(grace, 0.001))

    def _signal_all(self, signum: int) -> None:
        """``signum`` to the container's PID 1, its process group and every process of its
        cgroup (children that made groups of their own included)."""
        pid = self.container_pid
        assert pid is not None
        targets = {pid}
        try:
            group = os.getpgid(pid)
            if group != os.getpgrp():
                os.killpg(group, signum)
        except ProcessLookupError:
            return
        if self.cgroup_dir is not None:
            try:
                procs = (self.cgroup_dir / "cgroup.procs").read_text().split()
                targets.update(int(p) for p in procs if p.isdigit())
            except OSError:
                pass  # cgroup v1 without the file, or gone: the group had it
        for target in targets:
            try:
                os.kill(target, signum)
            except ProcessLookupError:
                pass  # ended meanwhile

    def _on_grace_over(self, _signum: int, _frame: FrameType | None) -> None:
        if self.container_pid is not None and not self.exited:
            _log("grace period over, sending SIGKILL")
            self.killed_after_grace = True
            os.kill(self.container_pid, signal.SIGKILL)

    # -- runc ---------------------------------------------------------------------------

    def _runc(self, *args: str, log_fd: int | None = None, stdin_fd: int | None = None) -> None:
        output = log_fd if log_fd is not None else subprocess.DEVNULL
        stdin = stdin_fd if stdin_fd is not None else subprocess.DEVNULL
        try:
            with subprocess.Popen([*self.runc_command, *args], stdin=stdin,
                                  stdout=output, stderr=output) as runc:
                returncode = wait_exit(runc, RUNC_TIMEOUT_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SupervisorError(f"runc {args[0]} failed: {error}") from None
        if returncode != 0:
            fallback = f"runc {args[0]} exited with status {returncode}"
            raise SupervisorError(runc_error(self.paths.runc_log, fallback))

    def _create(self) -> int:
        """``runc create`` (or ``runc restore --detach`` from the dump); the new PID 1."""
        pid_file = self.paths.root / "container.pid"
        log_fd, stdin_fd = self._stdio()
        try:
            if self.restore_from is not None:
                self._runc("restore", "--detach", "--image-path", str(self.restore_from),
                           "--work-path", str(self.paths.root / "criu-restore"),
                           "--bundle", str(self.paths.root), "--pid-file", str(pid_file),
                           self.paths.container_id, log_fd=log_fd, stdin_fd=stdin_fd)
            else:
                verb = ["run", "--detach"] if self.at_once else ["create"]
                self._runc(*verb, "--bundle", str(self.paths.root), "--pid-file",
                           str(pid_file), self.paths.container_id, log_fd=log_fd,
                           stdin_fd=stdin_fd)
        finally:
            os.close(log_fd)
            if stdin_fd is not None:
                os.close(stdin_fd)
        return int(pid_file.read_text().strip())

    def _stdio(self) -> tuple[int, int | None]:
        """The container's stdout/stderr and stdin: the log file and /dev/null; with
        ``pipe_log`` a pipe copied into the log and a pipe at end of file (see the module)."""
        log_fd = os.open(self.paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        if not self.pipe_log:
            return log_fd, None
        read_end, write_end = os.pipe()
        self._relay = threading.Thread(target=_copy, args=(read_end, log_fd), daemon=True)
        self._relay.start()
        stdin_read, stdin_write = os.pipe()
        os.close(stdin_write)
        return write_end, stdin_read

    def _drain_relay(self) -> None:
        """Wait until the copy of the pipe has reached the log (every writer gone)."""
        if self._relay is not None:
            self._relay.join(timeout=5)

    # -- the container's life -----------------------------------------------------------

    def _wait_for_exit(self, pid: int) -> int | None:
        """Reap children until ``pid`` exits; its exit code (negative: killed by signal).

        ``waitid(WNOWAIT)`` peeks first so that ``exited`` is set before the pid is reaped
        and could be reused: the signal handlers never signal a recycled pid. None when
        ``pid`` is not our child (the subreaper could not be set): then only its end is known.
        """
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                while Path(f"/proc/{pid}").exists():
                    time.sleep(0.1)
                self.exited = True
                return None
            if info is None:
                continue
            if info.si_pid == pid:
                self.exited = True
                signal.setitimer(signal.ITIMER_REAL, 0)
            _, status = os.waitpid(info.si_pid, 0)
            if info.si_pid == pid:
                return os.waitstatus_to_exitcode(status)

    def _exit_record(
        self, code: int | None, started_at: float, memory_dir: Path | None
    ) -> dict[str, object]:
        killed_by = -code if code is not None and code < 0 else None
        return {
            "exit_code": 128 + killed_by if killed_by else code,
            "signal": killed_by,
            "oom_killed": oom_killed(memory_dir, killed_by == signal.SIGKILL),
            "stop_requested": self.stop_requested,
            "killed_after_grace": self.killed_after_grace,
            "checkpointed": self.paths.checkpointed.exists(),
            "started_at": started_at,
            "finished_at": time.time(),
            "error": None,
        }

    def _fail(self, message: str) -> None:
        _log(f"failed: {message}")
        now = time.time()
        write_json_atomic(self.paths.exit_record, {
            "exit_code": None, "signal": None, "oom_killed": False,
            "stop_requested": self.stop_requested, "killed_after_grace": False,
            "started_at": None, "finished_at": now, "error": message,
        })

    def _start(self, pid: int) -> None:
        """Start a created container, unless a stop arrived while it was being created.
        A restored one runs already (its namespace's loopback came back with it)."""
        if self.restore_from is not None:
            self._resume_gpus()
            return
        if self.at_once:  # ``runc run`` started it; a stop that came meanwhile applies now
            if self.stop_requested and not self.stop_applied:
                self._on_stop_request(signal.SIGUSR1, None)
            return
        if self._private_network():
            _loopback_up(pid)
        if self.stop_requested:
            os.kill(pid, signal.SIGKILL)
            return
        self._runc("start", self.paths.container_id)

    def _resume_gpus(self) -> None:
        """A container dumped with its CUDA processes suspended (``cuda_checkpoint``) gets
        them back on the GPU once restored; without the utility there is nothing to do (a
        GPU pod is placed for transparent checkpoints only where it is installed)."""
        binary = cuda_checkpoint.find_binary()
        if binary is None:
            return
        try:
            resumed = cuda_checkpoint.resume_restored(binary, self.runc_command,
                                                      self.paths.container_id)
        except RuncError as error:
            raise SupervisorError(f"restored, but its GPU state was not: {error}") from None
        if resumed:
            _log(f"resumed the GPU state of pids {resumed}")

    def _await_release(self) -> None:
        """Hold a created container until the agent releases it or a stop arrives.

        A file, not a signal, so that a release written while the agent restarts (or
        before this process looks) is never missed."""
        while not self.paths.start_release.exists() and not self.stop_requested:
            time.sleep(RELEASE_POLL_SECONDS)

    def run(self, report: int, gated: bool = False) -> int:
        """Create, start and wait for the container; ``report`` receives one status line
        (``created PID`` as soon as it is created when ``gated``, else ``started PID``)."""
        if _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            _log("cannot become a child subreaper; exit status will not be exact")
        self.install_signal_handlers()
        write_json_atomic(self.paths.supervisor_pid, os.getpid())
        # Created and started by one runc process unless something must happen between
        # the two: the start barrier, a restore, loopback of a private namespace (an
        # agent-made namespace has it up already).
        self.at_once = (not gated and self.restore_from is None
                        and not self._private_network())
        launched_at = time.time()
        mark("supervisor.runc.start", at_once=self.at_once)
        try:
            pid = self._create()
            mark("supervisor.runc.done")
        except SupervisorError as error:
            self._fail(str(error))
            self._delete()  # whatever runc left of a half-created container
            return self._report(report, f"error: {error}", 1)
        self.container_pid = pid
        memory_dir = memory_cgroup_dir(pid)
        self.cgroup_dir = memory_dir
        if gated:
            self._report(report, f"created {pid}", 0)
            report = -1  # the one status line went out: later ones are not written
            self._await_release()
        started_at = launched_at if self.at_once else time.time()
        try:
            self._start(pid)
        except SupervisorError as error:
            os.kill(pid, signal.SIGKILL)
            self._wait_for_exit(pid)
            self._fail(str(error))
            self._delete()
            return self._report(report, f"error: {error}", 1)
        write_json_atomic(self.paths.started, {
            "pid": pid, "started_at": started_at,
            "memory_cgroup": str(memory_dir) if memory_dir else None,
        })
        self._report(report, f"started {pid}", 0)
        code = self._wait_for_exit(pid)
        self._drain_relay()
        write_json_atomic(self.paths.exit_record, self._exit_record(code, started_at, memory_dir))
        _log(f"container exited with {code}")
        self._delete()
        return 0

    def _private_network(self) -> bool:
        """Whether loopback must be brought up between create and start: as the driver
        said (it built the bundle: no read of ``config.json`` on the hand-over, 0.6 ms in
        a spare, s44), else as the bundle says."""
        if self.private_network is None:
            self.private_network = has_private_network(json.loads(self.paths.config.read_text()))
        return self.private_network

    def _delete(self) -> None:
        try:
            self._runc("delete", "--force", self.paths.container_id)
        except SupervisorError as error:
            _log(f"runc delete failed: {error}")

    @staticmethod
    def _report(fd: int, line: str, code: int) -> int:
        """Write the one status line and close ``fd``; a second call writes nothing."""
        if fd < 0:
            return code
        try:
            os.write(fd, (line.replace("\n", " ") + "\n").encode())
            os.close(fd)
        except OSError:
            pass  # the agent stopped waiting; the files tell the same story
        return code


def _copy(source: int, target: int) -> None:
    """Copy a pipe into the log until every writer has closed it."""
    try:
        while data := os.read(source, 65536):
            os.write(target, data)
    except OSError as error:
        _log(f"copying the container's output stopped: {error}")
    finally:
        os.close(source)
        os.close(target)


def _detach(paths: ContainerPaths) -> None:
    """Become a session leader in the container's directory, with stdio on /dev/null and
    the supervisor log."""
    os.setsid()
    os.chdir(paths.root)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(paths.supervisor_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """Built once a process. The zygote builds it and parses a sample before it forks
    (``serve``), so that a spare or forked supervisor inherits it built, with argparse's
    gettext look-ups and regular expressions done: in a fresh fork, building and parsing
    took 2.3–3 ms of a warm start's hand-over to the supervisor, parsing with it warm
    0.8 ms (s42)."""
    parser = argparse.ArgumentParser(prog="gpucloud-supervisor")
    parser.add_argument("--runc", default="/usr/bin/runc")
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--gated", action="store_true",
                        help="report 'created' and wait for start.release before starting")
    parser.add_argument("--pipe-log", action="store_true",
                        help="stdio through pipes (a container that may be dumped with CRIU)")
    parser.add_argument("--restore", type=Path, default=None, metavar="IMAGE_DIR",
                        help="runc restore the container from this CRIU dump")
    parser.add_argument("--private-network", choices=("yes", "no"), default=None,
                        help="whether the container's network namespace is its own "
                             "(default: read from the bundle's config.json)")
    parser.add_argument("container_dir", type=Path)
    return parser


def _supervise(args: argparse.Namespace, report: int) -> int:
    """Become the container's supervisor (detached) and run it to its end."""
    paths = ContainerPaths(args.container_dir.resolve())
    _detach(paths)
    private = None if args.private_network is None else args.private_network == "yes"
    return Supervisor(paths, args.runc, args.root, pipe_log=args.pipe_log,
                      restore_from=args.restore,
                      private_network=private).run(report, gated=args.gated)


def serve(sock_fd: int) -> int:
    """The zygote: start supervisors on request without starting an interpreter each.

    The driver keeps one such process (``--zygote FD``), which has imported this module
    already. A request is one datagram on the socket ``FD`` (a JSON list: the arguments
    ``main`` takes) with the write end of a pipe attached; the supervisor writes its status
    line to the pipe. The zygote is single-threaded, so forking it is safe; it ignores the
    signals the supervisor ignores (the agent's process group may get them) and exits when
    the driver's end closes.

    A supervisor is nobody's child, as with ``main``: a fork whose parent exits at once.
    Once no start is under way and the zygote has been idle for ``SPARE_IDLE_SECONDS`` it
    makes one such process ahead (``_fork_spare``), which waits for the next request; that
    request is handed to it, so a start does not wait for two forks and a new process to
    be scheduled (a burst of starts forks the ones the spare cannot take, as before). The
    spare exits with the zygote (its socket closes). A start is under way from its request
    to the driver's datagram without a descriptor that says it is over (sent once the
    status line is in), at most ``START_SECONDS``: until s43 the spare was made 50 ms after
    the hand-over, in the middle of that start's ``runc`` (every traced warm start).
    """
    for ignored in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    _parser().parse_args(["--root", "/", "/"])  # built and warm in every fork: ``_parser``
    _libc()
    sock = socket.socket(fileno=sock_fd)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    spare: socket.socket | None = None
    starts = _Starts()
    while True:
        if spare is None and not poller.poll(starts.idle_wait() * 1000):
            if starts.settled():
                spare = _fork_spare(sock)
            continue
        message, fds, _flags, _address = socket.recv_fds(sock, 65536, 1)
        if not message:
            return 0
        if not fds:
            starts.over()  # the driver's ``START_OVER``
            continue
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        starts.began()
        if spare is not None:
            handed = _hand_over(spare, message, fds[0])
            spare.close()  # used, or dead: a new one is made when idle
            spare = None
            if handed:
                continue
        try:
            args = _parser().parse_args(json.loads(message))
        except (ValueError, SystemExit):  # argparse exits on bad arguments
            _report_error(fds[0], "error: bad supervisor request")
            continue
        _fork_supervisor(sock, args, fds[0])


class _Starts:
    """The starts the zygote took that its driver has not said are over (``serve``)."""

    def __init__(self) -> None:
        self._began: list[float] = []

    def began(self) -> None:
        self._began.append(time.monotonic())

    def over(self) -> None:
        if self._began:
            self._began.pop(0)

    def settled(self) -> bool:
        """No start under way (one older than ``START_SECONDS`` no longer counts)."""
        now = time.monotonic()
        self._began = [at for at in self._began if now - at < START_SECONDS]
        return not self._began

    def idle_wait(self) -> float:
        """How long to wait for a request before looking again: ``SPARE_IDLE_SECONDS``,
        or, while a start is under way, until the oldest stops counting."""
        if not self._began:
            return SPARE_IDLE_SECONDS
        return max(SPARE_IDLE_SECONDS, self._began[0] + START_SECONDS - time.monotonic())


def _hand_over(spare: socket.socket, message: bytes, report: int) -> bool:
    """Give a request to the spare supervisor; False (the report pipe still ours) when
    the spare is gone."""
    try:
        socket.send_fds(spare, [message], [report])
    except OSError:
        return False
    os.close(report)  # the spare holds its own copy now
    return True


def _fork_spare(sock: socket.socket) -> socket.socket | None:
    """A supervisor made ahead: detached like any other (its parent exits at once), it
    waits on the socket returned for one request (``_spare``). None when it cannot fork
    (requests are then forked for as before)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mark("zygote.spare.fork")
    try:
        child = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if child == 0:
        code = 1
        try:
            sock.close()
            ours.close()
            if os.fork() == 0:
                code = _spare(theirs)
            else:
                code = 0
        finally:
            os._exit(code)  # never back into the zygote's loop
    theirs.close()
    os.waitpid(child, 0)
    return ours


def _spare(sock: socket.socket) -> int:
    """The spare's life: one request (the zygote's, as it came), then that supervisor's;
    none (the zygote closed the socket: it exits, or the spare was not needed): exit."""
    _settle_in()
    try:
        message, fds, _flags, _address = socket.recv_fds(sock, 65536, 1)
    except OSError:
        return 0
    sock.close()
    if not message or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return 0
    try:
        args = _parser().parse_args(json.loads(message))
    except (ValueError, SystemExit):  # argparse exits on bad arguments
        _report_error(fds[0], "error: bad supervisor request")
        return 1
    return _supervise(args, fds[0])


def _settle_in() -> None:
    """Take the spare's own copy of the zygote's heap while it waits, not during a start.

    A fork shares its parent's pages until it writes them, and CPython writes every object
    it touches (reference counts, the collector's header), so the spare's first steps
    with a request copied page after page: ~490 page faults from the request to ``runc``'s
    spawn, measured in a fork of a warm zygote. One collection walks every tracked object
    and so copies most of those pages ahead (~220 faults left); the request's parse, its
    bookkeeping and the spawn of ``runc`` then took 4.0 → 3.0 ms and 0.94 → 0.71 ms
    (medians of 40 forks at load 4, s44). The spare is made only between starts, so this
    runs while no start waits for it."""
    gc.collect()


def _report_error(report: int, line: str) -> None:
    os.write(report, (line + "\n").encode())
    os.close(report)


def _fork_supervisor(sock: socket.socket, args: argparse.Namespace, report: int) -> None:
    try:
        child = os.fork()
    except OSError as error:
        _report_error(report, f"error: cannot start a supervisor: {error}")
        return
    if child == 0:
        code = 1
        try:
            sock.close()
            if os.fork() == 0:
                code = _supervise(args, report)
            else:
                code = 0
        finally:
            os._exit(code)  # never back into the zygote's loop
    os.close(report)
    os.waitpid(child, 0)


def main(argv: list[str] | None = None) -> int:
    """Fork the supervisor into the background; print its first status line and exit.

    The agent waits for this short-lived parent, so the supervisor itself is never the
    agent's child (no zombie when it ends, no death when the agent goes). ``--zygote FD``
    serves such starts from one process instead (see ``serve``).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--zygote"] and len(argv) == 2:
        return serve(int(argv[1]))
    args = _parser().parse_args(argv)
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            line = pipe.read().decode(errors="replace").strip()
        print(line or "error: supervisor ended without reporting")
        return 0 if line.startswith(("started", "created")) else 1
    os.close(read_end)
    return _supervise(args, write_end)


if __name__ == "__main__":
    sys.exit(main())
