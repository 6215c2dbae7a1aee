"""`gpucloud server` and `gpucloud config`."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.common import CliError, cli_errors, config_path, save_config
from gpucloud.core.settings import MULTIPROC_ENV, Settings

#: How long a stopping server waits for requests in flight: agents' long polls (up to
#: 60 s) are cut, and the agents simply poll again.
SHUTDOWN_SECONDS = 3
#: How long an idle keep-alive connection stays open (uvicorn's default is 5 s). Longer
#: than an agent's renewal period (TTL/3, and the TTL grows with the fleet:
#: services/lease_ttl.py), else every renewal pays a new TCP connection on both sides
#: (bench/fleet.py: a third of an agent worker's time in connect at TTL 30); and longer
#: than a load balancer's idle timeout in front (60 s on most), as nginx's 75 s.
KEEP_ALIVE_SECONDS = 75
DEFAULT_SSH_PORT = 2222


def server(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on", min=1, max=65535)] = 8080,
    workers: Annotated[int, typer.Option(help="Server processes (PostgreSQL or SQLite)",
                                         min=1, max=64)] = 1,
    access_log: Annotated[bool, typer.Option(help="Log every request")] = False,
    ssh_port: Annotated[int, typer.Option(
        help="Port of the SSH gateway into pods (0: any free port)", min=0, max=65535,
        envvar="GPUCLOUD_SSH_PORT")] = DEFAULT_SSH_PORT,
    ssh_host: Annotated[str | None, typer.Option(
        help="Address of the SSH gateway (default: --host)")] = None,
    controllers: Annotated[bool, typer.Option(
        "--controllers/--no-controllers", envvar="GPUCLOUD_CONTROLLERS",
        help="Run the controllers (one replica leads them). --no-controllers: an API "
             "replica that never leads, for agents apart from the scheduler "
             "(docs/replicas.md)")] = True,
) -> None:
    """Run the control plane (API, scheduler, node leases, the SSH gateway)."""
    with cli_errors():
        if workers > 1 and ssh_port == 0:
            raise CliError("--ssh-port 0 needs --workers 1 (the workers share one port)")
        try:
            from_env = Settings.from_env()
        except ValueError as error:  # a GPUCLOUD_* variable that does not parse
            raise CliError(str(error)) from None
        settings = replace(from_env, ssh_port=ssh_port, ssh_host=ssh_host or host,
                           ssh_reuse_port=workers > 1, controllers=controllers)
        # Worker processes build their settings from the environment.
        os.environ.update(GPUCLOUD_SSH_PORT=str(ssh_port), GPUCLOUD_SSH_HOST=settings.ssh_host,
                          GPUCLOUD_SSH_REUSE_PORT="1" if workers > 1 else "0",
                          GPUCLOUD_CONTROLLERS="1" if controllers else "0")
        settings.home.mkdir(parents=True, exist_ok=True)
        typer.echo(f"gpucloud server on http://{host}:{port} (state in {settings.home}, "
                   f"database {settings.database_url.split('://')[0]})")
        log_level = "info" if access_log else "warning"
        # The server's imports (seconds of CPU) are paid by this command only, so that every
        # other command of the CLI, which imports this module, starts fast.
        import uvicorn  # noqa: PLC0415

        if workers == 1:
            from gpucloud.api.app import create_app  # noqa: PLC0415

            uvicorn.run(create_app(settings), host=host, port=port, access_log=access_log,
                        log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_SECONDS,
                        timeout_keep_alive=KEEP_ALIVE_SECONDS)
        else:
            metrics_dir(settings.home)
            uvicorn.run("gpucloud.api.app:create_app", factory=True, workers=workers,
                        host=host, port=port, access_log=access_log, log_level=log_level,
                        timeout_graceful_shutdown=SHUTDOWN_SECONDS,
                        timeout_keep_alive=KEEP_ALIVE_SECONDS)


def metrics_dir(home: Path) -> None:
    """Several workers: prometheus-client's multiprocess mode, in a folder emptied at start
    (``/metrics`` on any worker then sums the counters of all; docs/usage.md)."""
    folder = Path(os.environ.get(MULTIPROC_ENV) or home / "prometheus")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(folder)


config_app = typer.Typer(help="CLI configuration.", no_args_is_help=True)


@config_app.command("set")
def config_set(
    url: Annotated[str | None, typer.Option(help="Server URL")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key")] = None,
) -> None:
    """Save the server URL and/or API key the CLI uses."""
    with cli_errors():
        values = {k: v for k, v in {"url": url, "api_key": api_key}.items() if v}
        if not values:
            raise CliError("give --url and/or --api-key")
        save_config(values)
        typer.echo(f"saved to {config_path()}")
