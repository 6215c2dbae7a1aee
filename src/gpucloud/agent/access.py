"""The agent's access server: the SSH-2 server the control plane's gateway gets into pods by.

An asyncssh server on its own event loop, in a daemon thread of the agent. The only
clients are the server's gateways: public-key auth against the keys the registration
response lists (``set_gateway_keys``), and the SSH user name is the pod id, accepted only
while this agent runs that pod's current container. Per channel:

* session ``exec`` → ``/bin/sh -c COMMAND`` through ``runc exec`` (pipes, or a PTY);
  ``shell`` → a login shell (bash if the image has it, else sh); ``pty-req`` gives
  ``runc exec --tty`` a pty of ours, and ``window-change`` resizes it and sends runc the
  SIGWINCH that makes it resize the container's console; ``env`` TERM/LANG/LC_* pass on;
  the exit status (or signal) comes back;
* session ``subsystem sftp`` → ``python -m gpucloud.agent.sftpserver`` chrooted into the
  container's ``/proc/<pid>/root`` as the container's user (``sftpserver``);
* ``direct-tcpip`` to localhost / 127.0.0.1 / ::1 → that loopback address inside the pod's
  own network namespace (``netns`` of ``containers/<cid>/network.json``, connected by
  agent/netns, so services bound to the pod's 127.0.0.1 are reached); to the pod's IP →
  the pod's IP; with host networking → 127.0.0.1; nothing else;
* user ``volume-<pod id>`` (another node fetching a migrating pod's volume disk, with the
  key the server named for it) → only the volume export of agent/migration.

A client that goes away mid-session takes its process along: runc cannot forward SIGKILL,
so the process inside (its pid from ``runc exec --pid-file``) is killed with its process
group, and runc after it. An error in one session ends that session, never the server.
Commands, environment values and file names are never logged.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import struct
import sys
import termios
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import asyncssh
from typing_extensions import override

from gpucloud.agent import netns
from gpucloud.agent.connection import AgentFailure
from gpucloud.agent.migration import VolumeExports, exported_pod, serve_export
from gpucloud.agent.podworker import parse_container_id
from gpucloud.core.errors import GpucloudError
from gpucloud.core.sshutil import PublicKeyOnlyServer, env_passes, load_or_create_key
from gpucloud.runtime.driver import ContainerState, RuncDriver
from gpucloud.runtime.layout import read_json

log = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 5.0
#: After the process exits, how long its output may still drain before the channel closes
#: (a background job may hold stdout open for ever).
DRAIN_SECONDS = 1.0
#: After the process inside is killed, how long runc gets to notice before it is killed too.
KILL_GRACE_SECONDS = 2.0
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
SHELL = ("/bin/sh", "-c",
         "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi")


@dataclass(frozen=True)
class PodContainer:
    """The running container a pod's sessions go to."""

    pod_id: str
    container_id: str
    pid: int


#: pod id -> its current running container on this agent, or None.
PodLookup = Callable[[str], PodContainer | None]


def running_container(driver: RuncDriver, container_ids: Iterable[str],
                      pod_id: str) -> PodContainer | None:
    """The pod's newest attempt among ``container_ids`` if it is running, else None."""
    attempts = [(parsed[1], cid) for cid in container_ids
                if (parsed := parse_container_id(cid)) is not None and parsed[0] == pod_id]
    if not attempts:
        return None
    _, cid = max(attempts)
    try:
        status = driver.status(cid)
    except (GpucloudError, OSError, ValueError):  # removed meanwhile, or unreadable
        return None
    if status.state is not ContainerState.RUNNING or status.pid is None:
        return None
    return PodContainer(pod_id, cid, status.pid)


# -- keys ----------------------------------------------------------------------------------

def parse_gateway_keys(lines: Iterable[str]) -> frozenset[bytes]:
    """The public key blobs of OpenSSH key lines; lines that do not parse are skipped."""
    blobs = set()
    for line in lines:
        try:
            blobs.add(asyncssh.import_public_key(line.strip()).public_data)
        except (asyncssh.KeyImportError, ValueError):
            log.warning("ignoring a gateway public key that does not parse")
    return frozenset(blobs)


def _read_lines(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


# -- what a session needs to know about its container ----------------------------------

def pod_addresses(driver: RuncDriver, container_id: str) -> tuple[str, set[str]]:
    """Where the pod's ports are (its own address, or loopback with host networking), and
    the destination names that mean the pod: loopback names and its recorded address."""
    document = read_json(driver.paths(container_id).root / "network.json")
    recorded = str(document.get("ip") or "") if isinstance(document, dict) else ""
    own = isinstance(document, dict) and not document.get("host_network") and recorded
    address = recorded if own else "127.0.0.1"
    return address, {*LOCAL_NAMES, address, *([recorded] if recorded else [])}


def pod_netns(driver: RuncDriver, container_id: str) -> str | None:
    """The pod's own network namespace (``netns`` of network.json), None with host
    networking: where its loopback-only services are reached from."""
    document = read_json(driver.paths(container_id).root / "network.json")
    if not isinstance(document, dict) or document.get("host_network"):
        return None
    return str(document["netns"]) if document.get("netns") else None


def _status_ids(pid: int) -> tuple[int, int, tuple[int, ...]]:
    """The process's effective uid, gid and supplementary groups."""
    fields: dict[str, list[str]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return (int(fields["Uid"][1]), int(fields["Gid"][1]),
            tuple(int(g) for g in fields.get("Groups", [])))


def sftp_command(driver: RuncDriver, target: PodContainer, python: str) -> list[str]:
    """The SFTP child for a pod: chrooted into its root as its user, in its working dir."""
    uid, gid, groups = _status_ids(target.pid)
    config = read_json(driver.paths(target.container_id).config) or {}
    process = config.get("process") or {}
    env = dict(item.partition("=")[::2] for item in process.get("env") or [])
    return [python, "-m", "gpucloud.agent.sftpserver", "--uid", str(uid), "--gid", str(gid),
            "--groups", ",".join(map(str, groups)), "--cwd", str(process.get("cwd") or "/"),
            "--home", env.get("HOME") or "/", f"/proc/{target.pid}/root"]


def passed_env(requested: dict[str, str], term_type: str | None) -> dict[str, str]:
    """The client's environment that reaches the process: TERM, LANG and LC_*."""
    env = {key: value for key, value in requested.items() if env_passes(key)}
    if term_type:
        env["TERM"] = term_type
    return env


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name.removeprefix("SIG")
    except ValueError:
        return "KILL"


def _parent_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# -- the child process of one session -----------------------------------------------------

class _ChildProtocol(asyncio.SubprocessProtocol):
    def __init__(self, session: PodSession) -> None:
        self.session = session

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        self.session.output(fd, bytes(data) if isinstance(data, bytes) else data.encode())

    @override
    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd in (1, 2):
            self.session.output_closed(fd)

    def process_exited(self) -> None:
        self.session.child_exited()

    def pause_writing(self) -> None:
        self.session.pause_input()

    def resume_writing(self) -> None:
        self.session.resume_input()


class _MasterReader(asyncio.Protocol):
    """The pty master's output side (EIO once the last slave is closed ends it)."""

    def __init__(self, session: PodSession) -> None:
        self.session = session

    def data_received(self, data: bytes) -> None:
        self.session.output(1, data)

    @override
    def connection_lost(self, exc: Exception | None) -> None:
        self.session.output_closed(1)


class _MasterWriter(asyncio.BaseProtocol):
    def __init__(self, session: PodSession) -> None:
        self.session = session

    def pause_writing(self) -> None:
        self.session.pause_input()

    def resume_writing(self) -> None:
        self.session.resume_input()


class PodSession(asyncssh.SSHServerSession[bytes]):
    """One session channel: its requests, its child process, and the bytes between them."""

    def __init__(self, access: AccessServer, pod_id: str) -> None:
        self.access = access
        self.pod_id = pod_id
        self.chan: asyncssh.SSHServerChannel[bytes] | None = None
        self.term_type: str | None = None
        self.term_size = (80, 24, 0, 0)
        self.command: str | None = None
        self.subsystem: str | None = None
        self.process: asyncio.SubprocessTransport | None = None
        self.stdin: asyncio.WriteTransport | None = None
        self.readers: list[asyncio.ReadTransport] = []
        self.master: int | None = None
        self.pid_file: Path | None = None
        self.process_file: Path | None = None
        self.open_outputs: set[int] = set()
        self.exited = False
        self.finished = False
        self.gone = False
        self.eof_pending = False
        self.pending: list[bytes] = []

    # -- asyncssh callbacks ------------------------------------------------------------

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        self.chan = chan

    @override
    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int],
                      term_modes: Any) -> bool:
        self.term_type = term_type or "xterm"
        if term_size[0] and term_size[1]:
            self.term_size = term_size
        return True

    def shell_requested(self) -> bool:
        return True

    def exec_requested(self, command: str) -> bool:
        self.command = command
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem != "sftp":
            return False
        self.subsystem = subsystem
        return True

    def session_started(self) -> None:
        assert self.chan is not None
        self.chan.pause_reading()  # until the child is there to take stdin
        task = asyncio.get_running_loop().create_task(self._start())
        self.access.track(task)

    @override
    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if self.stdin is None:
            self.pending.append(data)  # sent before the child was there
        elif not self.stdin.is_closing():
            self.stdin.write(data)

    def eof_received(self) -> bool:
        if self.master is None and self.stdin is not None:
            self.stdin.write_eof()
        elif self.stdin is None:
            self.eof_pending = True
        return True  # keep sending output

    def pause_writing(self) -> None:
        for reader in self.readers:
            if not reader.is_closing():
                reader.pause_reading()

    def resume_writing(self) -> None:
        for reader in self.readers:
            if not reader.is_closing():
                reader.resume_reading()

    def terminal_size_changed(self, width: int, height: int, pixwidth: int,
                              pixheight: int) -> None:
        self.term_size = (width, height, pixwidth, pixheight)
        if self.master is not None:
            self._set_size(self.master)
            self._signal_child(signal.SIGWINCH)

    def signal_received(self, signal_name: str) -> None:
        try:
            number = signal.Signals[f"SIG{signal_name}"]
        except KeyError:
            return
        if number == signal.SIGKILL:
            self._kill_inner()
        else:
            self._signal_child(number)

    @override
    def break_received(self, msec: int) -> bool:
        return False

    @override
    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self.process is not None and not self.exited:
            self.access.track(asyncio.get_running_loop().create_task(self._terminate()))
        elif not self.finished:
            self._close_child()

    # -- starting ----------------------------------------------------------------------

    async def _start(self) -> None:
        assert self.chan is not None
        try:
            target = await asyncio.to_thread(self.access.lookup, self.pod_id)
            if target is None:
                raise _Refused("the pod is not running on this node")
            argv = await asyncio.to_thread(self._argv, target)
            if self.gone:
                return
            await self._spawn(argv)
        except _Refused as refused:
            self._fail(str(refused))
            return
        except (GpucloudError, OSError, ValueError, LookupError) as error:
            log.warning("pod %s: cannot start a session: %s", self.pod_id,
                        type(error).__name__)
            self._fail("cannot start the session in the pod")
            return
        if self.gone:
            await self._terminate()
            return
        self._flush_pending()
        self.chan.resume_reading()

    def _flush_pending(self) -> None:
        assert self.stdin is not None
        for data in self.pending:
            self.stdin.write(data)
        self.pending = []
        if self.eof_pending and self.master is None:
            self.stdin.write_eof()

    def _argv(self, target: PodContainer) -> list[str]:
        driver = self.access.driver
        if self.subsystem == "sftp":
            return sftp_command(driver, target, self.access.python)
        argv = ["/bin/sh", "-c", self.command] if self.command is not None else list(SHELL)
        assert self.chan is not None
        tty = self.term_type is not None
        env = passed_env(dict(self.chan.get_environment()), self.term_type)
        process = driver.exec_process(target.container_id, argv, tty=tty, env=env,
                                      console_size=self.term_size[:2])
        name = uuid.uuid4().hex
        self.pid_file = self.access.run_dir / f"{name}.pid"
        self.process_file = self.access.run_dir / f"{name}.json"
        fd = os.open(self.process_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(process, file)
        return driver.exec_command(target.container_id, argv, tty=tty, pid_file=self.pid_file,
                                   process_file=self.process_file)

    async def _spawn(self, argv: list[str]) -> None:
        loop = asyncio.get_running_loop()
        if self.term_type is not None and self.subsystem is None:
            await self._spawn_pty(loop, argv)
            return
        self.open_outputs = {1, 2}
        self.process, _ = await loop.subprocess_exec(
            lambda: _ChildProtocol(self), *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, cwd="/")
        stdin = self.process.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        self.stdin = stdin
        self.readers = [t for fd in (1, 2) if isinstance(
            t := self.process.get_pipe_transport(fd), asyncio.ReadTransport)]

    async def _spawn_pty(self, loop: asyncio.AbstractEventLoop, argv: list[str]) -> None:
        """runc ``--tty`` on a pty of ours: runc relays it to the container's console."""
        master, slave = os.openpty()
        self.master = master
        self._set_size(master)
        self.open_outputs = {1}
        try:
            self.process, _ = await loop.subprocess_exec(
                lambda: _ChildProtocol(self), *argv, stdin=slave, stdout=slave, stderr=slave,
                start_new_session=True, cwd="/")
        finally:
            os.close(slave)
        reader, _ = await loop.connect_read_pipe(lambda: _MasterReader(self),
                                                 os.fdopen(os.dup(master), "rb", buffering=0))
        writer, _ = await loop.connect_write_pipe(lambda: _MasterWriter(self),
                                                  os.fdopen(os.dup(master), "wb", buffering=0))
        self.readers = [reader]
        self.stdin = writer

    def _set_size(self, fd: int) -> None:
        width, height, pixwidth, pixheight = self.term_size
        try:
            fcntl.ioctl(fd, termios.TIOCSWINSZ,
                        struct.pack("HHHH", height, width, pixwidth, pixheight))
        except OSError:
            pass  # the pty is gone: the session is ending

    def _fail(self, message: str) -> None:
        if self.chan is None or self.gone:
            return
        self.finished = True
        try:
            self.chan.write_stderr(f"{message}\r\n".encode())
            self.chan.exit(255)
        except (OSError, asyncssh.Error):
            pass

    # -- running -----------------------------------------------------------------------

    def output(self, fd: int, data: bytes) -> None:
        if self.chan is None or self.gone or self.finished:
            return
        try:
            if fd == 2:
                self.chan.write_stderr(data)
            else:
                self.chan.write(data)
        except (BrokenPipeError, asyncssh.Error):
            pass

    def output_closed(self, fd: int) -> None:
        self.open_outputs.discard(fd)
        self._maybe_finish()

    def child_exited(self) -> None:
        self.exited = True
        self._maybe_finish()
        if not self.finished:
            asyncio.get_running_loop().call_later(DRAIN_SECONDS, self._finish)

    def pause_input(self) -> None:
        if self.chan is not None and not self.gone:
            self.chan.pause_reading()

    def resume_input(self) -> None:
        if self.chan is not None and not self.gone:
            self.chan.resume_reading()

    def _signal_child(self, number: int) -> None:
        if self.process is not None and not self.exited:
            try:
                os.kill(self.process.get_pid(), number)
            except ProcessLookupError:
                pass

    def _maybe_finish(self) -> None:
        if self.exited and not self.open_outputs:
            self._finish()

    def _finish(self) -> None:
        """Send the exit status and close the channel (once)."""
        if self.finished:
            return
        self.finished = True
        code = self.process.get_returncode() if self.process is not None else None
        if self.chan is not None and not self.gone:
            try:
                if code is not None and code < 0:
                    self.chan.exit_with_signal(_signal_name(code))
                else:
                    self.chan.exit(code if code is not None else 255)
            except (OSError, asyncssh.Error):
                pass
        self._close_child()

    def _close_child(self) -> None:
        for transport in (*self.readers, self.stdin):
            if transport is not None:
                transport.close()
        self.readers, self.stdin = [], None
        if self.process is not None and self.exited:
            self.process.close()
        if self.master is not None:
            os.close(self.master)
            self.master = None
        for path in (self.pid_file, self.process_file):
            if path is not None:
                path.unlink(missing_ok=True)

    # -- ending early ------------------------------------------------------------------

    def _kill_inner(self) -> bool:
        """SIGKILL the process inside the container (and its group); True if it was found."""
        if self.process is None or self.pid_file is None:
            return False
        try:
            inner = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return False
        if _parent_of(inner) != self.process.get_pid():
            return False  # not (or no longer) the process runc started
        try:
            if os.getpgid(inner) == inner:
                os.killpg(inner, signal.SIGKILL)
            else:
                os.kill(inner, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    async def _terminate(self) -> None:
        """The client went away: end the child (runc and what it runs), then clean up."""
        if self.process is None:
            return
        if self.exited:
            self._finish()
            return
        if self.pid_file is None and self.stdin is not None:
            self.stdin.close()  # the SFTP child: end of input lets it finish on its own
        elif not self._kill_inner():
            self._signal_child(signal.SIGKILL)
        deadline = asyncio.get_running_loop().time() + KILL_GRACE_SECONDS
        while not self.exited and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if not self.exited:
            self._signal_child(signal.SIGKILL)
            while not self.exited:
                await asyncio.sleep(0.05)
        self._finish()


class _Refused(Exception):
    """A session that cannot start: the message goes to the client's stderr."""


# -- connections ---------------------------------------------------------------------------

_Handler = Callable[[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes],
                     asyncssh.SSHWriter[bytes]], Awaitable[None]]


class _GatewayConnection(PublicKeyOnlyServer):
    """One SSH connection from a gateway, for one pod (its user name)."""

    def __init__(self, access: AccessServer) -> None:
        self.access = access
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        self.access.connections.add(conn)

    @override
    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.access.connections.discard(self.conn)

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        exported = exported_pod(username)
        if exported is not None:  # another node fetching a migrating pod's volume disk
            exports = self.access.exports
            return exports is not None and exports.allows(exported, key.public_data)
        if key.public_data not in self.access.authorized:
            return False
        return await asyncio.to_thread(self.access.lookup, username) is not None

    def _username(self) -> str:
        assert self.conn is not None
        return str(self.conn.get_extra_info("username"))

    def session_requested(self) -> (tuple[asyncssh.SSHServerChannel[bytes], PodSession]
                                    | tuple[asyncssh.SSHServerChannel[bytes], _Handler]):
        assert self.conn is not None
        channel = self.conn.create_server_channel(encoding=None)
        exported = exported_pod(self._username())
        if exported is not None and self.access.exports is not None:
            return channel, partial(serve_export, self.access.exports, exported)
        return channel, PodSession(self.access, self._username())

    @override
    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str,
                             orig_port: int) -> Any:
        return self._forward(dest_host, dest_port)

    async def _forward(self, dest_host: str, dest_port: int) -> asyncssh.SSHForwarder:
        assert self.conn is not None
        target = await asyncio.to_thread(self.access.lookup, self._username())
        if target is None:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED,
                                            "the pod is not running on this node")
        address, allowed = await asyncio.to_thread(pod_addresses, self.access.driver,
                                                   target.container_id)
        if dest_host.lower() not in allowed:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
                                            "only the pod's own ports can be reached")
        namespace = await asyncio.to_thread(pod_netns, self.access.driver, target.container_id)
        if namespace is not None and dest_host.lower() in LOCAL_NAMES:
            return await _forward_in(namespace, "::1" if dest_host == "::1" else "127.0.0.1",
                                     dest_port)
        return await self.conn.forward_connection(address, dest_port)


async def _forward_in(namespace: str, host: str, port: int) -> asyncssh.SSHForwarder:
    """A forward to the pod's own loopback: the socket is connected inside its namespace
    (agent/netns), so services listening on 127.0.0.1 only are reached too."""
    try:
        sock = await netns.open_in(namespace, host, port)
    except OSError as error:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED,
                                        error.strerror or str(error)) from None
    _, peer = await asyncio.get_running_loop().create_connection(asyncssh.SSHForwarder,
                                                                 sock=sock)
    return asyncssh.SSHForwarder(peer)


# -- the server ----------------------------------------------------------------------------

class AccessServer:
    """Owns the event loop thread, the listener, the host key and the authorized keys."""

    def __init__(self, driver: RuncDriver, lookup: PodLookup, *, host_key_path: Path,
                 host: str = "127.0.0.1", port: int = 0, python: str = sys.executable,
                 keys_path: Path | None = None, exports: VolumeExports | None = None) -> None:
        self.driver = driver
        self.lookup = lookup
        #: Volume disks other nodes may fetch (``volume-<pod id>`` logins; agent/migration).
        self.exports = exports
        self.host = host
        self.port = port
        self.python = python
        self.host_key = load_or_create_key(host_key_path)
        #: The last gateway keys, kept for a start that resumes with the saved node token
        #: (no registration response then).
        self.keys_path = keys_path
        self.authorized = parse_gateway_keys(_read_lines(keys_path))
        self.run_dir = driver.state_dir / "access"
        self.connections: set[asyncssh.SSHServerConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self.bound_port: int | None = None

    @property
    def host_public_key(self) -> str:
        """The host key as one OpenSSH line (``ssh-ed25519 AAAA...``)."""
        return self.host_key.export_public_key("openssh").decode().strip()

    @property
    def endpoint(self) -> str:
        if self.bound_port is None:
            raise AgentFailure("the access server is not listening")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.bound_port}"

    def set_gateway_keys(self, lines: Sequence[str]) -> None:
        """Replace the keys that may log in (the registration response's gateway keys)."""
        self.authorized = parse_gateway_keys(lines)
        if self.keys_path is not None:
            temporary = self.keys_path.with_name(f".{self.keys_path.name}.tmp")
            temporary.write_text("".join(f"{line.strip()}\n" for line in lines))
            temporary.replace(self.keys_path)

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> str:
        """Listen (in a thread of its own); returns the ``host:port`` endpoint."""
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
        self.run_dir.mkdir(mode=0o700, exist_ok=True)
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(_log_loop_error)
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="access", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), loop)
        try:
            self.bound_port = future.result(START_TIMEOUT_SECONDS)
        except OSError as error:
            self.stop()
            raise AgentFailure(f"cannot listen for pod access on {self.host}:{self.port}: "
                               f"{error.strerror or error}") from None
        log.info("pod access server listening on %s", self.endpoint)
        return self.endpoint

    async def _listen(self) -> int:
        self._acceptor = await asyncssh.create_server(
            lambda: _GatewayConnection(self), self.host, self.port,
            server_host_keys=[self.host_key], encoding=None, line_editor=False,
            allow_scp=False, x11_forwarding=False, agent_forwarding=False,
            password_auth=False, kbdint_auth=False, gss_host=None,
            keepalive_interval=30, login_timeout=30)
        return self._acceptor.get_port()

    def stop(self) -> None:
        """Close the listener and every connection (their processes end); stop the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._close(), loop)
            try:
                future.result(STOP_TIMEOUT_SECONDS + 1)
            except TimeoutError:
                log.warning("pod sessions did not all end in time")
            loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_SECONDS)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    async def _close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
        for conn in list(self.connections):
            conn.close()
        deadline = asyncio.get_running_loop().time() + STOP_TIMEOUT_SECONDS
        while (self.tasks or self.connections) and \
                asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Errors escaping a callback end that callback's session, never the server."""
    del loop
    error = context.get("exception")
    log.warning("pod access: %s%s", context.get("message", "error"),
                f" ({type(error).__name__})" if error is not None else "")

