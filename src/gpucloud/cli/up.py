"""`gpucloud up`: a one-node GPU cloud on this machine, for trying gpucloud out.

What ``make up`` runs after installing packages: the server on SQLite and one local agent
(real GPUs when NVML finds them, else ``--simulate dgx-h100``), each as a child process
logging under ``$GPUCLOUD_HOME``; the demo image is built from the host's busybox and the
``gpucloud-demo`` script and imported as ``gpucloud/demo`` (no network needed); the CLI
config is written so the next ``gpucloud`` command talks to this server. Ctrl-C stops both;
pods' containers keep running and are adopted when ``gpucloud up`` runs again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated

import httpx
import typer

from gpucloud.agent.config import default_node_name, default_state_dir
from gpucloud.cli.common import CliError, cli_errors, save_config
from gpucloud.client import GpucloudClient
from gpucloud.core.settings import gpucloud_home
from gpucloud.gpu.discovery import discover
from gpucloud.images import ImageManager
from gpucloud.images.testing import BUSYBOX, busybox_image, file
from gpucloud.runtime.demo import DEMO_SCRIPT

DEMO_IMAGE = "gpucloud/demo:latest"
RUNC = Path("/usr/bin/runc")
START_TIMEOUT_SECONDS = 60.0
GRACEFUL_STOP_SECONDS = 3.0


def build_demo_archive(path: Path) -> Path:
    """An OCI layout tarball of ``gpucloud/demo``: static busybox plus ``gpucloud-demo``."""
    image = busybox_image(
        cmd=["gpucloud-demo"],
        extra_files={"usr/local/bin/gpucloud-demo": file(DEMO_SCRIPT.read_bytes(), 0o755)},
    )
    return image.write_oci_layout(path, DEMO_IMAGE, as_tar=True)


def import_demo_image(state_dir: Path, workdir: Path) -> None:
    archive = build_demo_archive(workdir / "gpucloud-demo.oci.tar")
    with ImageManager(state_dir) as manager:
        manager.import_archive(archive)


def _preflight(port: int, ssh_port: int) -> None:
    """One line saying what is missing, before anything starts."""
    if os.geteuid() != 0:
        raise CliError("gpucloud up needs root: runc runs the pods' containers "
                       "(run: sudo make up)")
    for path, package in ((RUNC, "runc"), (BUSYBOX, "busybox-static")):
        if not path.exists():
            raise CliError(f"{path} is missing: apt-get install {package}")
    for number, option in ((port, "--port"), (ssh_port, "--ssh-port")):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind(("127.0.0.1", number))
            except OSError:
                raise CliError(f"port {number} is in use (is gpucloud already up? "
                               f"try {option})") from None


def _spawn(args: list[str], log: Path, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    """A child in its own session, so the terminal's Ctrl-C reaches only us: we stop the
    children in order (agent first) instead of racing them."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})


def _wait(check: Callable[[], object], process: subprocess.Popen[bytes], log: Path,
          what: str) -> None:
    """Poll ``check()`` until true; fail with the log's last line if ``process`` dies."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not check():
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise CliError(f"{what} exited with status {process.returncode}: {tail[0]} "
                           f"(see {log})")
        if time.monotonic() > deadline:
            raise CliError(f"{what} did not come up in {START_TIMEOUT_SECONDS:g}s (see {log})")
        time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1.0).is_success
    except httpx.TransportError:
        return False


def _admin_key(home: Path) -> str | None:
    try:
        return os.environ.get("GPUCLOUD_ADMIN_KEY") or (home / "admin.key").read_text().strip()
    except OSError:
        return None


def _node_ready(client: GpucloudClient, name: str) -> bool:
    return any(n.name == name and n.status == "Ready" for n in client.list_nodes())


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Interrupt the agent first (it leaves pods running), then the server.

    A second SIGINT makes uvicorn skip waiting for in-flight requests (an agent's
    long-poll can hold one for its whole wait).
    """
    for process in processes:
        for _ in range(2):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(GRACEFUL_STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    continue
        if process.poll() is None:
            process.kill()
        process.wait()


def _summary(url: str, ssh_port: int, home: Path, simulate: str | None, logs: Path) -> None:
    hardware = "simulated dgx-h100 (8x H100 80GB)" if simulate else "this host's GPUs"
    typer.echo(f"""
gpucloud is up: one node with {hardware}
  API:        {url}   (OpenAPI at {url}/docs)
  SSH:        ssh -p {ssh_port} <pod-id>@127.0.0.1   (after: gpucloud ssh-key add KEY.pub)
  admin key:  {home / 'admin.key'}   (the CLI is configured: {home / 'config.json'})
  logs:       {logs}/server.log, {logs}/agent.log

Try:
  gpucloud pod create hello --image gpucloud/demo --gpus 2 -- gpucloud-demo
  gpucloud pod logs hello
  gpucloud pod create box --image gpucloud/demo --volume-size 1Gi -- sleep 86400
  gpucloud pod exec box -- df -h /workspace
  gpucloud node list

Ctrl-C stops the server and the agent.""")


def _serve_until_interrupted(processes: list[subprocess.Popen[bytes]]) -> None:
    stop = threading.Event()

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop.wait(0.5):
        ended = [p for p in processes if p.poll() is not None]
        if ended:
            typer.echo(f"a gpucloud process exited ({ended[0].returncode}); stopping", err=True)
            break
    typer.echo("stopping the agent and the server…", err=True)
    _stop(processes)


def up(
    port: Annotated[int, typer.Option(help="Port for the API", min=1, max=65535)] = 8080,
    ssh_port: Annotated[int, typer.Option(help="Port for the SSH gateway",
                                          min=1, max=65535)] = 2222,
    simulate: Annotated[str | None, typer.Option(
        help="Hardware profile to simulate (default: dgx-h100 unless NVML finds GPUs)")] = None,
) -> None:
    """Start a one-node gpucloud here: server, agent and the demo image."""
    with cli_errors():
        _preflight(port, ssh_port)
        home, state_dir, name = gpucloud_home(), default_state_dir(), default_node_name()
        home.mkdir(parents=True, exist_ok=True)
        if simulate is None and discover(None, name).provider != "nvml":
            simulate = "dgx-h100"
        import_demo_image(state_dir, home)
        url = f"http://127.0.0.1:{port}"
        server = _spawn(["gpucloud.cli.main", "server", "--port", str(port),
                         "--ssh-port", str(ssh_port)], home / "server.log")
        processes = [server]
        try:
            _wait(lambda: _healthy(url) and _admin_key(home), server, home / "server.log",
                  "the server")
            key = _admin_key(home) or ""
            client = GpucloudClient(url, key)
            agent_args = ["gpucloud.cli.agent", "--server", url, "--name", name,
                          "--state-dir", str(state_dir)]
            token = {"GPUCLOUD_JOIN_TOKEN": client.create_join_token().token}
            agent = _spawn(agent_args + (["--simulate", simulate] if simulate else []),
                           home / "agent.log", token)
            processes.insert(0, agent)
            _wait(lambda: _node_ready(client, name), agent, home / "agent.log", "the agent")
            save_config({"url": url, "api_key": key})
        except BaseException:
            _stop(processes)
            raise
        _summary(url, ssh_port, home, simulate, home)
        _serve_until_interrupted(processes)
