"""The SSH gateway: a real SSH-2 server (asyncssh) where users log in to their pods.

``ssh -p 2222 <pod>@server``: the user name is a pod id, RunPod's ``<pod-id>-<suffix>``, or
a pod name; the key must be one of the SSH keys of that pod's project (a key reaches only
the pods of the projects that hold it). Each session channel is relayed to a session
channel on the pod's upstream connection (see upstream.py): exec, shell, PTY with its
size and resizes, ``env``, the ``sftp`` subsystem (so scp and sftp work), signals, EOF in
both directions and the exit status or signal. ``direct-tcpip`` (``ssh -L``) is tunnelled
to the pod. A pod that is not running gets one line on stderr and exit status 1.

Flow control is end to end: when one side's send window is full, reading on the other
side pauses, so a fast uploader never piles data up in the gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import cast

import asyncssh
from asyncssh.channel import SSHChannel
from asyncssh.misc import TermModes, TermSize

from gpucloud.access import keys, upstream
from gpucloud.core.errors import GpucloudError
from gpucloud.core.sshutil import PublicKeyOnlyServer, env_passes
from gpucloud.services import auth_guard, ratelimit
from gpucloud.services.access import PodTarget, pod_target, ssh_login
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
LOGIN_TIMEOUT_SECONDS = 60
KEEPALIVE_SECONDS = 30
_CHANNEL_WINDOW = 8 * 1024 * 1024


def _passed_env(env: Mapping[str, str]) -> dict[bytes | str, bytes | str]:
    """What the agent passes on anyway: sending the rest would only be dropped there."""
    return {k: v for k, v in env.items() if env_passes(k)}


def _quietly(action: Callable[[], object]) -> None:
    """Do ``action`` on a channel that the other side may already have closed."""
    try:
        action()
    except (BrokenPipeError, OSError, asyncssh.Error):
        pass


class _UpstreamSession(asyncssh.SSHClientSession[bytes]):
    """The agent's side of a relayed session: writes what the pod sends to the user."""

    def __init__(self, down: asyncssh.SSHServerChannel[bytes]) -> None:
        self._down = down
        self._status: int | None = None
        self._signal: tuple[str, bool, str, str] | None = None

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            _quietly(lambda: self._down.write_stderr(data))
        else:
            _quietly(lambda: self._down.write(data))

    def eof_received(self) -> bool:
        _quietly(self._down.write_eof)
        return True  # stay half open: the exit status follows

    def exit_status_received(self, status: int) -> None:
        self._status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str,
                             lang: str) -> None:
        self._signal = (signal, core_dumped, msg, lang)

    def pause_writing(self) -> None:
        _quietly(self._down.pause_reading)

    def resume_writing(self) -> None:
        _quietly(self._down.resume_reading)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._signal is not None:
            signal, core, msg, lang = self._signal
            _quietly(lambda: self._down.exit_with_signal(signal, core, msg, lang))
        elif self._status is not None:
            status = self._status
            _quietly(lambda: self._down.exit(status))
        else:
            if exc is not None:
                _quietly(lambda: self._down.write_stderr(
                    f"gpucloud: connection to the pod lost: {exc}\r\n".encode()))
            _quietly(lambda: self._down.exit(255))


class _GatewaySession(asyncssh.SSHServerSession[bytes]):
    """The user's side of a relayed session; opens its twin on the agent once started."""

    def __init__(self, ctx: ServiceContext, login: PodTarget) -> None:
        self._ctx = ctx
        self._login = login
        self._chan: asyncssh.SSHServerChannel[bytes] | None = None
        self._up: asyncssh.SSHClientChannel[bytes] | None = None
        self._command: str | None = None
        self._subsystem: str | None = None
        self._pending: list[bytes] = []
        self._eof_pending = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, chan: SSHChannel[bytes]) -> None:
        self._chan = cast(asyncssh.SSHServerChannel[bytes], chan)

    def pty_requested(self, term_type: str, term_size: TermSize,
                      term_modes: TermModes) -> bool:
        del term_type, term_size, term_modes  # read back from the channel at start
        return True

    def shell_requested(self) -> bool:
        return True

    def exec_requested(self, command: str) -> bool:
        self._command = command
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        self._subsystem = subsystem
        return subsystem == "sftp"

    def session_started(self) -> None:
        assert self._chan is not None
        self._chan.pause_reading()  # until the upstream session is open
        self._task = asyncio.ensure_future(self._start())
        self._task.add_done_callback(self._start_done)

    def _start_done(self, task: asyncio.Task[None]) -> None:
        """A bug in ``_start`` must end the session, not leave the user hanging."""
        if task.cancelled() or task.exception() is None or self._chan is None:
            return
        log.error("gateway session failed to start", exc_info=task.exception())
        chan = self._chan
        _quietly(lambda: chan.write_stderr(b"gpucloud: internal error in the gateway\r\n"))
        _quietly(lambda: chan.exit(255))

    async def _start(self) -> None:
        chan = self._chan
        assert chan is not None
        try:
            target = await asyncio.to_thread(pod_target, self._ctx, self._login.project_id,
                                             self._login.pod_id)
            up, _ = await upstream.with_connection(self._ctx, target, self._open_upstream)
        except (GpucloudError, asyncssh.ChannelOpenError) as error:
            message = error.message if isinstance(error, GpucloudError) else error.reason
            end = "\r\n" if chan.get_terminal_type() else "\n"
            _quietly(lambda: chan.write_stderr(f"{message}{end}".encode()))
            _quietly(lambda: chan.exit(1))
            return
        if self._closed:
            up.close()
            return
        self._up = up
        for data in self._pending:
            _quietly(partial(up.write, data))
        self._pending.clear()
        if self._eof_pending:
            _quietly(up.write_eof)
        _quietly(chan.resume_reading)

    async def _open_upstream(self, connection: asyncssh.SSHClientConnection
                             ) -> tuple[asyncssh.SSHClientChannel[bytes],
                                        asyncssh.SSHClientSession[bytes]]:
        chan = self._chan
        assert chan is not None
        term_type = chan.get_terminal_type()
        width, height, pixwidth, pixheight = chan.get_terminal_size()
        result: tuple[asyncssh.SSHClientChannel[bytes], asyncssh.SSHClientSession[bytes]] = (
            await connection.create_session(
                lambda: _UpstreamSession(chan), self._command,
                subsystem=self._subsystem, env=_passed_env(chan.get_environment()),
                request_pty=bool(term_type), term_type=term_type,
                term_size=(width, height, pixwidth, pixheight) if term_type else None,
                term_modes=chan.get_terminal_modes() if term_type else None,
                encoding=None, window=_CHANNEL_WINDOW))
        return result

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        del datatype  # a client only sends stdin
        if self._up is not None:
            up = self._up
            _quietly(lambda: up.write(data))
        else:  # sent before the session started (an SFTP init): kept until upstream is open
            self._pending.append(data)

    def eof_received(self) -> bool:
        if self._up is not None:
            _quietly(self._up.write_eof)
        else:
            self._eof_pending = True
        return True

    def terminal_size_changed(self, width: int, height: int, pixwidth: int,
                              pixheight: int) -> None:
        if self._up is not None:
            up = self._up
            _quietly(lambda: up.change_terminal_size(width, height, pixwidth, pixheight))

    def signal_received(self, signal: str) -> None:
        if self._up is not None:
            up = self._up
            _quietly(lambda: up.send_signal(signal))

    def break_received(self, msec: int) -> bool:
        if self._up is not None:
            up = self._up
            _quietly(lambda: up.send_break(msec))
        return True

    def pause_writing(self) -> None:
        if self._up is not None:
            _quietly(self._up.pause_reading)

    def resume_writing(self) -> None:
        if self._up is not None:
            _quietly(self._up.resume_reading)

    def connection_lost(self, exc: Exception | None) -> None:
        """The user went away (perhaps mid-transfer): close the pod's side too."""
        del exc
        self._closed = True  # a _start still opening the upstream closes it when done
        if self._up is not None:
            self._up.close()


class GatewayServer(PublicKeyOnlyServer):
    """One user connection: public-key auth against the project's keys, then channels."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._conn: asyncssh.SSHServerConnection | None = None
        self._login: PodTarget | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        """Whether this key may log in as ``username``; the last key checked is the one a
        successful login used (asyncssh checks one key at a time, signature last)."""
        limits = ratelimit.peer_limits(f"ssh:{self._peer()}")
        if auth_guard.blocked(self._ctx, limits):  # too many refused keys: refuse them all
            self._login = None
            return False
        fingerprint = key.get_fingerprint("sha256")
        self._login = await asyncio.to_thread(ssh_login, self._ctx, username, fingerprint)
        if self._login is None:
            auth_guard.failed(self._ctx, limits)
        return self._login is not None

    def _peer(self) -> str:
        peer = self._conn.get_extra_info("peername") if self._conn is not None else None
        return str(peer[0]) if peer else "unknown"

    def session_requested(self) -> _GatewaySession | bool:
        if self._login is None:
            return False
        return _GatewaySession(self._ctx, self._login)

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str,
                             orig_port: int) -> asyncio.Future[asyncssh.SSHTCPSession[bytes]]:
        del orig_host, orig_port
        return asyncio.ensure_future(self._tunnel(dest_host, dest_port))

    async def _tunnel(self, dest_host: str, dest_port: int) -> asyncssh.SSHTCPSession[bytes]:
        """``ssh -L``: a direct-tcpip channel to the same destination, via the agent (which
        allows only the pod's own addresses)."""
        login, conn = self._login, self._conn
        if login is None or conn is None:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
                                            "not logged in")
        try:
            target = await asyncio.to_thread(pod_target, self._ctx, login.project_id,
                                             login.pod_id)

            async def forward(up: asyncssh.SSHClientConnection
                              ) -> asyncssh.SSHTCPSession[bytes]:
                session = await conn.forward_tunneled_connection(up, dest_host, dest_port)
                return cast(asyncssh.SSHTCPSession[bytes], session)

            return await upstream.with_connection(self._ctx, target, forward)
        except GpucloudError as error:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED,
                                            error.message) from None


async def start(ctx: ServiceContext, host: str, port: int,
                reuse_port: bool = False) -> asyncssh.SSHAcceptor:
    """Listen for users; ``port`` 0 takes a free one (``acceptor.get_port()``)."""
    logging.getLogger("asyncssh").setLevel(logging.WARNING)  # its INFO names users, env
    host_key = keys.host_key(ctx.settings.home)
    keys.client_key(ctx.settings.home)  # made now, before the first agent registers
    return await asyncssh.create_server(
        lambda: GatewayServer(ctx), host, port, server_host_keys=[host_key],
        reuse_port=reuse_port, agent_forwarding=False, x11_forwarding=False,
        allow_scp=False, login_timeout=LOGIN_TIMEOUT_SECONDS, encoding=None,
        keepalive_interval=KEEPALIVE_SECONDS, window=_CHANNEL_WINDOW)


async def start_for_app(ctx: ServiceContext, state: object) -> asyncssh.SSHAcceptor | None:
    """Start the gateway the settings ask for (none when ``ssh_port`` is None); records
    the bound port as ``state.ssh_port`` (None without a gateway) and prints it."""
    settings = ctx.settings
    setattr(state, "ssh_port", None)  # noqa: B010 - a Starlette State, untyped
    if settings.ssh_port is None:
        return None
    acceptor = await start(ctx, settings.ssh_host, settings.ssh_port,
                           reuse_port=settings.ssh_reuse_port)
    setattr(state, "ssh_port", acceptor.get_port())  # noqa: B010
    print(f"gpucloud: SSH gateway on {settings.ssh_host}:{acceptor.get_port()}", flush=True)
    return acceptor


async def stop(acceptor: asyncssh.SSHAcceptor | None) -> None:
    """Stop listening and close the upstream connections of this event loop."""
    if acceptor is not None:
        acceptor.close()
        await acceptor.wait_closed()
    await upstream.pool().close()
