"""Server settings from the environment, with embedded defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpucloud.core.egress import DEFAULT_DENIED, EgressPolicy, parse_networks

#: prometheus-client's multiprocess folder (several server workers; docs/usage.md)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def gpucloud_home() -> Path:
    return Path(os.environ.get("GPUCLOUD_HOME") or Path.home() / ".gpucloud")


#: The most a replica may trust a cached API key (seconds): the revocation bound.
MAX_AUTH_CACHE_TTL = 30.0
#: The API's worker threads unless GPUCLOUD_REQUEST_THREADS says otherwise (see
#: ``Settings.request_threads``).
DEFAULT_REQUEST_THREADS = 10


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    admin_key: str | None = None
    lease_ttl_seconds: float = 10.0
    #: The controllers' leader lease (docs/replicas.md): a follower takes over within it
    #: when the leader dies. Env GPUCLOUD_LEADER_TTL.
    leader_ttl_seconds: float = 15.0
    #: How long a replica may serve an API key (and priority classes) from its cache: a
    #: key revoked on another replica is refused here within this bound (sooner with
    #: PostgreSQL, whose NOTIFY clears the caches at once). Env GPUCLOUD_AUTH_CACHE_TTL,
    #: at most MAX_AUTH_CACHE_TTL.
    auth_cache_ttl_seconds: float = 5.0
    join_token_ttl_seconds: float = 24 * 3600.0
    #: Failed authentications allowed per key prefix in a burst, and how many more per
    #: minute after it; per client address, over all the keys it sends, both times
    #: ``auth_failure_address_factor`` (services/ratelimit.py).
    auth_failure_burst: int = 20
    auth_failures_per_minute: float = 10.0
    auth_failure_address_factor: float = 10.0
    scheduler_interval_seconds: float = 1.0
    #: Whether this replica runs the controllers (and may take their lease). False: an
    #: API replica that never leads, so agents behind the balancer never share a process
    #: with the scheduler (docs/replicas.md). Env GPUCLOUD_CONTROLLERS=0.
    controllers: bool = True
    #: Whether replicas hint each other through PostgreSQL's LISTEN/NOTIFY (wake-ups,
    #: cache clears). False behind a pooler that cannot hold a LISTEN (PgBouncer in
    #: transaction mode): everything still arrives by polling, within its stated bounds
    #: (docs/replicas.md). Env GPUCLOUD_NOTIFY=0.
    notify: bool = True
    scheduler_profile: str = "default"
    restart_backoff_seconds: float = 5.0
    restart_backoff_max_seconds: float = 300.0
    #: How long capacity freed by preemption stays reserved for its preemptor.
    preemption_reservation_seconds: float = 300.0
    #: The grace period of preempted pods (SIGTERM, then SIGKILL); None: the pod's own
    #: stop grace, else the agent's default.
    preemption_grace_seconds: float | None = None
    #: A preempted pod is kept off the node it was preempted from for this long.
    preempted_avoid_seconds: float = 300.0
    #: ``node drain``: how many nodes drain at once (the others wait, cordoned), and the
    #: deadline after which what still runs on a draining node is stopped.
    max_draining_nodes: int = 1
    drain_deadline_seconds: float = 600.0
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
    #: Where checkpoints are kept: None, the embedded store under ``home``; or
    #: ``s3://bucket/prefix`` (boto3, the usual AWS variables).
    checkpoint_store: str | None = None
    #: Committed checkpoints kept per pod (each gang member by rank).
    checkpoint_retention: int = 2
    #: Raw usage samples are kept this many days (the meter, pod_runs, is kept).
    usage_retention_days: float = 7.0
    #: An upload that has not committed for this long may have its chunks collected.
    checkpoint_upload_ttl_seconds: float = 3600.0
    #: The checkpoint interval (docs/checkpoints.md): δ before any measured checkpoint,
    #: the prior M (one interruption per this long, worth one observation), and the
    #: operator's bounds on τ (no request storm; a bounded loss). Env:
    #: GPUCLOUD_CHECKPOINT_COST_DEFAULT, GPUCLOUD_INTERRUPTION_PRIOR_MTBF,
    #: GPUCLOUD_CHECKPOINT_INTERVAL_MIN, GPUCLOUD_CHECKPOINT_INTERVAL_MAX (seconds).
    checkpoint_cost_default_seconds: float = 60.0
    interruption_prior_mtbf_seconds: float = 24 * 3600.0
    checkpoint_interval_min_seconds: float = 60.0
    checkpoint_interval_max_seconds: float | None = None
    #: The URL serverless workers reach this server at (their RUNPOD_WEBHOOK_* point
    #: there); None: http://127.0.0.1:8080 (services/autoscale). Env GPUCLOUD_SERVERLESS_URL.
    serverless_url: str | None = None
    #: How long a serverless worker's job-take and job-stop long polls are held before a
    #: 204 (the runpod SDK gives up at 90 s; tests set it short).
    serverless_long_poll_seconds: float = 30.0
    #: The most a ``runsync`` is held for its result (RunPod's ``?wait=`` is up to 300 s).
    serverless_runsync_max_wait_seconds: float = 300.0
    #: The most a waiting log read (``GET /v1/pods/{ref}/logs?wait=``, up to 30 s) is
    #: held before it answers with what it has (tests set it short), and how often it
    #: re-reads the log meanwhile: the wake-up of a stored chunk is a hint (one lost
    #: between replicas costs at most this). Env GPUCLOUD_LOG_WAIT_RECHECK (seconds).
    log_wait_max_seconds: float = 30.0
    log_wait_recheck_seconds: float = 1.0
    #: Where webhooks may be POSTed (core/egress.py): denied networks (env
    #: GPUCLOUD_WEBHOOK_DENY, comma-separated; default loopback, link-local and the
    #: metadata addresses) and allowed ones that override them (GPUCLOUD_WEBHOOK_ALLOW).
    webhook_egress: EgressPolicy = field(default_factory=EgressPolicy.default)
    #: Worker threads for the API's blocking work (sync routes and ``run_in_threadpool``:
    #: anyio's default limiter, 40 unless set). A replica's Python runs on one core (the
    #: GIL) and its database waits need few threads; more only queue for the GIL and the
    #: pool, and starve the controllers' thread on a leader that answers a large fleet
    #: (docs/replicas.md: 10 drained a 10,000-node backlog 1.4-2.1x faster than 40, and
    #: bench/api.py's creates were no slower). Env GPUCLOUD_REQUEST_THREADS.
    request_threads: int = DEFAULT_REQUEST_THREADS

    @classmethod
    def from_env(cls) -> Settings:
        home = gpucloud_home()
        url = os.environ.get("GPUCLOUD_DATABASE_URL") or f"sqlite:///{home / 'gpucloud.db'}"
        return cls(
            home=home,
            database_url=url,
            admin_key=os.environ.get("GPUCLOUD_ADMIN_KEY") or None,
            lease_ttl_seconds=float(os.environ.get("GPUCLOUD_LEASE_TTL", "10")),
            leader_ttl_seconds=float(os.environ.get("GPUCLOUD_LEADER_TTL", "15")),
            auth_cache_ttl_seconds=min(MAX_AUTH_CACHE_TTL, float(
                os.environ.get("GPUCLOUD_AUTH_CACHE_TTL", "5"))),
            scheduler_profile=os.environ.get("GPUCLOUD_SCHEDULER_PROFILE", "default"),
            controllers=os.environ.get("GPUCLOUD_CONTROLLERS", "1") != "0",
            notify=os.environ.get("GPUCLOUD_NOTIFY", "1") != "0",
            preemption_grace_seconds=_optional_float(
                os.environ.get("GPUCLOUD_PREEMPTION_GRACE")),
            max_draining_nodes=int(os.environ.get("GPUCLOUD_MAX_DRAINING_NODES", "1")),
            proxy_domain=os.environ.get("GPUCLOUD_PROXY_DOMAIN") or "localhost",
            proxy_idle_timeout_seconds=float(os.environ.get("GPUCLOUD_PROXY_IDLE_TIMEOUT",
                                                            "3600")),
            ssh_port=_optional_int(os.environ.get("GPUCLOUD_SSH_PORT")),
            ssh_host=os.environ.get("GPUCLOUD_SSH_HOST") or "127.0.0.1",
            ssh_reuse_port=os.environ.get("GPUCLOUD_SSH_REUSE_PORT") == "1",
            checkpoint_store=os.environ.get("GPUCLOUD_CHECKPOINT_STORE") or None,
            checkpoint_retention=int(os.environ.get("GPUCLOUD_CHECKPOINT_RETENTION", "2")),
            usage_retention_days=_retention_days(os.environ.get("GPUCLOUD_USAGE_RETENTION")),
            checkpoint_cost_default_seconds=float(
                os.environ.get("GPUCLOUD_CHECKPOINT_COST_DEFAULT", "60")),
            interruption_prior_mtbf_seconds=float(
                os.environ.get("GPUCLOUD_INTERRUPTION_PRIOR_MTBF", "86400")),
            checkpoint_interval_min_seconds=float(
                os.environ.get("GPUCLOUD_CHECKPOINT_INTERVAL_MIN", "60")),
            checkpoint_interval_max_seconds=_optional_float(
                os.environ.get("GPUCLOUD_CHECKPOINT_INTERVAL_MAX")),
            serverless_url=os.environ.get("GPUCLOUD_SERVERLESS_URL") or None,
            serverless_long_poll_seconds=min(85.0, float(
                os.environ.get("GPUCLOUD_SERVERLESS_LONG_POLL", "30"))),
            log_wait_recheck_seconds=float(os.environ.get("GPUCLOUD_LOG_WAIT_RECHECK", "1")),
            webhook_egress=_webhook_egress(),
            request_threads=_request_threads(os.environ.get("GPUCLOUD_REQUEST_THREADS")),
        )


def _webhook_egress() -> EgressPolicy:
    denied = os.environ.get("GPUCLOUD_WEBHOOK_DENY")
    return EgressPolicy(
        denied=parse_networks(DEFAULT_DENIED if denied is None else denied,
                              "GPUCLOUD_WEBHOOK_DENY"),
        allowed=parse_networks(os.environ.get("GPUCLOUD_WEBHOOK_ALLOW", ""),
                               "GPUCLOUD_WEBHOOK_ALLOW"))


def _request_threads(value: str | None) -> int:
    """``GPUCLOUD_REQUEST_THREADS``: a whole number of threads, 2 to 1,000 (unset: the
    default)."""
    if not value:
        return DEFAULT_REQUEST_THREADS
    if not value.strip().isdigit() or not 2 <= int(value) <= 1000:
        raise ValueError(f"GPUCLOUD_REQUEST_THREADS: {value!r} is not a whole number from "
                         "2 to 1000")
    return int(value)


def _optional_float(value: str | None) -> float | None:
    return float(value) if value else None


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None


def _retention_days(value: str | None) -> float:
    """``GPUCLOUD_USAGE_RETENTION``: days, ``7`` or ``7d`` (default 7; more than 0)."""
    if not value:
        return 7.0
    try:
        days = float(value.strip().removesuffix("d"))
    except ValueError:
        raise ValueError(f"GPUCLOUD_USAGE_RETENTION={value!r}: expected days, e.g. 7 or 7d"
                         ) from None
    if not days > 0 or days == float("inf"):
        raise ValueError(f"GPUCLOUD_USAGE_RETENTION={value!r}: must be more than 0 days")
    return days
