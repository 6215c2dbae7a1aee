"""The client side of ``/v1/pods/{ref}/exec`` (protocol: gpucloud.access.exec), synchronous.

``run_exec`` streams stdin from a binary file (or nothing), writes stdout and stderr to
binary files, forwards terminal resizes given by ``resizes`` and returns the remote exit
code. A thread feeds stdin while the caller's thread receives.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from gpucloud.client.sdk import ERROR_KINDS, ApiError
from gpucloud.core.errors import GpucloudError, InvalidInput

STDIN, STDOUT, STDERR, RESIZE, EXIT = 0, 1, 2, 3, 4
SUBPROTOCOL = "gpucloud.exec"
STDIN_CHUNK = 32 * 1024


@dataclass
class ExecRequest:
    command: list[str]
    tty: bool = False
    cols: int = 80
    rows: int = 24
    env: dict[str, str] = field(default_factory=dict)

    def first_message(self) -> str:
        return json.dumps({"command": self.command, "tty": self.tty, "cols": self.cols,
                           "rows": self.rows, "env": self.env})


def ws_url(base_url: str, ref: str) -> str:
    scheme, sep, rest = base_url.rstrip("/").partition("://")
    ws_scheme = "wss" if scheme == "https" else "ws"
    return f"{ws_scheme}{sep}{rest}/v1/pods/{ref}/exec"


def _error(body: dict[str, object]) -> GpucloudError:
    message = str(body.get("error") or "exec failed")
    status = int(str(body.get("status") or 0))
    if status == 422:
        return InvalidInput("command", message)
    kind = ERROR_KINDS.get(status)
    return kind(message) if kind else ApiError(status, message)


def _feed_stdin(ws: ClientConnection, stdin: BinaryIO) -> None:
    """Copy stdin to the pod, then send EOF (a frame of just the stream byte)."""
    read = getattr(stdin, "read1", stdin.read)  # read1: what is there, not a full chunk
    try:
        while chunk := read(STDIN_CHUNK):
            ws.send(bytes([STDIN]) + chunk)
        ws.send(bytes([STDIN]))
    except (ConnectionClosed, OSError, ValueError):
        return  # the command ended first, or stdin was closed


def send_resize(ws: ClientConnection, cols: int, rows: int) -> None:
    try:
        ws.send(bytes([RESIZE]) + json.dumps({"cols": cols, "rows": rows}).encode())
    except ConnectionClosed:
        pass


def run_exec(base_url: str, token: str | None, ref: str, request: ExecRequest,
             stdin: BinaryIO | None, stdout: BinaryIO, stderr: BinaryIO,
             on_open: Callable[[ClientConnection], None] | None = None) -> int:
    """Run the command in the pod; returns its exit code (raises for API errors)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        ws = connect(ws_url(base_url, ref), additional_headers=headers,
                     subprotocols=[Subprotocol(SUBPROTOCOL)], max_size=None, open_timeout=30)
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as error:
        raise ApiError(0, f"cannot open exec on {base_url}: {error}") from None
    with ws:
        ws.send(request.first_message())
        if on_open is not None:
            on_open(ws)
        if stdin is None:
            ws.send(bytes([STDIN]))
        else:
            threading.Thread(target=_feed_stdin, args=(ws, stdin), daemon=True).start()
        return _receive(ws, stdout, stderr)


def _receive(ws: ClientConnection, stdout: BinaryIO, stderr: BinaryIO) -> int:
    try:
        for message in ws:
            if isinstance(message, str) or not message:
                continue
            stream, payload = message[0], message[1:]
            if stream in (STDOUT, STDERR):
                out = stdout if stream == STDOUT else stderr
                out.write(payload)
                out.flush()
            elif stream == EXIT:
                body = json.loads(payload)
                if body.get("exit_code") is None:
                    raise _error(body)
                return int(body["exit_code"])
    except ConnectionClosed:
        pass
    raise ApiError(0, "the exec connection closed before the command's exit code came")
