"""WebSockets through the proxy: an ASGI websocket becomes a wsproto client connection to
the pod's server over the pod stream; messages relay both ways, close codes pass.

The handshake completes upstream before the client is accepted, so a pod that refuses
(403 on a bad Origin, 404 on a wrong path) refuses the client with the same status.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from gpucloud.access.proxy_http import (
    CHUNK,
    STREAM_ERRORS,
    Headers,
    Reader,
    Receive,
    Send,
    UpstreamFailed,
    Writer,
)

#: Close codes that never go on the wire (RFC 6455 7.4.1), as the client is told them.
_LOCAL_ONLY = {1005: 1000, 1006: 1011, 1015: 1011}


@dataclass(frozen=True)
class WsRequest:
    host: str
    target: str
    headers: Headers
    subprotocols: list[str]


@dataclass(frozen=True)
class Rejected:
    """The pod's server refused the upgrade with an HTTP response."""

    status: int
    headers: Headers
    body: bytes


async def handshake(reader: Reader, writer: Writer, request: WsRequest,
                    idle: float) -> tuple[WSConnection, AcceptConnection | Rejected]:
    """The opening handshake with the pod's server."""
    ws = WSConnection(ConnectionType.CLIENT)
    writer.write(ws.send(Request(host=request.host, target=request.target,
                                 extra_headers=request.headers,
                                 subprotocols=request.subprotocols)))
    rejected: RejectConnection | None = None
    body = b""
    async with asyncio.timeout(idle):
        await writer.drain()
        while True:
            data = await reader.read(CHUNK)
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    return ws, event
                if isinstance(event, RejectConnection):
                    rejected = event
                    if not event.has_body:
                        return ws, _rejection(event, b"")
                elif isinstance(event, RejectData) and rejected is not None:
                    body += event.data
                    if event.body_finished:
                        return ws, _rejection(rejected, body)
                elif isinstance(event, CloseConnection):
                    raise UpstreamFailed("the pod's server closed the connection during "
                                         "the WebSocket handshake")


def _rejection(event: RejectConnection, body: bytes) -> Rejected:
    headers = [(bytes(n).lower(), bytes(v)) for n, v in event.headers
               if bytes(n).lower() in (b"content-type", b"www-authenticate")]
    return Rejected(event.status_code, headers, body)


@dataclass
class _Activity:
    """The last time a byte moved either way; ``expired`` returns after ``idle`` of none."""

    idle: float
    last: float = field(default_factory=lambda: asyncio.get_running_loop().time())

    def touch(self) -> None:
        self.last = asyncio.get_running_loop().time()

    async def expired(self) -> None:
        loop = asyncio.get_running_loop()
        while (remaining := self.last + self.idle - loop.time()) > 0:
            await asyncio.sleep(remaining)


async def relay(ws: WSConnection, reader: Reader, writer: Writer, receive: Receive,
                send: Send, idle: float) -> None:
    """Messages both ways until either side closes or nothing moves for ``idle``."""
    activity = _Activity(idle)
    tasks = {asyncio.ensure_future(_client_to_pod(ws, writer, receive, activity)),
             asyncio.ensure_future(_pod_to_client(ws, reader, writer, send, activity))}
    timer = asyncio.ensure_future(activity.expired())
    try:
        done, _ = await asyncio.wait({*tasks, timer}, return_when=asyncio.FIRST_COMPLETED)
        if timer in done:
            await _close_both(ws, writer, send, 1001, "idle timeout")
        for task in done & tasks:
            if task.exception() is not None and isinstance(task.exception(), STREAM_ERRORS):
                await send({"type": "websocket.close", "code": 1011,
                            "reason": "pod connection lost"})
    finally:
        for task in (*tasks, timer):
            task.cancel()
        writer.close()


async def _close_both(ws: WSConnection, writer: Writer, send: Send, code: int,
                      reason: str) -> None:
    await send({"type": "websocket.close", "code": code, "reason": reason})
    if ws.state is ConnectionState.OPEN:
        writer.write(ws.send(CloseConnection(code=code, reason=reason)))


async def _client_to_pod(ws: WSConnection, writer: Writer, receive: Receive,
                         activity: _Activity) -> None:
    while True:
        message = await receive()
        activity.touch()
        if message["type"] == "websocket.disconnect":
            code = message.get("code", 1000)
            reason = message.get("reason") or None
            if ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                assert isinstance(code, int)
                writer.write(ws.send(CloseConnection(
                    code=code, reason=reason if isinstance(reason, str) else None)))
                await writer.drain()
            return
        if message["type"] != "websocket.receive":
            continue
        text, data = message.get("text"), message.get("bytes")
        event: Event = (TextMessage(data=text) if isinstance(text, str)
                        else BytesMessage(data=data if isinstance(data, bytes) else b""))
        writer.write(ws.send(event))
        await writer.drain()


async def _pod_to_client(ws: WSConnection, reader: Reader, writer: Writer, send: Send,
                         activity: _Activity) -> None:
    """Pod frames to the client; fragments are joined (ASGI sends whole messages)."""
    parts: list[str | bytes] = []
    while True:
        data = await reader.read(CHUNK)
        activity.touch()
        ws.receive_data(data or None)
        for event in ws.events():
            if isinstance(event, TextMessage | BytesMessage):
                parts.append(event.data if isinstance(event.data, str) else bytes(event.data))
                if event.message_finished:
                    await send(_message(parts))
                    parts = []
            elif isinstance(event, Ping):
                writer.write(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                code = _LOCAL_ONLY.get(event.code, event.code)
                await send({"type": "websocket.close", "code": code,
                            "reason": event.reason or ""})
                if ws.state is ConnectionState.REMOTE_CLOSING:
                    writer.write(ws.send(event.response()))
                return


def _message(parts: list[str | bytes]) -> dict[str, object]:
    if isinstance(parts[0], str):
        return {"type": "websocket.send", "text": "".join(str(p) for p in parts)}
    return {"type": "websocket.send", "bytes": b"".join(p for p in parts if isinstance(p, bytes))}
