"""SSH client connections from the server to the agents' access servers.

One pooled connection per (agent endpoint, pinned host key, pod): the agent's SSH user name
is the pod id, and its host key must be the one the node registered (no trust on first
use). The SSH gateway, the exec WebSocket and the HTTP proxy open channels on these
connections: session channels (exec, shell, sftp) and direct-tcpip streams to the pod's
ports. A pool belongs to one event loop (the server's); a connection the agent closed is
dropped and made again on the next open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import asyncssh

from gpucloud.access import keys
from gpucloud.core.errors import Conflict
from gpucloud.core.per_loop import PerLoop
from gpucloud.services.access import PodTarget, running_target
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_SECONDS = 10.0
KEEPALIVE_SECONDS = 30.0
T = TypeVar("T")


@dataclass(frozen=True)
class _PoolKey:
    endpoint: str
    host_key: str
    pod_id: str


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port); Conflict for anything else."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise Conflict(f"the node's access endpoint {endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class UpstreamPool:
    """Connections of one event loop, shared by every user of the same pod."""

    def __init__(self) -> None:
        self._connections: dict[_PoolKey, asyncio.Task[asyncssh.SSHClientConnection]] = {}
        self._client_keys: dict[Path, asyncssh.SSHKey] = {}

    def _client_key(self, home: Path) -> asyncssh.SSHKey:
        if home not in self._client_keys:
            self._client_keys[home] = keys.client_key(home)
        return self._client_keys[home]

    async def connection(self, home: Path, target: PodTarget) -> asyncssh.SSHClientConnection:
        """The pod's connection, made once and shared; Conflict if the agent is unreachable."""
        assert target.endpoint and target.host_key
        key = _PoolKey(target.endpoint, target.host_key, target.pod_id)
        task = self._connections.get(key)
        if task is not None and _unusable(task):
            self._connections.pop(key, None)
            task = None
        if task is None:
            task = asyncio.ensure_future(self._connect(self._client_key(home), key))
            self._connections[key] = task
        try:
            return await asyncio.shield(task)
        except (TimeoutError, OSError, asyncssh.Error) as error:
            if self._connections.get(key) is task:
                self._connections.pop(key, None)
            raise Conflict(f"cannot reach the agent of pod {target.name} at "
                           f"{target.endpoint}: {_describe(error)}") from None

    def drop(self, home: Path, target: PodTarget) -> None:
        """Forget the pod's connection (it broke); the next open connects again."""
        del home
        if target.endpoint and target.host_key:
            self._connections.pop(_PoolKey(target.endpoint, target.host_key, target.pod_id),
                                  None)

    async def _connect(self, client_key: asyncssh.SSHKey,
                       key: _PoolKey) -> asyncssh.SSHClientConnection:
        host, port = split_endpoint(key.endpoint)
        pinned = asyncssh.import_public_key(key.host_key)
        return await asyncssh.connect(
            host, port, username=key.pod_id, client_keys=[client_key],
            known_hosts=([pinned], [], []), agent_path=None, config=[],
            password_auth=False, kbdint_auth=False, preferred_auth="publickey",
            connect_timeout=CONNECT_TIMEOUT_SECONDS, keepalive_interval=KEEPALIVE_SECONDS)

    async def close(self) -> None:
        """Close every connection (the server is stopping)."""
        tasks = list(self._connections.values())
        self._connections.clear()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
            else:
                task.cancel()


def _unusable(task: asyncio.Task[asyncssh.SSHClientConnection]) -> bool:
    if not task.done():
        return False
    return task.cancelled() or task.exception() is not None or task.result().is_closed()


def _describe(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


_pools = PerLoop(UpstreamPool)


def pool() -> UpstreamPool:
    """The pool of the running event loop."""
    return _pools.get()


async def with_connection(ctx: ServiceContext, target: PodTarget,
                          use: Callable[[asyncssh.SSHClientConnection], Awaitable[T]]) -> T:
    """``use(connection)``, once more on a fresh connection if the pooled one had broken."""
    upstreams = pool()
    connection = await upstreams.connection(ctx.settings.home, target)
    try:
        return await use(connection)
    except (asyncssh.DisconnectError, asyncssh.ConnectionLost, BrokenPipeError):
        upstreams.drop(ctx.settings.home, target)
        connection = await upstreams.connection(ctx.settings.home, target)
        return await use(connection)


async def target_of(ctx: ServiceContext, pod_id: str) -> PodTarget:
    """The running pod (NotFound / Conflict otherwise), looked up off the event loop."""
    return await asyncio.to_thread(running_target, ctx, pod_id)


async def open_pod_stream(ctx: ServiceContext, pod_id: str, port: int
                          ) -> tuple[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes]]:
    """A byte stream to ``port`` of the pod (a direct-tcpip channel through its agent).

    NotFound / Conflict (one line) when the pod is not running or unreachable;
    ConnectionRefusedError when nothing in the pod accepts on that port.
    """
    target = await target_of(ctx, pod_id)

    async def open_stream(connection: asyncssh.SSHClientConnection
                          ) -> tuple[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes]]:
        try:
            reader, writer = await connection.open_connection("localhost", port)
        except asyncssh.ChannelOpenError as error:
            raise ConnectionRefusedError(
                f"pod {target.name} port {port}: {error.reason}") from None
        return reader, writer

    return await with_connection(ctx, target, open_stream)


async def open_process(ctx: ServiceContext, target: PodTarget, command: str, *,
                       term_type: str | None = None,
                       term_size: tuple[int, int] | None = None,
                       env: Mapping[str, str] | None = None
                       ) -> asyncssh.SSHClientProcess[bytes]:
    """``/bin/sh -c command`` in the pod (with a PTY when ``term_type`` is given)."""

    async def start(connection: asyncssh.SSHClientConnection
                    ) -> asyncssh.SSHClientProcess[bytes]:
        process: asyncssh.SSHClientProcess[bytes] = await connection.create_process(
            command, term_type=term_type, term_size=term_size, env=dict(env or {}),
            encoding=None, request_pty="force" if term_type else False)
        return process

    return await with_connection(ctx, target, start)
