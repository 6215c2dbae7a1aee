"""TCP connections opened from inside a pod's network namespace.

A service that listens only on the pod's own loopback (Jupyter's default, 127.0.0.1:8888)
cannot be reached at the pod's address from the host. The access server's ``ssh -L`` and
proxy streams to ``localhost`` therefore connect from inside the pod's namespace:
a short-lived thread of its own joins the namespace with ``setns(fd, CLONE_NEWNET)``
(per thread: the agent's other threads stay in the host's namespace; Python 3.11 has no
``os.setns``, hence libc through ctypes), creates and connects the socket, and ends. A
socket keeps the namespace it was made in, so the connected socket is handed back to
asyncio and used from the event loop like any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import socket
import threading

CLONE_NEWNET = 0x40000000
CONNECT_TIMEOUT_SECONDS = 10.0
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"entering the pod's network namespace: {os.strerror(errno)}")


def connect_in(netns: str, host: str, port: int,
               timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """A blocking connect to ``host:port`` inside ``netns`` (a ``/run/netns/…`` path);
    only for a thread that is thrown away afterwards (it stays in that namespace)."""
    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
    finally:
        os.close(fd)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def open_in(netns: str, host: str, port: int,
                  timeout: float = CONNECT_TIMEOUT_SECONDS) -> socket.socket:
    """``connect_in`` on a new thread of its own; the connected (non-blocking) socket."""
    future: concurrent.futures.Future[socket.socket] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before the thread got going
        try:
            future.set_result(connect_in(netns, host, port, timeout))
        except OSError as error:
            future.set_exception(error)

    threading.Thread(target=run, name="netns-connect", daemon=True).start()
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_result)  # nobody will take the socket now
        raise


def _close_result(future: concurrent.futures.Future[socket.socket]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()
