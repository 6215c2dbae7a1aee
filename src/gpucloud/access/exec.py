"""``/v1/pods/{ref}/exec``: a command in a running pod over a WebSocket.

Protocol (one WebSocket, subprotocol ``gpucloud.exec``):

1. The client's first message is text, JSON:
   ``{"command": ["sh", "-c", "..."], "tty": false, "cols": 80, "rows": 24, "env": {}}``.
2. Then binary frames whose first byte names the stream, the rest is the payload:
   ``0`` stdin (client → server; a frame of just ``0`` is EOF on stdin),
   ``1`` stdout and ``2`` stderr (server → client; with a TTY everything is stdout),
   ``3`` resize (client → server, JSON ``{"cols": N, "rows": N}``),
   ``4`` exit (server → client, JSON ``{"exit_code": N}``, last frame; then the server
   closes with 1000). A command killed by a signal exits 128 + the signal number.
   An error before or instead of the command is an exit frame
   ``{"exit_code": null, "error": "one line", "status": 404}`` and a close with code
   4000 + status.

Authentication: ``Authorization: Bearer KEY``, or — for browsers, which cannot set headers
on a WebSocket — the subprotocol ``bearer.KEY`` offered beside ``gpucloud.exec``.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
from typing import Any

import asyncssh
from pydantic import BaseModel, Field, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from gpucloud.access import upstream
from gpucloud.core.errors import GpucloudError, InvalidInput
from gpucloud.services.access import pod_target
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

STDIN, STDOUT, STDERR, RESIZE, EXIT = 0, 1, 2, 3, 4
SUBPROTOCOL = "gpucloud.exec"
TOKEN_SUBPROTOCOL_PREFIX = "bearer."
READ_CHUNK = 64 * 1024


class ExecStart(BaseModel):
    """The client's first message."""

    model_config = {"extra": "forbid"}
    command: list[str] = Field(min_length=1, max_length=4096)
    tty: bool = False
    cols: int = Field(default=80, ge=1, le=10000)
    rows: int = Field(default=24, ge=1, le=10000)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)


def exit_code(process: asyncssh.SSHClientProcess[bytes]) -> int:
    """The remote exit status; 128 + N for a signal (as a shell reports it)."""
    if process.exit_status is not None and process.exit_status >= 0:
        return process.exit_status
    if process.exit_signal is not None:
        name = process.exit_signal[0]
        number = getattr(signal, f"SIG{name}", None)
        return 128 + int(number) if number is not None else 255
    return 255


def error_frame(error: GpucloudError, status: int) -> bytes:
    body = {"exit_code": None, "error": error.message, "status": status}
    return bytes([EXIT]) + json.dumps(body).encode()


async def read_start(websocket: WebSocket) -> ExecStart:
    text = await websocket.receive_text()
    try:
        return ExecStart.model_validate(json.loads(text))
    except (ValueError, ValidationError) as error:
        field = "command"
        if isinstance(error, ValidationError) and error.errors():
            field = ".".join(str(p) for p in error.errors()[0]["loc"]) or "command"
        raise InvalidInput(field, "the first message must be JSON {\"command\": [...], "
                                  "\"tty\": bool, \"cols\": N, \"rows\": N}") from None


class ExecBridge:
    """One exec: the WebSocket on one side, an SSH process in the pod on the other."""

    def __init__(self, websocket: WebSocket, process: asyncssh.SSHClientProcess[bytes]) -> None:
        self._ws = websocket
        self._process = process
        self._send_lock = asyncio.Lock()

    async def _send(self, stream: int, payload: bytes) -> None:
        async with self._send_lock:
            await self._ws.send_bytes(bytes([stream]) + payload)

    async def _pump_out(self, stream: int, reader: asyncssh.SSHReader[bytes]) -> None:
        while chunk := await reader.read(READ_CHUNK):
            await self._send(stream, chunk)

    async def _pump_in(self) -> None:
        """Client frames to the process until the client goes away."""
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                self._process.close()
                return
            data = message.get("bytes")
            if data:
                await self._frame_in(data)

    async def _frame_in(self, data: bytes) -> None:
        stream, payload = data[0], data[1:]
        if stream == STDIN and not payload:
            self._process.stdin.write_eof()
        elif stream == STDIN:
            self._process.stdin.write(payload)
            await self._process.stdin.drain()
        elif stream == RESIZE:
            size = _resize(payload)
            if size is not None:
                self._process.change_terminal_size(*size)

    async def run(self) -> None:
        """Relay until the process ends (exit frame) or the client leaves (process closed)."""
        inbound = asyncio.ensure_future(self._pump_in())
        try:
            await asyncio.gather(self._pump_out(STDOUT, self._process.stdout),
                                 self._pump_out(STDERR, self._process.stderr))
            await self._process.wait_closed()
            await self._send(EXIT, json.dumps({"exit_code": exit_code(self._process)}).encode())
            await self._ws.close(1000)
        except (WebSocketDisconnect, asyncssh.Error, OSError, RuntimeError):
            self._process.close()  # the client left mid-stream, or the pod's side broke
        finally:
            inbound.cancel()


def _resize(payload: bytes) -> tuple[int, int] | None:
    try:
        body: Any = json.loads(payload)
        return max(1, int(body["cols"])), max(1, int(body["rows"]))
    except (ValueError, KeyError, TypeError):
        return None


async def serve(websocket: WebSocket, ctx: ServiceContext, principal: Principal,
                ref: str) -> None:
    """Run one exec for an accepted, authenticated WebSocket."""
    start = await read_start(websocket)
    target = await asyncio.to_thread(pod_target, ctx, principal.project_id, ref)
    term = start.env.get("TERM", "xterm-256color") if start.tty else None
    process = await upstream.open_process(
        ctx, target, shlex.join(start.command), term_type=term,
        term_size=(start.cols, start.rows), env=start.env)
    await ExecBridge(websocket, process).run()
