"""HTTP/1.1 to a pod's port over a byte stream (h11), with keep-alive pooling.

The stream is what ``upstream.open_pod_stream`` gives (an SSH direct-tcpip channel through
the node's agent); tests give a plain TCP connection. Bodies stream both ways in chunks;
no whole body is ever held. There is no request deadline, only an idle timeout on every
read and write (a download that keeps moving runs as long as it needs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import asyncssh
import h11

from gpucloud.core.errors import GpucloudError

T = TypeVar("T")
CHUNK = 64 * 1024
#: Idle pooled connections are dropped after this long (servers close theirs around then).
POOL_KEEPALIVE_SECONDS = 30.0
POOL_MAX_IDLE = 16
#: Headers that belong to one connection (RFC 9110 7.6.1), never forwarded.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection",
})
Headers = list[tuple[bytes, bytes]]


class Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...

    def at_eof(self) -> bool: ...


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


#: ``(pod_id, port) -> stream``: the production one wraps ``upstream.open_pod_stream``.
Opener = Callable[[str, int], Awaitable[tuple[Reader, Writer]]]


class UpstreamFailed(Exception):
    """The pod's server could not be reached or broke the protocol (HTTP 502)."""


class UpstreamIdle(Exception):
    """Nothing moved for the idle timeout (HTTP 504 before a response, else a cut)."""


#: What a broken stream raises: sockets, SSH channels, h11 on garbage.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    OSError, EOFError, asyncssh.Error, h11.ProtocolError, ConnectionError)
_PUMP_ERRORS: tuple[type[BaseException], ...] = (*STREAM_ERRORS, UpstreamIdle)


def drop_hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """Headers without the hop-by-hop ones and those the ``Connection`` header names."""
    items = [(name.lower(), value) for name, value in headers]
    named = {token.strip().lower() for name, value in items if name == b"connection"
             for token in value.split(b",")}
    return [(n, v) for n, v in items if n not in HOP_BY_HOP and n not in named]


@dataclass
class Upstream:
    """One HTTP/1.1 client connection over a stream."""

    key: tuple[str, int]
    reader: Reader
    writer: Writer
    conn: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    reused: bool = False
    idle_since: float = 0.0

    async def send(self, event: h11.Event, idle: float) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await _within(idle, self.writer.drain())

    async def next_event(self, idle: float) -> h11.Event:
        while True:
            event = self.conn.next_event()
            if event is h11.PAUSED:
                raise h11.RemoteProtocolError("the pod's server sent data out of turn")
            if event is not h11.NEED_DATA:
                assert isinstance(event, h11.Event)
                return event
            data = await _within(idle, self.reader.read(CHUNK))
            self.conn.receive_data(data)

    def reusable(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    def close(self) -> None:
        self.writer.close()


async def _within(idle: float, step: Awaitable[T]) -> T:
    try:
        async with asyncio.timeout(idle):
            return await step
    except TimeoutError:
        raise UpstreamIdle(f"no data for {idle:g} s") from None


class UpstreamPool:
    """Idle keep-alive connections per (pod, port), so a request skips the channel open."""

    def __init__(self, opener: Opener) -> None:
        self.opener = opener
        self._idle: dict[tuple[str, int], list[Upstream]] = {}

    async def acquire(self, key: tuple[str, int], fresh: bool = False) -> Upstream:
        if not fresh:
            reused = self._take_idle(key)
            if reused is not None:
                return reused
        try:
            reader, writer = await self.opener(*key)
        except GpucloudError:
            raise
        except STREAM_ERRORS as error:
            raise UpstreamFailed(f"cannot reach port {key[1]} of pod {key[0]}: "
                                 f"{_one_line(error)}") from None
        return Upstream(key, reader, writer)

    def _take_idle(self, key: tuple[str, int]) -> Upstream | None:
        idle = self._idle.get(key, [])
        deadline = time.monotonic() - POOL_KEEPALIVE_SECONDS
        while idle:
            upstream = idle.pop()
            if upstream.idle_since >= deadline and not upstream.reader.at_eof():
                upstream.reused = True
                return upstream
            upstream.close()
        return None

    def release(self, upstream: Upstream) -> None:
        """Back to the pool if its exchange completed cleanly, else closed."""
        idle = self._idle.setdefault(upstream.key, [])
        if not upstream.reusable() or len(idle) >= POOL_MAX_IDLE:
            upstream.close()
            return
        upstream.conn.start_next_cycle()
        upstream.idle_since = time.monotonic()
        idle.append(upstream)

    def close(self) -> None:
        for idle in self._idle.values():
            for upstream in idle:
                upstream.close()
        self._idle.clear()


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


Receive = Callable[[], Awaitable[dict[str, object]]]
Send = Callable[[dict[str, object]], Awaitable[None]]


@dataclass(frozen=True)
class ProxyRequest:
    """What goes upstream: method, target (path and query) and the rewritten headers."""

    method: bytes
    target: bytes
    headers: Headers
    has_body: bool


async def forward(pool: UpstreamPool, key: tuple[str, int], request: ProxyRequest,
                  receive: Receive, send: Send, idle: float) -> None:
    """Send ``request`` (its body read from ``receive``) and stream the response to
    ``send``. Raises UpstreamFailed / UpstreamIdle only before the response has started;
    after that a broken upstream just ends the client's response (it sees a cut)."""
    upstream, response = await _exchange(pool, key, request, receive, idle)
    headers = drop_hop_by_hop(response.headers)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    pump = asyncio.ensure_future(_pump_response(upstream, send, idle))
    try:
        done, _ = await asyncio.wait({watcher, pump}, return_when=asyncio.FIRST_COMPLETED)
        completed = pump in done and pump.result()
    finally:
        for task in (watcher, pump):
            task.cancel()
    if completed:
        # Back in the pool before the client sees the end of the body: its next request
        # on a keep-alive connection may arrive (and acquire) before this call returns.
        pool.release(upstream)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        upstream.close()


async def _exchange(pool: UpstreamPool, key: tuple[str, int], request: ProxyRequest,
                    receive: Receive, idle: float) -> tuple[Upstream, h11.Response]:
    """Request out, response head back; a request without a body that fails on a reused
    keep-alive connection (the pod's server closed it meanwhile) is retried once fresh."""
    upstream = await pool.acquire(key)
    try:
        return upstream, await _send_and_read_head(upstream, request, receive, idle)
    except STREAM_ERRORS as error:
        upstream.close()
        if not (upstream.reused and not request.has_body):
            raise UpstreamFailed(f"pod's server failed: {_one_line(error)}") from None
    upstream = await pool.acquire(key, fresh=True)
    try:
        return upstream, await _send_and_read_head(upstream, request, receive, idle)
    except STREAM_ERRORS as error:
        upstream.close()
        raise UpstreamFailed(f"pod's server failed: {_one_line(error)}") from None
    except UpstreamIdle:
        upstream.close()
        raise


async def _send_and_read_head(upstream: Upstream, request: ProxyRequest, receive: Receive,
                              idle: float) -> h11.Response:
    try:
        await upstream.send(h11.Request(method=request.method, target=request.target,
                                        headers=request.headers), idle)
        if request.has_body:
            await _pump_request(upstream, receive, idle)
        else:
            await upstream.send(h11.EndOfMessage(), idle)
        while True:
            event = await upstream.next_event(idle)
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
    except UpstreamIdle:
        upstream.close()
        raise


async def _pump_request(upstream: Upstream, receive: Receive, idle: float) -> None:
    while True:
        message = await _within(idle, receive())
        if message["type"] == "http.disconnect":
            raise ConnectionError("the client went away during the upload")
        body = message.get("body", b"")
        assert isinstance(body, bytes)
        if body:
            await upstream.send(h11.Data(data=body), idle)
        if not message.get("more_body", False):
            await upstream.send(h11.EndOfMessage(), idle)
            return


async def _pump_response(upstream: Upstream, send: Send, idle: float) -> bool:
    """Body chunks to the client; True if the upstream response ended cleanly (the
    caller ends the client's body, after releasing the upstream)."""
    try:
        while True:
            event = await upstream.next_event(idle)
            if isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data),
                            "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                return True
            else:
                return False
    except _PUMP_ERRORS:
        return False


async def _wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
