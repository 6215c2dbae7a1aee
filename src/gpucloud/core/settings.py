"""Server settings from the environment, with embedded defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def gpucloud_home() -> Path:
    return Path(os.environ.get("GPUCLOUD_HOME") or Path.home() / ".gpucloud")


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    admin_key: str | None = None
    lease_ttl_seconds: float = 10.0
    join_token_ttl_seconds: float = 24 * 3600.0
    scheduler_interval_seconds: float = 1.0
    scheduler_profile: str = "default"
    restart_backoff_seconds: float = 5.0
    restart_backoff_max_seconds: float = 300.0
    #: How long capacity freed by preemption stays reserved for its preemptor.
    preemption_reservation_seconds: float = 300.0
    #: The grace period of preempted pods (SIGTERM, then SIGKILL); None: the pod's own
    #: stop grace, else the agent's default.
    preemption_grace_seconds: float | None = None
    #: The HTTP proxy serves ``{pod-id}-{port}.{proxy_domain}`` (Host header, any port).
    proxy_domain: str = "localhost"
    #: A proxied request or WebSocket with no bytes either way for this long is closed
    #: (an idle timeout only: no cut-off of long downloads or streams).
    proxy_idle_timeout_seconds: float = 3600.0
    #: The SSH gateway's port (0: any free port, recorded on ``app.state.ssh_port``); None:
    #: no gateway (``gpucloud server`` defaults to 2222).
    ssh_port: int | None = None
    #: The address the SSH gateway listens on.
    ssh_host: str = "127.0.0.1"
    #: Let several server processes (``--workers``) share the SSH port (SO_REUSEPORT).
    ssh_reuse_port: bool = False

    @classmethod
    def from_env(cls) -> Settings:
        home = gpucloud_home()
        url = os.environ.get("GPUCLOUD_DATABASE_URL") or f"sqlite:///{home / 'gpucloud.db'}"
        return cls(
            home=home,
            database_url=url,
            admin_key=os.environ.get("GPUCLOUD_ADMIN_KEY") or None,
            lease_ttl_seconds=float(os.environ.get("GPUCLOUD_LEASE_TTL", "10")),
            scheduler_profile=os.environ.get("GPUCLOUD_SCHEDULER_PROFILE", "default"),
            preemption_grace_seconds=_optional_float(
                os.environ.get("GPUCLOUD_PREEMPTION_GRACE")),
            proxy_domain=os.environ.get("GPUCLOUD_PROXY_DOMAIN") or "localhost",
            proxy_idle_timeout_seconds=float(os.environ.get("GPUCLOUD_PROXY_IDLE_TIMEOUT",
                                                            "3600")),
            ssh_port=_optional_int(os.environ.get("GPUCLOUD_SSH_PORT")),
            ssh_host=os.environ.get("GPUCLOUD_SSH_HOST") or "127.0.0.1",
            ssh_reuse_port=os.environ.get("GPUCLOUD_SSH_REUSE_PORT") == "1",
        )


def _optional_float(value: str | None) -> float | None:
    return float(value) if value else None


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None
