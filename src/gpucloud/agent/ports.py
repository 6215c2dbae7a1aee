"""Public TCP ports: a listener on the node per ``N/tcp`` port of a pod, relaying each
connection to the pod's own address and port ``N``.

The listeners and relays run on one asyncio loop on a thread of the agent. A public port
is allocated by binding it, on the node's address and on 127.0.0.1, from the node's range
(``--port-range``), starting at a place derived from the agent's state directory so that
agents sharing a machine rarely even try the same ports; the socket stays bound for the
pod's whole life, so nobody can take it in between. Nothing survives the agent process:
after a restart the agent publishes the ports of the pods it adopts again, at the public
ports recorded in their ``network.json`` (their environment names them).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import socket
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpucloud.core.errors import InvalidInput

log = logging.getLogger(__name__)

DEFAULT_PORT_RANGE = (40000, 49999)
CHUNK = 256 * 1024
CONNECT_TIMEOUT = 10.0
BACKLOG = 128


def parse_port_range(value: str) -> tuple[int, int]:
    """``LOW-HIGH`` with 1024 <= LOW <= HIGH <= 65535; InvalidInput names ``port_range``."""
    low, sep, high = value.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise InvalidInput("port_range", f"{value!r} is not LOW-HIGH")
    first, last = int(low), int(high)
    if not 1024 <= first <= last <= 65535:
        raise InvalidInput("port_range", f"{value!r} must satisfy 1024 <= LOW <= HIGH <= 65535")
    return first, last


def listen_hosts(address: str | None) -> list[str]:
    """Where public ports listen: the node's address and 127.0.0.1; all addresses when the
    node's address is not one of this host's (behind NAT, a public IP that is not local)."""
    hosts = list(dict.fromkeys([address or "127.0.0.1", "127.0.0.1"]))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((hosts[0], 0))
    except OSError as error:
        log.warning("cannot listen on %s (%s): public ports listen on all addresses",
                    hosts[0], error)
        return ["0.0.0.0"]
    return hosts


@dataclass
class _Published:
    public_port: int
    target: tuple[str, int]
    sockets: list[socket.socket]
    servers: list[asyncio.Server] = field(default_factory=list)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class PortForwarder:
    """The node's public TCP ports, keyed by the container that owns them."""

    def __init__(self, hosts: Sequence[str], port_range: tuple[int, int], seed: str) -> None:
        self.hosts = list(hosts)
        self.first, self.last = port_range
        size = self.last - self.first + 1
        self._start = int(hashlib.sha256(seed.encode()).hexdigest(), 16) % size
        self._lock = threading.Lock()
        self._published: dict[str, list[_Published]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public API (any thread) ----------------------------------------------------

    def publish(self, owner: str, target: tuple[str, int], public_port: int | None = None
                ) -> int:
        """Listen on a public port (``public_port`` if given, else a free one of the range)
        and relay its connections to ``target``; returns the public port.

        Raises OSError when ``public_port`` cannot be bound, or the range is full."""
        with self._lock:
            sockets = (self._bind(public_port) if public_port is not None
                       else self._allocate())
            entry = _Published(sockets[0].getsockname()[1], target, sockets)
            self._published.setdefault(owner, []).append(entry)
        self._call(self._serve(entry))
        return entry.public_port

    def unpublish(self, owner: str) -> None:
        """Close the owner's listeners and its open relays (idempotent)."""
        with self._lock:
            entries = self._published.pop(owner, [])
        for entry in entries:
            if self._loop is not None:
                self._call(self._close(entry))
            for sock in entry.sockets:
                sock.close()

    def ports_of(self, owner: str) -> dict[tuple[str, int], int]:
        with self._lock:
            return {e.target: e.public_port for e in self._published.get(owner, [])}

    def close(self) -> None:
        for owner in list(self._published):
            self.unpublish(owner)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- binding --------------------------------------------------------------------

    def _allocate(self) -> list[socket.socket]:
        size = self.last - self.first + 1
        mine = {e.public_port for entries in self._published.values() for e in entries}
        for step in range(size):
            port = self.first + (self._start + step) % size
            if port in mine:
                continue
            try:
                return self._bind(port)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
        raise OSError(errno.EADDRINUSE,
                      f"no free public port left in {self.first}-{self.last}")

    def _bind(self, port: int) -> list[socket.socket]:
        """Listening sockets on every host at ``port``, or OSError (none left open)."""
        bound: list[socket.socket] = []
        try:
            for host in self.hosts:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                bound.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            for sock in bound:
                sock.close()
            raise
        return bound

    # -- the loop -------------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` on the loop and wait for it (it only starts or stops servers)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._ensure_loop())
        future.result(timeout=CONNECT_TIMEOUT)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="ports",
                                 daemon=True).start()
            return self._loop

    async def _serve(self, entry: _Published) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._relay(entry, reader, writer)

        for sock in entry.sockets:
            entry.servers.append(await asyncio.start_server(handle, sock=sock))

    @staticmethod
    async def _close(entry: _Published) -> None:
        for server in entry.servers:
            server.close()
        for writer in list(entry.writers):
            writer.close()

    async def _relay(self, entry: _Published, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        entry.writers.add(writer)
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(*entry.target), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as error:
            log.info("public port %d: cannot reach %s:%d: %s", entry.public_port,
                     *entry.target, error)
            entry.writers.discard(writer)
            writer.close()
            return
        entry.writers.add(upstream_writer)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for each in (writer, upstream_writer):
                entry.writers.discard(each)
                each.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the half-close on (``nc`` waits for it)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
