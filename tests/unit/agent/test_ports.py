"""Public TCP ports over real loopback sockets: allocation by binding, relaying both ways
with half-close, closing; and the records and variables a pod's network yields."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.agent.podnetwork import PodNet, node_network, parse_ports
from gpucloud.agent.ports import PortForwarder, parse_port_range
from gpucloud.core.access import PortMapping
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from tests.fixtures.postgres import free_port


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A TCP server on 127.0.0.1 that answers each connection with ``got:`` + all it read,
    once the client has half-closed."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                conn.sendall(b"got:" + data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    server.close()


def exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_a_public_port_relays_to_its_target_both_ways(echo: tuple[str, int]) -> None:
    first = free_port()
    forwarder = PortForwarder(["127.0.0.1"], (first, first + 20), seed="agent-a")
    try:
        public = forwarder.publish("c1", echo)
        other = forwarder.publish("c2", echo)
        assert public != other and {public, other} <= set(range(first, first + 21))
        payload = b"x" * 3_000_000
        assert exchange(public, payload) == b"got:" + payload
        assert exchange(other, b"hi") == b"got:hi"
        assert forwarder.ports_of("c1") == {echo: public}
        forwarder.unpublish("c1")
        forwarder.unpublish("c1")  # idempotent
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", public), timeout=5).close()
        assert exchange(other, b"still") == b"got:still"
    finally:
        forwarder.close()


def test_ports_in_use_are_skipped_and_a_full_range_is_an_error(echo: tuple[str, int]
                                                                ) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    forwarder = PortForwarder(["127.0.0.1"], (port, port), seed="agent-b")
    try:
        with pytest.raises(OSError, match="no free public port"):
            forwarder.publish("c1", echo)
        with pytest.raises(OSError):
            forwarder.publish("c1", echo, public_port=port)
        taken.close()
        assert forwarder.publish("c1", echo, public_port=port) == port  # re-established
        assert exchange(port, b"again") == b"got:again"
    finally:
        taken.close()
        forwarder.close()


def test_a_connection_to_a_target_that_is_gone_is_closed(echo: tuple[str, int]) -> None:
    gone = free_port()
    first = free_port()
    forwarder = PortForwarder(["127.0.0.1"], (first, first + 20), seed="agent-c")
    try:
        public = forwarder.publish("c1", ("127.0.0.1", gone))
        with socket.create_connection(("127.0.0.1", public), timeout=5) as sock:
            assert sock.recv(100) == b""  # closed, not left hanging
    finally:
        forwarder.close()


@pytest.mark.parametrize(("value", "ok"), [("40000-40999", (40000, 40999)),
                                           ("40000", None), ("1-2", None),
                                           ("50000-40000", None), ("a-b", None)])
def test_port_range_parsing(value: str, ok: tuple[int, int] | None) -> None:
    if ok is not None:
        assert parse_port_range(value) == ok
        return
    with pytest.raises(InvalidInput) as caught:
        parse_port_range(value)
    assert caught.value.field == "port_range"


def test_a_pod_network_gives_runpods_records_and_variables() -> None:
    assert parse_ports(["8888/http", "22/tcp", "53/udp", "9000"]) == [
        (8888, "http"), (22, "tcp"), (53, "udp"), (9000, "tcp")]
    net = PodNet(ip="10.128.0.2", host_network=False, netns="/run/netns/x",
                 public_ip="127.0.0.2", ports=(
                     PortMapping(ip="10.128.0.2", isIpPublic=False, privatePort=22, type="tcp"),
                     PortMapping(ip="127.0.0.2", isIpPublic=True, privatePort=22,
                                 publicPort=40007, type="tcp"),
                     PortMapping(ip="10.128.0.2", isIpPublic=False, privatePort=8888,
                                 type="http")))
    env = net.env("abc")
    assert env["RUNPOD_TCP_PORT_22"] == env["GPUCLOUD_TCP_PORT_22"] == "40007"
    assert env["RUNPOD_PUBLIC_IP"] == env["GPUCLOUD_PUBLIC_IP"] == "127.0.0.2"
    assert env["RUNPOD_POD_ID"] == env["GPUCLOUD_POD_ID"] == "abc"
    assert env["GPUCLOUD_POD_IP"] == "10.128.0.2" and "RUNPOD_TCP_PORT_8888" not in env
    assert PodNet.from_document(net.document()) == net
    assert net.report().ip == "10.128.0.2" and len(net.report().ports) == 3


def test_host_networking_publishes_each_tcp_port_as_itself(tmp_path: Path) -> None:
    """``--network host`` (and a job's members): no namespace, the pod listens on the node."""
    network = node_network(tmp_path, mode="host", pod_cidr=None, address="127.0.0.1",
                           port_range=None)
    assignment = AssignmentOut(pod_id="p1", name="web", project="p", attempt=1,
                               desired_state="running", phase=PodPhase.SCHEDULED,
                               image="busybox", command=[], env={},
                               ports=["8000/tcp", "8888/http"], cpu_milli=1000,
                               memory_bytes=1 << 30, gpu_uuids=[])
    try:
        net = network.attach("p1-1", assignment)
        assert net.host_network and net.netns is None and net.ip == "127.0.0.1"
        assert net.public_ports() == {8000: 8000}
        assert [(p.privatePort, p.type, p.isIpPublic) for p in net.ports] == [
            (8000, "tcp", False), (8000, "tcp", True), (8888, "http", False)]
        written = json.loads((tmp_path / "containers" / "p1-1" / "network.json").read_text())
        assert written["ip"] == "127.0.0.1" and written["host_network"] is True
        assert network.adopt("p1-1") == net
        network.detach("p1-1")
    finally:
        network.close()
