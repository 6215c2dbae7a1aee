"""Invariant: an agent that still hears the server while the server no longer hears it is
fenced as a silent one is, and learns it from what it hears. No renewal reaches the server,
so the lease expires, the node is ``Lost`` and its restart-always pod runs again on another
node; the cut-off agent's next long-poll answer no longer lists the pod, and the agent kills
its stale container at once, while the partition lasts (within ``STALE_BOUND_S`` of the
``Lost`` mark: the pod does not run twice for longer than that), even though every write it
tries hangs unanswered (``PodWorker.abandon`` kills it from the poll's thread: left to the
pod's worker, the kill waited behind a log chunk retried until the partition healed, the
pod running twice all that time). Its writes that get through late carry the revoked grant
and are refused (409, stale fencing token), changing nothing. When the partition heals it
takes a new grant (the node is ``Ready`` again with a newer token), removes its stale
container, and the moved pod is untouched: Running on the other node, restarted exactly
once, the only pod in the database.

The partition is made at the HTTP level by a fault proxy on loopback between the agent and
the server (``WriteCutProxy``): while cut, the agent's GETs (its long polls) are forwarded
and answered, its writes (renewals, status reports, log chunks, usage) are held unanswered;
a held write whose client has not given up yet is delivered when the partition heals, as
TCP's retransmission would deliver it.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from gpucloud.services.spot import NODE_LOST
from tests.e2e.cluster import wait_for
from tests.faults.cluster import FaultCloud, fault_cloud, running
from tests.faults.test_stale_node import (
    _assert_healed,
    _assert_old_grant_refused,
    _place_keeper,
)

LEASE_TTL = 3.0
#: How long the stale container may outlive the ``Lost`` mark (its ``NodeLost`` event): the
#: mark wakes the agent's long poll at once and the kill is one signal to the container's
#: supervisor (measured: 0.03-0.1 s); the rest is margin for a loaded 2-core machine.
STALE_BOUND_S = LEASE_TTL + 2.0
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class Delivered:
    """A write held during the partition and delivered after it: what the server said."""

    method: str
    path: str
    status: int
    body: bytes


class WriteCutProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of the server at ``upstream``, one request per
    connection (forwarded with ``Connection: close``, the answer piped back until EOF).

    ``cut``: GETs still go through; any other request is held, unanswered, until its client
    gives up (closes the connection) or ``heal`` (then it is forwarded late, ``late``
    records the server's answers). ``held``/``gets_while_cut`` count what the cut saw.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._healed = threading.Event()
        self._healed.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.held = 0
        self.gets_while_cut = 0
        self.late: list[Delivered] = []
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    def cut(self) -> None:
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    def close(self) -> None:
        self._closed.set()
        self._healed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            request = _read_request(client)
            if request is None:
                return
            method, path = request.split(b" ", 2)[:2]
            late = False
            if not self._healed.is_set():
                with self._lock:
                    if method == b"GET":
                        self.gets_while_cut += 1
                    else:
                        self.held += 1
                if method != b"GET":
                    if not self._hold(client):
                        return
                    late = True
            answer = self._forward(request, client)
            if late and answer:
                head, _, body = answer.partition(_HEAD_END)
                with self._lock:
                    self.late.append(Delivered(method.decode(), path.decode(),
                                               int(head.split(b" ", 2)[1]), body))

    def _hold(self, client: socket.socket) -> bool:
        """Until healed (True) or the client gives up, or the proxy closes (False)."""
        while not self._healed.wait(0.1):
            if _peer_closed(client):
                return False
        return not self._closed.is_set() and not _peer_closed(client)

    def _forward(self, request: bytes, client: socket.socket) -> bytes:
        """Send ``request`` upstream, pipe its answer to ``client``; the answer's bytes."""
        answer = bytearray()
        try:
            with socket.create_connection(self.upstream) as server:
                server.sendall(request)
                while chunk := server.recv(65536):
                    answer += chunk
                    client.sendall(chunk)
        except OSError:
            pass  # the client gave up meanwhile, or the server went away: the socket closes
        return bytes(answer)


def _read_request(sock: socket.socket) -> bytes | None:
    """One request, its head rewritten to ``Connection: close``; None if the client closed
    first. Bodies have a ``Content-Length`` (the agent sends no chunked bodies)."""
    data = b""
    while _HEAD_END not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(_HEAD_END)
    lines = head.split(b"\r\n")
    length = 0
    kept = [lines[0]]
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        assert name != b"transfer-encoding", "a chunked request body"
        if name == b"content-length":
            length = int(value)
        if name not in (b"connection", b"keep-alive"):
            kept.append(line)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return b"\r\n".join([*kept, b"Connection: close"]) + _HEAD_END + body


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its end (EOF or a reset) without our reading its data."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _lost_mark(cloud: FaultCloud) -> float:
    """When the server marked the node Lost: its pod's ``NodeLost`` event (epoch seconds)."""
    event = next(e for e in cloud.client.pod_events("keeper") if e.reason == NODE_LOST)
    at = event.time if event.time.tzinfo is not None else event.time.replace(tzinfo=UTC)
    return at.timestamp()


def test_an_agent_that_hears_the_server_but_is_not_heard_stops_its_moved_pod(
    tmp_path: Path, archive: Path, database_url: str
) -> None:
    with fault_cloud(tmp_path, archive, database_url, lease_ttl=LEASE_TTL) as cloud:
        proxy = WriteCutProxy(cloud.server.port)
        try:
            stale = cloud.node_agent("gpu-a", server_url=proxy.url, start=False)
            pod_id = _place_keeper(cloud, stale, cloud.node_agent("gpu-b", start=False))
            old_token = cloud.client.get_node("gpu-a").fencing_token
            proxy.cut()
            cut_at = time.monotonic()
            cloud.wait_node("gpu-a", "Lost", timeout=15)  # no renewal was heard
            lost_at = time.monotonic()
            lost_token = cloud.client.get_node("gpu-a").fencing_token
            assert lost_token > old_token  # the lapsed grant is revoked
            # What the agent hears (the poll's answer: the pod is not its any more) is enough.
            wait_for(lambda: stale.alive() and not running(stale), STALE_BOUND_S,
                     "the cut-off agent to stop its stale container")
            [ended] = stale.driver().containers()  # its worker still waits on a write
            assert ended.exit is not None and ended.exit.stop_requested  # the agent killed it
            assert ended.exit.finished_at is not None
            outlived = ended.exit.finished_at - _lost_mark(cloud)
            assert outlived < STALE_BOUND_S
            wait_for(lambda: (p := cloud.client.get_pod("keeper")).node == "gpu-b"
                     and p.phase == "Running", 20, "keeper to run on gpu-b")
            _assert_old_grant_refused(cloud, stale, pod_id, old_token)
            assert proxy.gets_while_cut > 0 and proxy.held > 0  # heard, and not heard
            assert cloud.client.get_node("gpu-a").status == "Lost"  # still cut off
            proxy.heal()
            _assert_healed(cloud, stale, "gpu-b", lost_token)
            # every write that got through late carried the revoked grant: refused
            for write in proxy.late:
                assert (write.status, b"stale fencing token" in write.body) == (409, True), write
            print(f"Lost {lost_at - cut_at:.1f}s after the cut; the stale container ended "
                  f"{outlived:.2f}s after the Lost mark; {proxy.held} writes held, "
                  f"{len(proxy.late)} delivered late, {proxy.gets_while_cut} GETs heard")
        finally:
            proxy.close()
