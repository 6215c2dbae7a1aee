"""SQLAlchemy models. One schema for SQLite and PostgreSQL; changed only through migrations.

Rows that background loops work on carry ``version`` (for guarded ``UPDATE … WHERE
version=?``) and, for pods, ``lock_token``/``lock_expires_at`` (leased work).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both databases (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, _dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are not stored; use UTC-aware datetimes")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, _dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: dict[Any, Any] = {datetime: UTCDateTime, dict[str, Any]: JSON}


class ContainerSpecColumns:
    """The container spec's columns (``core.spec.ContainerSpec``), one set for pods, jobs
    and templates: image, command, env, GPU model, CPU and memory, the entrypoint
    override, the pod's volume disk (bytes, mount path), its container disk, network
    volumes (``[{"name", "path"}]``) and the registry credentials (by name) its image is
    pulled with. ``services.spec`` maps a request to these columns and back."""

    image: Mapped[str] = mapped_column(String(255))
    command: Mapped[list[str]] = mapped_column(JSON)
    env: Mapped[dict[str, str]] = mapped_column(JSON)
    gpu_type: Mapped[str | None] = mapped_column(String(64))
    cpu_milli: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    entrypoint: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    volume_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    volume_path: Mapped[str | None] = mapped_column(String(255), default=None)
    container_disk_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    network_volumes: Mapped[list[dict[str, str]] | None] = mapped_column(JSON, default=None)
    registry_auth: Mapped[str | None] = mapped_column(String(63), default=None)
    #: ``--spot`` (preempted with a notice and requeued elsewhere), the recorded ``--bid``
    #: and ``--grace`` (seconds from the notice to SIGKILL) (migration 0007).
    spot: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    bid: Mapped[float | None] = mapped_column(Float, default=None)
    grace_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    #: ``--checkpoint-dir``: the container path whose committed checkpoints are kept
    #: (migration 0008).
    checkpoint_dir: Mapped[str | None] = mapped_column(String(255), default=None)
    #: ``--checkpoint-signal`` (None: SIGUSR1) and ``--checkpoint directory|transparent``
    #: (None: directory when a checkpoint dir is set) (migration 0009).
    checkpoint_signal: Mapped[str | None] = mapped_column(String(16), default=None)
    checkpoint_mode: Mapped[str | None] = mapped_column(String(16), default=None)
    #: ``--mig PROFILE``: one MIG instance of that profile (migration 0013).
    mig_profile: Mapped[str | None] = mapped_column(String(16), default=None)
    #: ``--gpu-memory 20Gi``: a GPU share's device memory limit (migration 0013).
    gpu_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)


class ProjectModel(Base):
    __tablename__ = "projects"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]


class ApiKeyModel(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    #: What the key may do (migration 0015): None, the project's whole API;
    #: ``worker:<endpoint id>``, only that endpoint's serverless worker routes (the key a
    #: worker pod gets in ``RUNPOD_AI_API_KEY``; the API refuses it everywhere else).
    scope: Mapped[str | None] = mapped_column(String(63), default=None)


class JoinTokenModel(Base):
    __tablename__ = "join_tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    prefix: Mapped[str | None] = mapped_column(String(16))
    #: Registrations allowed (None: any number until ``expires_at``) and made so far.
    max_uses: Mapped[int | None] = mapped_column(Integer)
    uses: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    revoked_at: Mapped[datetime | None]


class NodeModel(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16))
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    cpu_milli: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    address: Mapped[str | None] = mapped_column(String(255))
    provider: Mapped[str | None] = mapped_column(String(64))
    fencing_token: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_expires_at: Mapped[datetime | None]
    registered_at: Mapped[datetime]
    assignments_revision: Mapped[int] = mapped_column(BigInteger, default=0)
    version: Mapped[int] = mapped_column(BigInteger, default=0)
    #: ``host:port`` of the agent's access server (SSH, exec, port relay) and its host key
    #: (OpenSSH public key line), pinned by the server's gateway.
    access_endpoint: Mapped[str | None] = mapped_column(String(255), default=None)
    access_host_key: Mapped[str | None] = mapped_column(Text, default=None)
    #: ``bridge`` (a network namespace per pod) or ``host``; None for old agents (host).
    network_mode: Mapped[str | None] = mapped_column(String(16), default=None)
    #: How the node mounts network volumes: ``nfs`` or ``hostpath``.
    volume_mode: Mapped[str | None] = mapped_column(String(16), default=None)
    #: ``gpucloud node drain`` (migration 0007): ``core.spot.DrainState`` (None: not
    #: draining), when it was asked, when it started (its pods noticed), the deadline after
    #: which what is left is stopped, when it ended empty, and how many pods it had.
    drain_state: Mapped[str | None] = mapped_column(String(16), default=None)
    drain_requested_at: Mapped[datetime | None] = mapped_column(default=None)
    drain_started_at: Mapped[datetime | None] = mapped_column(default=None)
    drain_deadline_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    drain_finished_at: Mapped[datetime | None] = mapped_column(default=None)
    drain_pods_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: What the node's canaries found it can do (``core.capabilities.NodeCapabilities``:
    #: CRIU dump and restore, cuda-checkpoint) (migration 0009).
    capabilities: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    #: When the lease was last granted or renewed (migration 0011): a lost node's pods are
    #: metered up to here, not to when the loss was noticed.
    lease_renewed_at: Mapped[datetime | None] = mapped_column(default=None)
    #: ``gpucloud node mig NODE --mode dynamic|fixed|off`` (migration 0013; None: dynamic).
    mig_policy: Mapped[str | None] = mapped_column(String(16), default=None)
    #: Why the node is cordoned when its health checks did it (migration 0013; None: an
    #: operator's cordon, or not cordoned); cleared when the checks pass again.
    cordon_reason: Mapped[str | None] = mapped_column(String(500), default=None)


class PodModel(ContainerSpecColumns, Base):
    __tablename__ = "pods"
    __table_args__ = (
        Index(
            "uq_pods_project_name_live",
            "project_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        Index("ix_pods_phase_created", "phase", "created_at"),
        Index("ix_pods_node_phase", "node_id", "phase"),
        # A node's assignments read the pods whose volume disk it keeps (migration 0016).
        Index("ix_pods_volume_node", "volume_node_id",
              sqlite_where=text("volume_node_id IS NOT NULL"),
              postgresql_where=text("volume_node_id IS NOT NULL")),
        Index("ix_pods_volume_source_node", "volume_source_node_id",
              sqlite_where=text("volume_source_node_id IS NOT NULL"),
              postgresql_where=text("volume_source_node_id IS NOT NULL")),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    phase: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(200))
    message: Mapped[str | None] = mapped_column(Text)
    desired_state: Mapped[str] = mapped_column(String(16), default="running")
    ports: Mapped[list[str]] = mapped_column(JSON)
    gpus: Mapped[float] = mapped_column(Float, default=0)
    restart_policy: Mapped[str] = mapped_column(String(16))
    stop_grace_seconds: Mapped[float | None] = mapped_column(Float)
    #: Declared by the user: stopped when it has run this long; lets it backfill.
    max_duration_seconds: Mapped[float | None] = mapped_column(Float)
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    gpu_uuids: Mapped[list[str]] = mapped_column(JSON)
    gpu_milli: Mapped[dict[str, int]] = mapped_column(JSON)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    not_before: Mapped[datetime | None]
    unschedulable: Mapped[dict[str, int] | None] = mapped_column(JSON)
    log_tail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]
    lock_token: Mapped[str | None] = mapped_column(String(32))
    lock_expires_at: Mapped[datetime | None]
    version: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Members of a job: the job, the member's rank, and when its container reported
    #: ready at the start barrier (this attempt).
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None] = mapped_column(Integer)
    ready_at: Mapped[datetime | None]
    #: Scheduling priority (the value of ``priority_class`` when the pod was created).
    priority_class: Mapped[str | None] = mapped_column(String(63))
    priority: Mapped[int] = mapped_column(Integer, default=100, server_default="100")
    #: A preemptor's reservation: the node and GPUs freed for it, held until it binds or
    #: ``nominated_until``; every scheduling pass counts them as taken for everyone else.
    nominated_node_id: Mapped[str | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"))
    nominated_gpu_milli: Mapped[dict[str, int] | None] = mapped_column(JSON)
    nominated_until: Mapped[datetime | None]
    #: The template the pod was created from (its values were copied at creation).
    template: Mapped[str | None] = mapped_column(String(63), default=None)
    #: What the agent reported of the pod's network: ``{"ip": …, "ports": [{"ip",
    #: "isIpPublic", "privatePort", "publicPort", "type"}]}``.
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    #: A per-pod secret that lets a browser through the HTTP proxy without an API key.
    proxy_token: Mapped[str | None] = mapped_column(String(64), default=None)
    #: The node holding the pod's volume disk: a restart goes back there.
    volume_node_id: Mapped[str | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"), default=None)
    #: While ``pod start --migrate`` moves the volume disk: the node it is copied from (it
    #: keeps its copy, and lets only the destination fetch it, until the copy is confirmed).
    volume_source_node_id: Mapped[str | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"), default=None)
    #: Preemptions (migration 0007): how often the pod was preempted, drained or lost with
    #: its node; the last reason (``core.spot.StopReason``) and time; the run time lost
    #: (seconds of the interrupted attempts after their last checkpoint); the notice of
    #: the stop under way (``core.spot.StopNotice`` as JSON, for its attempt); and the
    #: node it was preempted from, avoided by the scheduler until ``avoid_until``.
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_preemption_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    last_preempted_at: Mapped[datetime | None] = mapped_column(default=None)
    time_lost_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    stop_notice: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    avoid_node_id: Mapped[str | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"), default=None)
    avoid_until: Mapped[datetime | None] = mapped_column(default=None)
    #: A MIG pod's start slot on its GPU as the scheduler chose it, and the MIG device the
    #: agent made there (``{"gpu_uuid", "mig_uuid", "profile", "slot"}``) (migration 0013).
    mig_slot: Mapped[int | None] = mapped_column(Integer, default=None)
    mig_device: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    #: A serverless endpoint's worker (migration 0015): the endpoint, and when the worker
    #: last finished a request or started (the autoscaler stops it after the endpoint's
    #: idle timeout from then).
    endpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("endpoints.id", ondelete="CASCADE"), default=None, index=True)
    worker_idle_since: Mapped[datetime | None] = mapped_column(default=None)


class JobModel(ContainerSpecColumns, Base):
    """A gang of ``num_nodes`` member pods (``PodModel.job_id``/``rank``).

    ``gang_state`` is the controller's view: ``queued`` (members Pending, to be placed
    together), ``starting`` (bound, waiting at the start barrier since ``scheduled_at``),
    ``running`` (barrier released), ``stopping`` (members being stopped; ``teardown`` says
    what follows: ``restart``, ``requeue`` or ``stop``), ``ended``.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index(
            "uq_jobs_project_name_live",
            "project_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        Index("ix_jobs_state_created", "gang_state", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    phase: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(200))
    message: Mapped[str | None] = mapped_column(Text)
    desired_state: Mapped[str] = mapped_column(String(16), default="running")
    gang_state: Mapped[str] = mapped_column(String(16))
    teardown: Mapped[str | None] = mapped_column(String(16))
    num_nodes: Mapped[int] = mapped_column(Integer)
    gpus_per_node: Mapped[int] = mapped_column(Integer)
    topology: Mapped[str] = mapped_column(String(16))
    priority_class: Mapped[str | None] = mapped_column(String(63))
    priority: Mapped[int] = mapped_column(Integer, default=100, server_default="100")
    #: While set and in the future, the members' reservations (``PodModel.nominated_*``)
    #: hold the capacity that preemption freed for this job.
    nominated_until: Mapped[datetime | None]
    #: Declared by the user: the job is stopped when it has run this long.
    max_duration_seconds: Mapped[float | None] = mapped_column(Float)
    max_restarts: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    ready_timeout_seconds: Mapped[float] = mapped_column(Float)
    ready_timeouts: Mapped[int] = mapped_column(Integer, default=0)
    #: Preemptions of the gang as a unit (migration 0007), as on pods.
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_preemption_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    last_preempted_at: Mapped[datetime | None] = mapped_column(default=None)
    time_lost_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    scheduled_at: Mapped[datetime | None]
    barrier_released_at: Mapped[datetime | None]
    not_before: Mapped[datetime | None]
    unschedulable: Mapped[dict[str, int] | None] = mapped_column(JSON)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]
    lock_token: Mapped[str | None] = mapped_column(String(32))
    lock_expires_at: Mapped[datetime | None]
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class SshKeyModel(Base):
    """A project's SSH public key (OpenSSH format); the gateway lets it into the project's
    pods."""

    __tablename__ = "ssh_keys"
    __table_args__ = (UniqueConstraint("project_id", "fingerprint",
                                       name="uq_ssh_keys_project_fp"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    key_type: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]


class VolumeModel(Base):
    """A network volume: a directory on the volume host, mounted by pods on any node."""

    __tablename__ = "volumes"
    __table_args__ = (UniqueConstraint("project_id", "name", name="uq_volumes_project_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    zone: Mapped[str | None] = mapped_column(String(63))
    created_at: Mapped[datetime]


class RegistryAuthModel(Base):
    """Credentials for pulling a template's image from a private registry."""

    __tablename__ = "registry_auths"
    __table_args__ = (UniqueConstraint("project_id", "name",
                                       name="uq_registry_auths_project_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    registry_host: Mapped[str | None] = mapped_column(String(255))
    username: Mapped[str] = mapped_column(String(255))
    password: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class TemplateModel(ContainerSpecColumns, Base):
    """A named container spec that pods are created from."""

    __tablename__ = "templates"
    __table_args__ = (UniqueConstraint("project_id", "name",
                                       name="uq_templates_project_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    ports: Mapped[list[str]] = mapped_column(JSON)
    gpus: Mapped[float] = mapped_column(Float, default=0)
    created_at: Mapped[datetime]


class PriorityClassModel(Base):
    """A named scheduling priority; the defaults are written on first start."""

    __tablename__ = "priority_classes"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    value: Mapped[int] = mapped_column(Integer)
    description: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]


class QuotaModel(Base):
    """A project's guaranteed GPUs per model and how many more it may borrow.

    A project with no row is not limited and has no guarantee.
    """

    __tablename__ = "quotas"
    project_id: Mapped[str] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    gpus: Mapped[dict[str, int]] = mapped_column(JSON)
    borrow_limit: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime]


class PodEventModel(Base):
    __tablename__ = "pod_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pod_id: Mapped[str] = mapped_column(ForeignKey("pods.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime]
    from_phase: Mapped[str | None] = mapped_column(String(16))
    to_phase: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(200))
    message: Mapped[str | None] = mapped_column(Text)


class PodLogChunkModel(Base):
    __tablename__ = "pod_log_chunks"
    __table_args__ = (Index("uq_pod_log_chunks", "pod_id", "attempt", "offset", unique=True),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pod_id: Mapped[str] = mapped_column(ForeignKey("pods.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)


class CheckpointModel(Base):
    """A committed checkpoint of a ``--checkpoint-dir`` (its manifest is in the store).

    ``key`` is what the store files it under (the pod id, ``<job id>-<rank>`` for a job's
    members); ``state`` is ``committed`` or ``corrupt`` (a restore found a bad chunk);
    ``cost_seconds`` is δ, from the program's commit marker to the committed manifest.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("project_id", "key", "attempt", "seq",
                                       name="uq_checkpoints_key_attempt_seq"),
                      Index("ix_checkpoints_pod", "pod_id"))
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(80))
    pod_id: Mapped[str | None] = mapped_column(ForeignKey("pods.id", ondelete="SET NULL"))
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    attempt: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    manifest: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    chunks: Mapped[int] = mapped_column(Integer)
    bytes_sent: Mapped[int] = mapped_column(BigInteger)
    cost_seconds: Mapped[float | None] = mapped_column(Float)
    #: Every chunk its manifest references (the collector keeps these).
    digests: Mapped[list[str]] = mapped_column(JSON)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class CheckpointUploadModel(Base):
    """An upload in progress: the chunks it may reference are never collected until it
    commits (the row goes in the commit's transaction) or expires."""

    __tablename__ = "checkpoint_uploads"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(80))
    pod_id: Mapped[str | None] = mapped_column(ForeignKey("pods.id", ondelete="SET NULL"))
    attempt: Mapped[int] = mapped_column(Integer)
    digests: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]


class ControllerLeaseModel(Base):
    """Which server replica runs a given controller loop, and until when."""

    __tablename__ = "controller_leases"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime]
    token: Mapped[int] = mapped_column(BigInteger, default=0)


#: A 32-character id compared bytewise (COLLATE "C") on PostgreSQL; SQLite's default
#: collation is bytewise already.
_BYTEWISE_ID = String(32).with_variant(String(32, collation="C"), "postgresql")


class UsageSampleModel(Base):
    """One usage sample of a pod attempt on a node (migration 0011), keyed by (node, pod,
    attempt, seq) so a resent batch stores nothing twice. Counters are cumulative since
    the container started; ``gpu_util_percent`` is the mean over the sample's GPUs and
    ``gpu_memory_bytes`` their sum (None: not measured); ``gpus`` keeps them per GPU."""

    __tablename__ = "usage_samples"
    __table_args__ = (Index("ix_usage_samples_node_time", "node_id", "time"),)
    #: No foreign keys: ingest stays one plain insert, and usage outlives its pod row.
    #: The ids compare bytewise on PostgreSQL (migration 0018: every row inserted costs
    #: key comparisons in two indexes; hex ids sort the same in any collation).
    node_id: Mapped[str] = mapped_column(_BYTEWISE_ID, primary_key=True)
    pod_id: Mapped[str] = mapped_column(_BYTEWISE_ID, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time: Mapped[datetime]
    cpu_seconds: Mapped[float] = mapped_column(Float)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    gpu_util_percent: Mapped[float | None] = mapped_column(Float)
    gpu_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    net_rx_bytes: Mapped[int | None] = mapped_column(BigInteger)
    net_tx_bytes: Mapped[int | None] = mapped_column(BigInteger)
    disk_bytes: Mapped[int | None] = mapped_column(BigInteger)
    received_at: Mapped[datetime]


class PodRunModel(Base):
    """The meter (migration 0011): one row per pod attempt's ``Running`` interval, opened
    and closed by its phase transitions (services/usage). What the attempt was allocated
    is copied at the start, so later changes to the pod never rewrite billed history;
    ``ended_at`` is the transition's time, or the node's last lease renewal when the node
    was lost; ``credited``: ended by a hardware fault, not charged."""

    __tablename__ = "pod_runs"
    __table_args__ = (Index("ix_pod_runs_project_started", "project_id", "started_at"),)
    #: Billed history outlives the pod's row: no foreign key to it.
    pod_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(32))
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    gpu_type: Mapped[str | None] = mapped_column(String(64))
    gpus: Mapped[float] = mapped_column(Float)
    gpu_milli: Mapped[int] = mapped_column(Integer)
    mig_profile: Mapped[str | None] = mapped_column(String(16))
    cpu_milli: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    volume_bytes: Mapped[int] = mapped_column(BigInteger)
    priority_class: Mapped[str | None] = mapped_column(String(63))
    spot: Mapped[bool] = mapped_column(Boolean)
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(String(200))
    credited: Mapped[bool] = mapped_column(Boolean, default=False)


class PriceModel(Base):
    """One version of a price (migration 0012): ``micros`` per unit (GPU-hour, core-hour,
    GiB-month) of ``resource`` for a GPU model, MIG profile and class, from
    ``effective_at`` until the next version of the same key. ``''`` stands for "none" in
    the key columns, so the unique index works on both databases."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("resource", "gpu_model", "mig_profile", "price_class",
                                       "effective_at", name="uq_prices_key_effective"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    resource: Mapped[str] = mapped_column(String(16))
    gpu_model: Mapped[str] = mapped_column(String(64), default="")
    mig_profile: Mapped[str] = mapped_column(String(16), default="")
    price_class: Mapped[str] = mapped_column(String(16))
    micros: Mapped[int] = mapped_column(BigInteger)
    effective_at: Mapped[datetime]
    created_at: Mapped[datetime]


class SpendLimitModel(Base):
    """A project's spend limit and prepaid credit (migration 0012). ``per_hour_micros``:
    the most its admitted pods may cost per hour (None: none); ``credit_micros``: a prepaid
    balance spent by usage since ``credit_since`` (None: postpaid); ``exhausted_at``: when
    the balance ran out and its pods were stopped."""

    __tablename__ = "spend_limits"
    project_id: Mapped[str] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    per_hour_micros: Mapped[int | None] = mapped_column(BigInteger, default=None)
    credit_micros: Mapped[int | None] = mapped_column(BigInteger, default=None)
    credit_since: Mapped[datetime | None] = mapped_column(default=None)
    exhausted_at: Mapped[datetime | None] = mapped_column(default=None)
    updated_at: Mapped[datetime]
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class EndpointModel(ContainerSpecColumns, Base):
    """A serverless endpoint (migration 0015): the workers' container spec (one spec, as
    pods and templates), how many workers may run (``min_workers``..``max_workers``), how
    the autoscaler sizes them (``scaler``: ``queue-delay`` seconds a request may wait, or
    ``request-count`` requests per worker, with ``scaler_value``), how long an idle worker
    is kept, and how long one request may run and be retried. Workers are pods whose
    ``endpoint_id`` is this endpoint."""

    __tablename__ = "endpoints"
    __table_args__ = (
        Index(
            "uq_endpoints_project_name_live",
            "project_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    ports: Mapped[list[str]] = mapped_column(JSON)
    gpus: Mapped[float] = mapped_column(Float, default=0)
    #: RunPod's GPU pools as given (``AMPERE_16,ADA_24``), mapped onto ``gpu_type``.
    gpu_ids: Mapped[str | None] = mapped_column(String(255), default=None)
    min_workers: Mapped[int] = mapped_column(Integer, default=0)
    max_workers: Mapped[int] = mapped_column(Integer, default=3)
    idle_timeout_seconds: Mapped[float] = mapped_column(Float, default=5.0)
    scaler: Mapped[str] = mapped_column(String(16), default="queue-delay")
    scaler_value: Mapped[int] = mapped_column(Integer, default=4)
    execution_timeout_seconds: Mapped[float] = mapped_column(Float, default=600.0)
    max_retries: Mapped[int] = mapped_column(Integer, default=3)
    #: The template it was created from (its values were copied), as pods record it.
    template: Mapped[str | None] = mapped_column(String(63), default=None)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class EndpointRequestModel(Base):
    """One request to an endpoint (RunPod's "job"), the durable queue (migration 0015).

    ``status`` is RunPod's: ``IN_QUEUE``, ``IN_PROGRESS``, ``COMPLETED``, ``FAILED``,
    ``CANCELLED``, ``TIMED_OUT``. A worker takes a queued request under a lease
    (``worker_pod_id``, ``lease_expires_at``, renewed by the worker's pings and progress);
    a request whose lease lapses (its worker died) goes back to ``IN_QUEUE`` with
    ``retries`` + 1, and fails once that passes the endpoint's ``max_retries``. A finished
    request is kept until ``expires_at`` (1 min after a ``runsync``, 30 min after a
    ``run``); ``webhook`` is POSTed once it finishes (``webhook_state``: ``pending``,
    ``done``, ``failed``; retried at ``webhook_next_at``)."""

    __tablename__ = "endpoint_requests"
    __table_args__ = (
        Index("ix_endpoint_requests_queue", "endpoint_id", "status", "created_at"),
        Index("ix_endpoint_requests_worker", "worker_pod_id", "status"),
        Index("ix_endpoint_requests_expires", "expires_at"),
    )
    id: Mapped[str] = mapped_column(String(48), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("endpoints.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    input: Mapped[Any] = mapped_column(JSON)
    output: Mapped[Any | None] = mapped_column(JSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    #: ``runsync`` (kept 1 min when done) or ``run`` (30 min).
    sync: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    #: The request's own ``policy.executionTimeout`` (seconds) over the endpoint's.
    execution_timeout_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    worker_pod_id: Mapped[str | None] = mapped_column(
        ForeignKey("pods.id", ondelete="SET NULL"), default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    #: Stream chunks posted and not yet read (``/stream`` returns each chunk once).
    stream: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    stream_done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    webhook: Mapped[str | None] = mapped_column(String(2048), default=None)
    webhook_state: Mapped[str | None] = mapped_column(String(16), default=None)
    webhook_attempts: Mapped[int] = mapped_column(Integer, default=0)
    webhook_next_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    version: Mapped[int] = mapped_column(BigInteger, default=0)
