"""Pod networking: a Linux bridge per agent, a network namespace and a veth per container.

Every agent owns one bridge (``gcb`` + 12 hex digits of its state directory's hash, so
several agents on one machine never share one) holding the first address of the agent's
pod subnet, a /24 by default. A container gets a named network namespace
(``/run/netns/gpucloud-<scope>-<container id>``), a veth pair whose host end is enslaved
to the bridge and whose other end is the namespace's ``eth0``, an address from a small
persistent IPAM and a default route via the bridge. The host routes between the bridges
of all agents (``ip_forward``), so a pod of agent A reaches a pod of agent B by its address;
an iptables MASQUERADE rule gives pods egress where iptables works (if it does not, the
agent says so and carries on).

State, under ``<state-dir>/network/``::

    subnet.json   {"subnet": "10.x.y.0/24"}: chosen once, kept across restarts
    ipam.json     {"<container id>": "10.x.y.z", ...}: the addresses in use
    ipam.lock     flock: one IPAM writer at a time (worker threads, a stale agent)

The subnet is chosen under a host-wide lock (``/run/lock/gpucloud-network.lock``) among the
10.128.0.0/9 /24s that no host interface or route overlaps, and the bridge (with its
address, hence its route) is made before the lock is let go: agents starting at once never
pick the same one. Everything here is idempotent: ``attach`` of an attached container
returns its address, ``detach`` of a detached one does nothing, ``start`` reclaims what a
crashed agent left (addresses, namespaces and veths of containers that are gone) and keeps
the namespaces of running containers, which keep their addresses.

Spares: making a namespace takes two ``ip`` processes, the slowest step of a cached pod's
start. ``make_spare`` makes one ahead, under a name no container id can have
(``~spare-`` + 8 hex digits): its address leased in the IPAM, ``eth0`` with that address
and the default route, loopback up, and its host veth *down and on no bridge*, so nothing
reaches it. A claim turns a spare into a container's: ``take_spare`` re-keys its lease to
the container (the address its bundle names), ``finish_claim`` (on another thread while
the bundle is written) binds the namespace at the container's name and renames its veth to
the container's, puts it on the bridge and sets it up: three syscalls and one netlink
request (runtime/netlink), no ``ip`` process. The
result is what ``attach`` makes, by the same names, so adoption, ``detach`` and
``reclaim`` treat it alike; a spare a crashed agent left is no container of ``keep`` and
is reclaimed like any leak.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucloud.core.errors import InvalidInput
from gpucloud.core.filelock import file_lock
from gpucloud.runtime import netlink
from gpucloud.runtime.errors import RuntimeFailure
from gpucloud.runtime.layout import read_json, write_json_atomic

log = logging.getLogger(__name__)

IP = shutil.which("ip") or "/usr/sbin/ip"
IPTABLES = shutil.which("iptables") or "/usr/sbin/iptables"
HOST_LOCK = Path("/run/lock/gpucloud-network.lock")
NETNS_DIR = Path("/run/netns")
BRIDGE_PREFIX = "gcb"
VETH_PREFIX = "gcv"
#: Where default subnets are picked from: 32768 /24s, rarely used by hosts or clouds.
DEFAULT_POOL = ipaddress.IPv4Network("10.128.0.0/9")
DEFAULT_PREFIX = 24
MIN_PREFIX, MAX_PREFIX = 16, 29
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
COMMAND_TIMEOUT = 30.0
#: Names of spare namespaces (``make_spare``): container ids begin with a letter or digit.
SPARE_PREFIX = "~spare-"


class NetworkError(RuntimeFailure):
    """The pod's network could not be set up (the message is the pod's reason)."""


@dataclass(frozen=True)
class PodAddress:
    """A container's network: its address, the namespace runc joins, the gateway."""

    container_id: str
    ip: str
    netns: str
    gateway: str
    prefix: int


def scope_of(state_dir: Path) -> str:
    """12 hex digits naming this agent's host-level objects (bridge, namespaces)."""
    return hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]


def run_ip(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS``; NetworkError with its message when it fails and ``check``."""
    return _run([IP, *args], stdin=stdin, check=check)


def _run(command: list[str], *, stdin: str | None = None, check: bool = True) -> str:
    try:
        result = subprocess.run(command, input=stdin, capture_output=True, text=True,
                                check=False, timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetworkError(f"{os.path.basename(command[0])} failed: {error}") from None
    if check and result.returncode != 0:
        detail = result.stderr.strip() or f"exit status {result.returncode}"
        raise NetworkError(f"{' '.join(command[:4])}: {detail.splitlines()[-1]}")
    return result.stdout


def parse_pod_cidr(value: str) -> ipaddress.IPv4Network:
    """A ``--pod-cidr``: an IPv4 network with a prefix from /16 to /29."""
    try:
        network = ipaddress.IPv4Network(value, strict=False)
    except ValueError as error:
        raise InvalidInput("pod_cidr", f"{value!r} is not an IPv4 network: {error}") from None
    if not MIN_PREFIX <= network.prefixlen <= MAX_PREFIX:
        raise InvalidInput("pod_cidr",
                           f"{value!r}: the prefix must be /{MIN_PREFIX} to /{MAX_PREFIX}")
    return network


def host_networks(exclude_dev: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the host's routes (all tables) and addresses, except the
    default route and what belongs to ``exclude_dev``."""
    found: list[ipaddress.IPv4Network] = []
    for route in json.loads(run_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "default")
        if dst != "default" and route.get("dev") != exclude_dev:
            found.append(ipaddress.IPv4Network(dst, strict=False))
    for link in json.loads(run_ip("-j", "-4", "addr", "show") or "[]"):
        if link.get("ifname") == exclude_dev:
            continue
        for info in link.get("addr_info", []):
            found.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}",
                                               strict=False))
    return found


def pick_subnet(scope: str, taken: Collection[ipaddress.IPv4Network]
                ) -> ipaddress.IPv4Network:
    """The first free /24 of the default pool, starting at a place derived from ``scope``
    (agents on one machine start apart, so they rarely even look at the same ones)."""
    count = 2 ** (DEFAULT_PREFIX - DEFAULT_POOL.prefixlen)
    start = int(scope, 16) % count
    base = int(DEFAULT_POOL.network_address)
    for step in range(count):
        index = (start + step) % count
        candidate = ipaddress.IPv4Network((base + (index << (32 - DEFAULT_PREFIX)),
                                           DEFAULT_PREFIX))
        if not any(candidate.overlaps(other) for other in taken):
            return candidate
    raise NetworkError(f"no free /{DEFAULT_PREFIX} left in {DEFAULT_POOL} for pods")


class BridgeNetwork:
    """The pod network of one agent (see the module's docstring)."""

    def __init__(self, state_dir: Path, pod_cidr: str | None = None, *,
                 host_lock: Path = HOST_LOCK) -> None:
        self.state_dir = state_dir.resolve()
        self.scope = scope_of(self.state_dir)
        self.bridge = f"{BRIDGE_PREFIX}{self.scope}"
        self.dir = self.state_dir / "network"
        self.requested = parse_pod_cidr(pod_cidr) if pod_cidr else None
        self.host_lock = host_lock
        self.subnet: ipaddress.IPv4Network | None = None
        #: Why pods have no egress (iptables missing or refused); None when they have.
        self.egress_problem: str | None = None
        #: Spare namespaces made by this object and not claimed yet (``make_spare``).
        self._spares: list[str] = []
        self._spares_lock = threading.Lock()

    # -- names ----------------------------------------------------------------------

    @property
    def netns_prefix(self) -> str:
        return f"gpucloud-{self.scope}-"

    def netns_name(self, container_id: str) -> str:
        return self.netns_prefix + container_id

    def netns_path(self, container_id: str) -> Path:
        return NETNS_DIR / self.netns_name(container_id)

    def veth_name(self, container_id: str) -> str:
        """The host end: ``gcv`` + 12 hex digits (interface names have 15 characters)."""
        digest = hashlib.sha256(f"{self.scope}/{container_id}".encode()).hexdigest()
        return f"{VETH_PREFIX}{digest[:12]}"

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return next(self._subnet.hosts())

    @property
    def _subnet(self) -> ipaddress.IPv4Network:
        if self.subnet is None:
            raise NetworkError("the pod network is not started")
        return self.subnet

    # -- the agent's bridge ---------------------------------------------------------

    def start(self, keep: Collection[str]) -> None:
        """Bridge, forwarding and NAT up; reclaim what containers not in ``keep`` left."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self.host_lock):
            self.subnet = self._choose_subnet()
            self._bridge_up()
        self._forwarding()
        self._iptables_rules(add=True)
        self.reclaim(keep)

    def _choose_subnet(self) -> ipaddress.IPv4Network:
        """The persisted subnet, else ``--pod-cidr``, else a free one; persisted."""
        saved = read_json(self.dir / "subnet.json")
        leases = self._leases()
        if saved is not None:
            current = ipaddress.IPv4Network(saved["subnet"])
            if self.requested is None or self.requested == current:
                return current
            if leases:
                raise NetworkError(f"--pod-cidr {self.requested} differs from {current}, "
                                   f"which {len(leases)} running pods still use")
            run_ip("link", "del", self.bridge, check=False)
        chosen = self.requested
        taken = host_networks(exclude_dev=self.bridge)
        if chosen is None:
            chosen = pick_subnet(self.scope, taken)
        elif clash := next((n for n in taken if n.overlaps(chosen)), None):
            raise InvalidInput("pod_cidr", f"{chosen} overlaps {clash}, already on this host")
        write_json_atomic(self.dir / "subnet.json", {"subnet": str(chosen)})
        return chosen

    def _bridge_up(self) -> None:
        if not self._link_exists(self.bridge):
            run_ip("link", "add", self.bridge, "type", "bridge")
        address = f"{self.gateway}/{self._subnet.prefixlen}"
        current = json.loads(run_ip("-j", "-4", "addr", "show", "dev", self.bridge) or "[]")
        have = {f"{i['local']}/{i['prefixlen']}" for link in current
                for i in link.get("addr_info", [])}
        for stale in have - {address}:
            run_ip("addr", "del", stale, "dev", self.bridge)
        if address not in have:
            run_ip("addr", "add", address, "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")

    def _forwarding(self) -> None:
        """Routing between the bridges of all agents, and egress, need it."""
        try:
            if IP_FORWARD.read_text().strip() != "1":
                IP_FORWARD.write_text("1\n")
        except OSError as error:
            log.warning("cannot enable IPv4 forwarding (%s): pods of different agents "
                        "will not reach each other", error)

    def _iptables_specs(self) -> list[tuple[str, str, list[str]]]:
        subnet = str(self._subnet)
        return [
            ("nat", "POSTROUTING",
             ["-s", subnet, "!", "-o", f"{BRIDGE_PREFIX}+", "-j", "MASQUERADE"]),
            ("filter", "FORWARD", ["-i", self.bridge, "-j", "ACCEPT"]),
            ("filter", "FORWARD", ["-o", self.bridge, "-j", "ACCEPT"]),
        ]

    def _iptables_rules(self, *, add: bool) -> None:
        """Add (once) or delete our rules; a host without working iptables is logged."""
        try:
            for table, chain, rule in self._iptables_specs():
                present = self._iptables("-t", table, "-C", chain, *rule, check=False)
                if add and not present:
                    position = ["1"] if chain == "FORWARD" else []
                    verb = "-I" if chain == "FORWARD" else "-A"
                    self._iptables("-t", table, verb, chain, *position, *rule)
                elif not add:
                    while present:
                        self._iptables("-t", table, "-D", chain, *rule)
                        present = self._iptables("-t", table, "-C", chain, *rule, check=False)
        except NetworkError as error:
            if not add:
                log.warning("removing the pod network's iptables rules: %s", error.message)
                return
            self.egress_problem = f"iptables does not work here ({error.message})"
            log.warning("pods have no egress NAT: %s", self.egress_problem)

    @staticmethod
    def _iptables(*args: str, check: bool = True) -> bool:
        """Run iptables; with ``check`` False, whether it succeeded (``-C``)."""
        try:
            result = subprocess.run([IPTABLES, "-w", "5", *args], capture_output=True,
                                    text=True, check=False, timeout=COMMAND_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NetworkError(f"iptables: {error}") from None
        if check and result.returncode != 0:
            raise NetworkError(f"iptables {' '.join(args)}: {result.stderr.strip()}")
        return result.returncode == 0

    def destroy(self) -> None:
        """Remove everything of this agent's pod network (its pods must be gone): every
        namespace and veth, the bridge, the iptables rules and the state."""
        self.reclaim(())
        if (self.dir / "subnet.json").exists() and self.subnet is None:
            self.subnet = ipaddress.IPv4Network(read_json(self.dir / "subnet.json")["subnet"])
        if self.subnet is not None:
            self._iptables_rules(add=False)
        run_ip("link", "del", self.bridge, check=False)
        for name in ("subnet.json", "ipam.json"):
            (self.dir / name).unlink(missing_ok=True)

    # -- containers -----------------------------------------------------------------

    def reserve(self, container_id: str) -> PodAddress:
        """The container's address and namespace path, allocated (once) but not made:
        what its bundle needs while ``attach`` makes them, on another thread."""
        ip = self._allocate(container_id)
        return PodAddress(container_id, ip, str(self.netns_path(container_id)),
                          str(self.gateway), self._subnet.prefixlen)

    def attach(self, container_id: str) -> PodAddress:
        """The container's namespace, veth and address; made once, then returned."""
        address = self.reserve(container_id)
        ip = address.ip
        try:
            if not self._ready(container_id, ip):
                self._plumb(container_id, ip)
        except NetworkError:
            self.detach(container_id)
            raise
        return address

    def _ready(self, container_id: str, ip: str) -> bool:
        """Whether the namespace exists with ``eth0`` holding ``ip`` (adoption, retries)."""
        if not self.netns_path(container_id).exists():
            return False
        shown = run_ip("-n", self.netns_name(container_id), "-j", "-4", "addr", "show",
                       "dev", "eth0", check=False)
        return any(info.get("local") == ip for link in json.loads(shown or "[]")
                   for info in link.get("addr_info", []))

    def _plumb(self, container_id: str, ip: str, *, bridged: bool = True) -> None:
        """Two ``ip -batch`` runs (host side, namespace side): each ``ip`` costs a few
        milliseconds of a pod's start. Leftovers of an earlier try are removed first.
        ``bridged`` False (a spare): the host veth stays down and on no bridge."""
        netns, veth = self.netns_name(container_id), self.veth_name(container_id)
        if self.netns_path(container_id).exists():
            run_ip("netns", "del", netns, check=False)
        if self._link_exists(veth):
            run_ip("link", "del", veth, check=False)
        host_side = f"link set {veth} master {self.bridge} up\n" if bridged else ""
        run_ip("-batch", "-", stdin=(
            f"netns add {netns}\n"
            f"link add {veth} type veth peer name eth0 netns {netns}\n" + host_side))
        run_ip("-n", netns, "-batch", "-", stdin=(
            f"addr add {ip}/{self._subnet.prefixlen} dev eth0\n"
            "link set lo up\nlink set eth0 up\n"
            f"route add default via {self.gateway}\n"))

    # -- spares ---------------------------------------------------------------------

    @property
    def spare_count(self) -> int:
        with self._spares_lock:
            return len(self._spares)

    def free_addresses(self) -> int:
        """How many pod addresses are not leased (spares' included as leased)."""
        return self._subnet.num_addresses - 3 - len(self._leases())

    def make_spare(self) -> str:
        """One namespace made ahead of the container that will claim it (see the
        module); its name. Raises NetworkError (nothing of it left) when it cannot."""
        spare = SPARE_PREFIX + secrets.token_hex(4)
        ip = self._allocate(spare)
        try:
            self._plumb(spare, ip, bridged=False)
        except NetworkError:
            self.detach(spare)
            raise
        with self._spares_lock:
            self._spares.append(spare)
        return spare

    def claim(self, container_id: str) -> PodAddress | None:
        """``take_spare`` and ``finish_claim`` at once (None: no spare left)."""
        taken = self.take_spare(container_id)
        return None if taken is None else self.finish_claim(taken, container_id)

    def take_spare(self, container_id: str) -> str | None:
        """A spare's address leased to the container (what its bundle names: ``reserve``
        returns it from now on); the spare, for ``finish_claim``. None when no spare is
        left, or its lease is not there (then the spare is removed)."""
        with self._spares_lock:
            spare = self._spares.pop(0) if self._spares else None
        if spare is None:
            return None
        with self._ipam() as leases:
            ip = leases.pop(spare, None)
            if ip is not None and container_id not in leases:
                leases[container_id] = ip
                return spare
        log.warning("spare namespace %s (or container %s) is not leased as it should be",
                    spare, container_id)
        self.detach(spare)
        return None

    def finish_claim(self, spare: str, container_id: str) -> PodAddress:
        """Make the taken spare the container's namespace and veth (three syscalls and a
        netlink request, see the module); one it cannot be made into is removed and the
        container's made as ``attach`` makes it, at the same address."""
        try:
            netlink.rename_netns(self.netns_path(spare), self.netns_path(container_id))
            netlink.set_link(self.veth_name(spare), new_name=self.veth_name(container_id),
                             master=self.bridge, up=True)
        except OSError as error:
            log.warning("claiming spare namespace %s for %s: %s", spare, container_id, error)
            self._unplumb(spare)
            self._unplumb(container_id)
            return self.attach(container_id)
        return self.reserve(container_id)

    def drop_spares(self) -> None:
        """Remove the spares not claimed (the agent stops: a new one makes its own)."""
        with self._spares_lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            self.detach(spare)

    def detach(self, container_id: str) -> None:
        """Remove the container's namespace and veth and free its address (idempotent)."""
        self._unplumb(container_id)
        with self._ipam() as leases:
            leases.pop(container_id, None)

    def _unplumb(self, container_id: str) -> None:
        """The container's namespace and veth removed (its address stays leased)."""
        run_ip("netns", "del", self.netns_name(container_id), check=False)
        run_ip("link", "del", self.veth_name(container_id), check=False)

    def reclaim(self, keep: Collection[str]) -> None:
        """Detach every container of this agent not in ``keep`` (leaks of a crash), and
        every spare namespace (this object's own too: they are made again)."""
        with self._spares_lock:
            self._spares = []
        known = set(self._leases()) | self._namespaced()
        for container_id in sorted(known - set(keep)):
            log.info("reclaiming the network of container %s", container_id)
            self.detach(container_id)
        wanted = {self.veth_name(cid) for cid in keep}
        for veth in self._bridge_ports():
            if veth not in wanted:
                run_ip("link", "del", veth, check=False)

    def address_of(self, container_id: str) -> str | None:
        return self._leases().get(container_id)

    # -- helpers --------------------------------------------------------------------

    def _allocate(self, container_id: str) -> str:
        with self._ipam() as leases:
            if container_id in leases:
                return leases[container_id]
            used = set(leases.values())
            for host in list(self._subnet.hosts())[1:]:
                if str(host) not in used:
                    leases[container_id] = str(host)
                    return str(host)
        raise NetworkError(f"no free pod address left in {self._subnet}")

    @contextmanager
    def _ipam(self) -> Iterator[dict[str, str]]:
        """The leases, read and written back under the IPAM lock."""
        with file_lock(self.dir / "ipam.lock"):
            leases = self._leases()
            before = dict(leases)
            yield leases
            if leases != before:
                write_json_atomic(self.dir / "ipam.json", leases)

    def _leases(self) -> dict[str, str]:
        data: Any = read_json(self.dir / "ipam.json")
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _namespaced(self) -> set[str]:
        try:
            names = [entry.name for entry in NETNS_DIR.iterdir()]
        except FileNotFoundError:
            return set()
        return {name.removeprefix(self.netns_prefix) for name in names
                if name.startswith(self.netns_prefix)}

    def _bridge_ports(self) -> list[str]:
        if not self._link_exists(self.bridge):
            return []
        shown = run_ip("-j", "link", "show", "master", self.bridge, check=False)
        return [link["ifname"] for link in json.loads(shown or "[]")]

    @staticmethod
    def _link_exists(name: str) -> bool:
        return Path("/sys/class/net", name).exists()
