"""`gpucloud agent`: run the node agent in the foreground until Ctrl-C or SIGTERM.

Stopping the agent leaves its pods' containers running; started again with the same
state directory, it adopts them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from gpucloud.agent.config import (
    DEFAULT_STOP_GRACE_SECONDS,
    AgentConfig,
    default_node_name,
    default_state_dir,
    parse_labels,
)
from gpucloud.agent.ports import parse_port_range
from gpucloud.cli.common import CliError, cli_errors
from gpucloud.core.models import DEFAULT_POLL_WAIT_SECONDS

if TYPE_CHECKING:
    from gpucloud.agent.agent import Agent

RUNC = "/usr/bin/runc"


def _check_host() -> None:
    """Containers need root and runc; say so in one line rather than fail on the first pod."""
    if os.geteuid() != 0:
        raise CliError("the agent runs containers with runc and needs root (run it with sudo)")
    if shutil.which("runc") is None and not Path(RUNC).exists():
        raise CliError("runc is not installed (Debian: apt-get install runc)")


def _on_signal(agent: Agent) -> None:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def agent(
    server: Annotated[str, typer.Option(help="The gpucloud server's URL")],
    join_token: Annotated[str, typer.Option(help="A join token (gpucloud node join-token)",
                                            envvar="GPUCLOUD_JOIN_TOKEN")],
    name: Annotated[str | None, typer.Option(help="Node name (default: the host name)")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        help="Containers, images and the node's identity (default: $GPUCLOUD_HOME/agent)")
    ] = None,
    simulate: Annotated[str | None, typer.Option(
        help="Advertise a simulated hardware profile (gpucloud gpu profiles)")] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE node label (repeatable)")
                     ] = None,
    address: Annotated[str | None, typer.Option(help="The address others reach this node at")
                       ] = None,
    stop_grace: Annotated[float, typer.Option(
        help="Seconds between SIGTERM and SIGKILL when a pod is stopped", min=0)
    ] = DEFAULT_STOP_GRACE_SECONDS,
    poll_wait: Annotated[float, typer.Option(
        help="Seconds one assignments long-poll may wait", min=0.1, max=60)
    ] = DEFAULT_POLL_WAIT_SECONDS,
    volume_mode: Annotated[str | None, typer.Option(
        help="How network volumes are mounted here: hostpath (the agent is on the server's "
             "machine) or nfs; default: hostpath for a loopback server URL, else nfs")
    ] = None,
    disk_check_interval: Annotated[float, typer.Option(
        help="Seconds between measurements of pods' volume and container disks", min=0.05)
    ] = 30.0,
    network: Annotated[str, typer.Option(
        help="bridge: each pod gets its own network namespace on the agent's bridge; "
             "host: every pod shares the host's network")] = "bridge",
    pod_cidr: Annotated[str | None, typer.Option(
        help="The pods' subnet (default: a free 10.x.y.0/24, kept in the state dir)")
    ] = None,
    port_range: Annotated[str | None, typer.Option(
        help="LOW-HIGH: public TCP ports of pods' N/tcp ports (default 40000-49999)")
    ] = None,
    access_host: Annotated[str | None, typer.Option(
        help="Address of the pod access server the gateway connects to "
             "(default: --address, else 127.0.0.1)")] = None,
    access_port: Annotated[int, typer.Option(
        help="Port of the pod access server (default 0: any free port)", min=0, max=65535)
    ] = 0,
    lazy_cache_gib: Annotated[float | None, typer.Option(
        help="GiB of chunk cache for lazily pulled (eStargz) layers, shared by all pods; "
             "a layer needing more is pulled whole (default 20; applies when the node's "
             "lazyfs daemon starts)", min=0.001, max=1 << 20)] = None,
    lazy_read_deadline: Annotated[float | None, typer.Option(
        help="Seconds a read of a lazily pulled file waits for the registry before the "
             "reader gets EIO (default 30; applies when the node's lazyfs daemon starts)",
        min=0.1, max=3600)] = None,
    usage_interval: Annotated[float, typer.Option(
        help="Seconds between usage samples of each pod (CPU, memory, GPU, network, disk)",
        min=0.2, max=300)] = 5.0,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve Prometheus /metrics on this port (0: any free port)", min=0,
        max=65535)] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of --metrics-port")] = "127.0.0.1",
    hpc_job_mapping_dir: Annotated[Path | None, typer.Option(
        help="Write dcgm-exporter --hpc-job-mapping-dir files (GPU -> pods) here")] = None,
    gpu_sharing: Annotated[str, typer.Option(
        help="Pods with a share of a GPU: mps (an MPS daemon per GPU with their limits) or "
             "time-slicing (no limits)")] = "mps",
    health_interval: Annotated[float, typer.Option(
        help="Seconds between GPU health checks (0: none)", min=0)] = 30.0,
    inject_fault: Annotated[list[str] | None, typer.Option(
        help="Simulated nodes: a GPU fault to inject, GPU<N>:xid<CODE> (repeatable)")] = None,
    fault_file: Annotated[Path | None, typer.Option(
        help="Simulated nodes: a file of GPU<N>:xid<CODE> lines, read at each check")] = None,
    auto_uncordon: Annotated[bool, typer.Option(
        help="Uncordon a node its health checks cordoned once they pass again")] = True,
) -> None:
    """Run the node agent: register this host, hold its lease, run its pods."""
    with cli_errors():
        _check_host()
        if volume_mode not in (None, "hostpath", "nfs"):
            raise CliError(f"--volume-mode: {volume_mode!r} is not hostpath or nfs")
        config = AgentConfig(
            server=server, join_token=join_token, name=name or default_node_name(),
            state_dir=(state_dir or default_state_dir()).resolve(), simulate=simulate,
            labels=parse_labels(label or []), address=address, stop_grace_seconds=stop_grace,
            poll_wait_seconds=poll_wait, runc=shutil.which("runc") or RUNC,
            volume_mode=volume_mode, disk_check_interval_seconds=disk_check_interval,
            network_mode=network, pod_cidr=pod_cidr,
            port_range=parse_port_range(port_range) if port_range else None,
            access_host=access_host, access_port=access_port,
            usage_interval_seconds=usage_interval, metrics_port=metrics_port,
            lazy_cache_bytes=None if lazy_cache_gib is None else int(lazy_cache_gib * 2**30),
            lazy_read_deadline_seconds=lazy_read_deadline,
            metrics_host=metrics_host, hpc_job_mapping_dir=hpc_job_mapping_dir,
            gpu_sharing=gpu_sharing, health_interval_seconds=health_interval,
            inject_faults=tuple(inject_fault or ()), fault_file=fault_file,
            auto_uncordon=auto_uncordon,
        )
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # The agent's imports are paid by this command only (the CLI imports this module).
        from gpucloud.agent.agent import Agent  # noqa: PLC0415

        node_agent = Agent(config)
        if node_agent.hardware_note:
            typer.echo(node_agent.hardware_note, err=True)
        typer.echo(f"gpucloud agent {config.name}: server {config.server}, "
                   f"state in {config.state_dir}", err=True)
        _on_signal(node_agent)
        node_agent.run()
    _exit_without_waiting()


def _exit_without_waiting() -> None:
    """Leave at once once the agent has stopped serving.

    Threads still busy (a layer download, a pod being started) would otherwise hold the
    interpreter's exit (thread pools are joined at exit). What they leave behind is safe:
    files are written atomically and a restarted agent adopts running containers.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    typer.run(agent)
