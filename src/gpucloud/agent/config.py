"""What an agent is started with, and the defaults shared with ``gpucloud image``."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import DEFAULT_POLL_WAIT_SECONDS, MAX_POLL_WAIT_SECONDS
from gpucloud.core.names import check_dns_label
from gpucloud.core.settings import gpucloud_home

DEFAULT_STOP_GRACE_SECONDS = 30.0
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


def poll_wait(own: float, asked: float | None) -> float:
    """The wait of the next long poll: the agent's own, or the longer one the server asks
    of a large fleet (``AssignmentsOut.poll_wait_seconds``, services/lease_ttl.py), at most
    ``MAX_POLL_WAIT_SECONDS``. A change still ends a poll at once, whatever its wait."""
    return own if asked is None else max(own, min(asked, MAX_POLL_WAIT_SECONDS))


def default_state_dir() -> Path:
    """``$GPUCLOUD_HOME/agent``: one agent per host needs nothing more; more need their own."""
    return gpucloud_home() / "agent"


def default_node_name() -> str:
    """The host name, made a DNS label (lower case, other characters as '-')."""
    name = _NOT_LABEL.sub("-", socket.gethostname().split(".")[0].lower()).strip("-")
    return name[:63] or "node"


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; InvalidInput names the malformed one."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidInput("label", f"{pair!r} is not KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


@dataclass(frozen=True)
class AgentConfig:
    """Everything an agent run depends on; timings are settable so tests can be fast.

    ``stop_grace_seconds`` applies when a pod is stopped (SIGTERM, then SIGKILL after it);
    ``poll_wait_seconds`` bounds one assignments long-poll, and so how long ``stop`` can
    take to be noticed by the poller.
    """

    server: str
    join_token: str
    name: str
    state_dir: Path
    simulate: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    address: str | None = None
    stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS
    poll_wait_seconds: float = DEFAULT_POLL_WAIT_SECONDS
    watch_interval_seconds: float = 0.1
    runc: str = "/usr/bin/runc"
    #: How network volumes are mounted: ``hostpath`` or ``nfs``; None: hostpath when the
    #: server URL is loopback, else nfs (agent/volumes.default_volume_mode).
    volume_mode: str | None = None
    #: How often running pods' volume and container disks are measured (checked limit).
    disk_check_interval_seconds: float = 30.0
    #: ``bridge``: a network namespace per pod on the agent's bridge; ``host``: every pod
    #: shares the host's network. ``pod_cidr`` None: a free 10.x.y.0/24 (runtime/network).
    network_mode: str = "bridge"
    pod_cidr: str | None = None
    #: Public TCP ports of ``N/tcp`` pod ports (agent/ports); None: the default range.
    port_range: tuple[int, int] | None = None
    #: The pod access server (SSH from the server's gateway): its address, None for
    #: ``address`` (else 127.0.0.1), and port, 0 for any free one.
    access_host: str | None = None
    access_port: int = 0
    #: How often each running pod's usage is sampled (agent/usage).
    usage_interval_seconds: float = 5.0
    #: Prometheus ``/metrics`` of this agent (agent/metrics): port (None: not served,
    #: 0: any free one) and address; dcgm-exporter job-mapping folder (None: not written).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    hpc_job_mapping_dir: Path | None = None
    #: How pods with a share of a GPU share it: ``mps`` (a daemon per GPU with the pods'
    #: limits) or ``time-slicing`` (no limits) (gpu/mps).
    gpu_sharing: str = "mps"
    #: GPU health checks (gpu/health): seconds between checks (0: none), the faults a
    #: simulated node injects (``GPU3:xid79``) and the file a test writes more into,
    #: whether a node cordoned by its checks is uncordoned when they pass again.
    health_interval_seconds: float = 30.0
    inject_faults: tuple[str, ...] = ()
    fault_file: Path | None = None
    auto_uncordon: bool = True
    #: The node's lazyfs daemon (images/lazy/daemon.py): its chunk cache's size and how
    #: long a lazy read waits for the registry; None: the daemon's defaults (20 GiB, 30 s).
    #: They apply when the daemon starts: one already running keeps its own.
    lazy_cache_bytes: int | None = None
    lazy_read_deadline_seconds: float | None = None

    def __post_init__(self) -> None:
        check_dns_label("name", self.name)
        if self.gpu_sharing not in ("mps", "time-slicing"):
            raise InvalidInput("gpu_sharing",
                               f"{self.gpu_sharing!r} is not mps or time-slicing")
        if not 0 <= self.access_port <= 65535:
            raise InvalidInput("access_port", f"{self.access_port} is not a port (0-65535)")
        if self.network_mode not in ("bridge", "host"):
            raise InvalidInput("network", f"{self.network_mode!r} is not bridge or host")
