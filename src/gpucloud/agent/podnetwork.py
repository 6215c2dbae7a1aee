"""A pod's network as the agent gives it: its own namespace on the agent's bridge (or the
host's network), its ports recorded like RunPod's ``runtime.ports``, its ``N/tcp`` ports
published on the node, the variables that tell the pod about them, and ``network.json``.

``<state-dir>/containers/<cid>/network.json`` is what other parts of the agent read (the
access server relays ``ssh -L`` to ``ip``)::

    {"ip": "10.x.y.z", "host_network": false, "netns": "/run/netns/…",
     "ports": [{"ip", "isIpPublic", "privatePort", "publicPort", "type"}, …]}

Node modes: ``bridge`` (the default) gives every pod its own namespace, except a job's
members (``assignment.host_network``: they rendezvous over their nodes' addresses);
``host`` gives every pod the host's network, as before pods had namespaces.

Spare namespaces: in bridge mode the agent keeps ``spares`` namespaces made ahead
(runtime/network ``make_spare``); a pod's start claims one (``prepare``) instead of
running ``ip`` twice. They are made on a thread of their own once no start is under way
(from ``prepare`` to ``started``: its container runs and its first output has shipped) and
none has begun or ended for ``spare_idle`` seconds, so a start has the CPU to itself and a
steady stream of starts still finds spares between them; never when the subnet has fewer
free addresses than a margin; removed when the agent stops. A start that never says it
``started`` (its worker failed) stops counting after ``START_SECONDS``. With none left (a
burst of starts) a start makes its namespace on a thread, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from gpucloud.agent.ports import DEFAULT_PORT_RANGE, PortForwarder, listen_hosts
from gpucloud.core.access import PodNetwork, PortMapping
from gpucloud.core.models import AssignmentOut
from gpucloud.core.trace import mark
from gpucloud.runtime.layout import read_json, write_json_atomic
from gpucloud.runtime.network import BridgeNetwork, NetworkError, PodAddress

log = logging.getLogger(__name__)
NETWORK_MODES = ("bridge", "host")
#: Spare namespaces kept made ahead, and how long after the last start began or ended
#: (none under way) the next is made.
SPARE_NAMESPACES = 2
SPARE_IDLE_SECONDS = 0.05
#: A start that has not said ``started`` by then no longer holds the spares back.
START_SECONDS = 10.0
#: Spares are made only while the subnet has more free addresses than this (a /29 none).
SPARE_ADDRESS_MARGIN = 8


@dataclass(frozen=True)
class PodNet:
    """One container's network."""

    ip: str
    host_network: bool
    netns: str | None
    public_ip: str
    ports: tuple[PortMapping, ...] = ()

    def report(self) -> PodNetwork:
        return PodNetwork(ip=self.ip, host_network=self.host_network, ports=list(self.ports))

    def document(self) -> dict[str, object]:
        return {"ip": self.ip, "host_network": self.host_network, "netns": self.netns,
                "public_ip": self.public_ip,
                "ports": [port.model_dump() for port in self.ports]}

    @classmethod
    def from_document(cls, data: dict[str, object]) -> PodNet:
        ports = data.get("ports")
        return cls(ip=str(data["ip"]), host_network=bool(data["host_network"]),
                   netns=str(data["netns"]) if data.get("netns") else None,
                   public_ip=str(data.get("public_ip") or data["ip"]),
                   ports=tuple(PortMapping.model_validate(p)
                               for p in (ports if isinstance(ports, list) else [])))

    def public_ports(self) -> dict[int, int]:
        """Private port → public port of the ``tcp`` ports."""
        return {p.privatePort: p.publicPort for p in self.ports
                if p.isIpPublic and p.publicPort is not None}

    def env(self, pod_id: str) -> dict[str, str]:
        """RunPod's variables and ours: the public IP, each TCP port's public port."""
        env = {"RUNPOD_POD_ID": pod_id, "GPUCLOUD_POD_ID": pod_id,
               "RUNPOD_PUBLIC_IP": self.public_ip, "GPUCLOUD_PUBLIC_IP": self.public_ip,
               "GPUCLOUD_POD_IP": self.ip}
        for private, public in self.public_ports().items():
            env[f"RUNPOD_TCP_PORT_{private}"] = str(public)
            env[f"GPUCLOUD_TCP_PORT_{private}"] = str(public)
        return env


def node_network(state_dir: Path, *, mode: str, pod_cidr: str | None, address: str | None,
                 port_range: tuple[int, int] | None) -> NodeNetwork:
    """The agent's pod networks, started: public ports on ``address`` and 127.0.0.1."""
    forwarder = PortForwarder(listen_hosts(address), port_range or DEFAULT_PORT_RANGE,
                              seed=str(state_dir.resolve()))
    network = NodeNetwork(state_dir, mode=mode, pod_cidr=pod_cidr,
                          public_ip=address or "127.0.0.1", forwarder=forwarder)
    network.start()
    return network


def parse_ports(ports: Collection[str]) -> list[tuple[int, str]]:
    """``["8888/http", "22/tcp", "53"]`` → ``[(8888, "http"), (22, "tcp"), (53, "tcp")]``."""
    parsed = []
    for port in ports:
        number, _, kind = str(port).partition("/")
        parsed.append((int(number), kind or "tcp"))
    return parsed


class NodeNetwork:
    """Every pod network of one agent: the bridge, the public ports, ``network.json``."""

    def __init__(self, state_dir: Path, *, mode: str = "bridge", pod_cidr: str | None = None,
                 public_ip: str, forwarder: PortForwarder, spares: int = SPARE_NAMESPACES,
                 spare_idle: float = SPARE_IDLE_SECONDS) -> None:
        self.containers_dir = state_dir.resolve() / "containers"
        self.mode = mode
        self.public_ip = public_ip
        self.forwarder = forwarder
        self.bridge = BridgeNetwork(state_dir, pod_cidr) if mode == "bridge" else None
        #: Namespaces being made ahead (``prepare``), by container id.
        self._early: dict[str, Future[PodAddress]] = {}
        self._early_lock = threading.Lock()
        self.spares = spares
        self.spare_idle = spare_idle
        #: Set by each start's beginning and end (and at start): the spare maker looks
        #: whether to make more.
        self._spares_wanted = threading.Event()
        self._closed = threading.Event()
        #: Starts under way (``prepare`` to ``started``): container id -> when it began.
        self._starting: dict[str, float] = {}
        self._last_activity = 0.0
        self._spare_maker: threading.Thread | None = None

    def start(self) -> None:
        """Bring the bridge up; reclaim what containers that are gone left behind (the
        containers still in the state directory keep their namespaces and addresses);
        start making spare namespaces."""
        if self.bridge is None:
            return
        present = ([p.name for p in self.containers_dir.iterdir() if p.is_dir()]
                   if self.containers_dir.is_dir() else [])
        self.bridge.start(present)  # logs it when iptables does not work (no egress NAT)
        if self.spares > 0:
            self._spare_maker = threading.Thread(target=self._make_spares, daemon=True,
                                                 name="spare-netns")
            self._spares_wanted.set()
            self._spare_maker.start()

    def _make_spares(self) -> None:
        """Keep ``spares`` namespaces made ahead (the spare maker's thread)."""
        bridge = self.bridge
        assert bridge is not None
        while self._spares_wanted.wait() and not self._closed.is_set():
            self._spares_wanted.clear()
            if not self._settled():
                return
            while (bridge.spare_count < self.spares and not self._closed.is_set()
                   and bridge.free_addresses() > SPARE_ADDRESS_MARGIN):
                mark("agent.netns.spare.start")
                try:
                    bridge.make_spare()
                except (NetworkError, OSError) as error:
                    log.warning("making a spare network namespace: %s", error)
                    break  # tried again after the next start
                finally:
                    mark("agent.netns.spare.end")
                if self._spares_wanted.is_set():
                    break  # a start meanwhile: wait for it to end first

    def _settled(self) -> bool:
        """Wait until no start is under way and none began or ended for ``spare_idle``
        seconds; False when the network closes meanwhile."""
        while True:
            activity = self._last_activity
            if self._closed.wait(self.spare_idle):
                return False
            with self._early_lock:
                now = time.monotonic()
                under_way = [began for began in self._starting.values()
                             if now - began < START_SECONDS]
            if under_way:  # woken by its end (or another start), else when it times out
                self._spares_wanted.wait(max(0.0, min(under_way) + START_SECONDS - now))
                self._spares_wanted.clear()
                continue
            if activity == self._last_activity:
                return True

    @property
    def note(self) -> str | None:
        """What the node's owner should know (no egress NAT here)."""
        return self.bridge.egress_problem if self.bridge else None

    def path(self, cid: str) -> Path:
        return self.containers_dir / cid / "network.json"

    def prepare(self, cid: str, assignment: AssignmentOut) -> None:
        """The pod's namespace, on a thread of its own while the worker pulls, prepares
        the rootfs and writes the bundle: a spare's address taken here and the spare
        turned into the pod's there (see the module), else made there (two ``ip`` runs,
        the slowest step of a cached start without spares); ``ready`` waits for it
        before the container starts."""
        if assignment.host_network or self.bridge is None:
            return
        bridge = self.bridge
        future: Future[PodAddress] = Future()
        spare = bridge.take_spare(cid) if self.spares > 0 else None
        with self._early_lock:
            self._starting[cid] = time.monotonic()
        self._want_spares()

        def make() -> None:
            try:
                if spare is not None:
                    future.set_result(bridge.finish_claim(spare, cid))
                    mark("agent.netns.claimed")
                else:
                    future.set_result(bridge.attach(cid))
                mark("agent.netns.made")
            except BaseException as error:  # noqa: BLE001 - handed to ``ready``
                future.set_exception(error)

        with self._early_lock:
            if cid in self._early:
                return
            self._early[cid] = future
        threading.Thread(target=make, name=f"netns-{cid[:16]}", daemon=True).start()

    def started(self, cid: str) -> None:
        """The container's start is over (it runs, its first output shipped): spares
        may be made again once no other start is under way."""
        with self._early_lock:
            began = self._starting.pop(cid, None)
        if began is not None:
            self._want_spares()

    def _want_spares(self) -> None:
        self._last_activity = time.monotonic()
        self._spares_wanted.set()

    def ready(self, cid: str) -> None:
        """Wait for the namespace ``prepare`` started; raises what making it raised."""
        with self._early_lock:
            future = self._early.pop(cid, None)
        if future is not None:
            future.result()

    def attach(self, cid: str, assignment: AssignmentOut) -> PodNet:
        """Namespace (unless host networking), public ports, ``network.json``. After
        ``prepare`` only its address is taken here (the namespace is made, or a spare
        turned into it, meanwhile)."""
        host = assignment.host_network or self.bridge is None
        netns = None
        ip = self.public_ip
        if not host:
            assert self.bridge is not None
            with self._early_lock:
                early = cid in self._early
            address = self.bridge.reserve(cid) if early else self.bridge.attach(cid)
            ip, netns = address.ip, address.netns
        try:
            ports = self._ports(cid, ip, host, assignment.ports, {})
        except OSError:
            self.detach(cid)
            raise
        net = PodNet(ip=ip, host_network=host, netns=netns, public_ip=self.public_ip,
                     ports=tuple(ports))
        self.path(cid).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path(cid), net.document())
        return net

    def adopt(self, cid: str) -> PodNet | None:
        """A running container a previous agent started: publish its ports again, at the
        public ports its environment names (another one, with a warning, if taken)."""
        data = read_json(self.path(cid))
        if not isinstance(data, dict):
            return None
        net = PodNet.from_document(data)
        wanted = net.public_ports()
        kinds = [(p.privatePort, p.type) for p in net.ports if not p.isIpPublic]
        ports = self._ports(cid, net.ip, net.host_network,
                            [f"{n}/{kind}" for n, kind in kinds], wanted)
        if ports != list(net.ports):
            net = PodNet(net.ip, net.host_network, net.netns, net.public_ip, tuple(ports))
            write_json_atomic(self.path(cid), net.document())
        return net

    def detach(self, cid: str) -> None:
        """Close the container's public ports and remove its namespace (idempotent)."""
        try:
            self.ready(cid)  # a namespace still being made is removed once made
        except Exception as error:  # noqa: BLE001 - its making failed: remove what is left
            log.debug("container %s: its namespace was not made: %s", cid, error)
        self.started(cid)  # a start that failed is over too
        self.forwarder.unpublish(cid)
        if self.bridge is not None:
            self.bridge.detach(cid)

    def close(self) -> None:
        """Public ports closed, spares removed (pods and their namespaces stay)."""
        self._closed.set()
        self._spares_wanted.set()
        if self._spare_maker is not None:
            self._spare_maker.join(timeout=10)
        if self.bridge is not None:
            self.bridge.drop_spares()
        self.forwarder.close()

    def _ports(self, cid: str, ip: str, host: bool, ports: Collection[str],
               wanted: dict[int, int]) -> list[PortMapping]:
        """A private entry per port; a public one per ``tcp`` port (its forwarder; with
        host networking the pod listens on the node itself: public port = private)."""
        mappings: list[PortMapping] = []
        for number, kind in parse_ports(ports):
            mappings.append(PortMapping(ip=ip, isIpPublic=False, privatePort=number,
                                        type=kind))
            if kind != "tcp":
                continue
            public = number if host else self._publish(cid, (ip, number), wanted.get(number))
            mappings.append(PortMapping(ip=self.public_ip, isIpPublic=True,
                                        privatePort=number, publicPort=public, type=kind))
        return mappings

    def _publish(self, cid: str, target: tuple[str, int], wanted: int | None) -> int:
        if wanted is not None:
            try:
                return self.forwarder.publish(cid, target, wanted)
            except OSError as error:
                log.warning("container %s: public port %d is taken (%s); its port %d gets "
                            "another one", cid, wanted, error, target[1])
        return self.forwarder.publish(cid, target)
