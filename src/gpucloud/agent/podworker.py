"""One pod attempt on this node, from assignment to clean-up, on its own thread.

A worker pulls the image (a locally imported image with the same reference is used as it
is), prepares the root filesystem, builds the bundle and starts the container through the
runtime — or adopts the container a previous agent process started — then watches it,
ships its log, stops it when asked (SIGTERM, grace, SIGKILL) and reports each phase with
the attempt number. When its pod is no longer assigned here (deleted, or moved after the
node was Lost) it kills the container and cleans up without reporting.

A job's member (``assignment.barrier``) is only created; the worker reports it ready and
starts its command once the server releases the gang's start barrier.

When the agent stops, workers return and leave their containers running; the next agent
process adopts them (the container id encodes pod id and attempt).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpucloud.agent import checkpoints
from gpucloud.agent.checkpoint_timer import CheckpointTimer
from gpucloud.agent.connection import AgentStopped, Connection
from gpucloud.agent.hardware import NodeDevices
from gpucloud.agent.logship import LogShipper, LogWatch
from gpucloud.agent.metrics import AgentMetrics
from gpucloud.agent.migration import VolumeReceiver
from gpucloud.agent.podnetwork import NodeNetwork, PodNet
from gpucloud.agent.preempt import PREEMPT_FILE_VAR, NoticeState
from gpucloud.agent.volumes import DiskLimit, VolumeStore
from gpucloud.client.sdk import AgentClient
from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT
from gpucloud.core.errors import GpucloudError
from gpucloud.core.jobs import AgentPodReadyRequest
from gpucloud.core.models import AgentPodStatusRequest, AssignmentOut, MigDevice
from gpucloud.core.phases import PodPhase
from gpucloud.core.quantities import format_memory
from gpucloud.core.spot import NOTICE_PATH, StopReason
from gpucloud.core.trace import mark
from gpucloud.gpu.cdi import CdiError, ContainerEdits
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.mig import MigInstance, MigManager
from gpucloud.gpu.mps import GpuSharing
from gpucloud.images import Image as StoredImage
from gpucloud.images import ImageError, ImageManager
from gpucloud.images.auth import Credentials
from gpucloud.images.manifest import ImageConfig as StoredImageConfig
from gpucloud.runtime.bundle import BindMount, ContainerSpec, ImageConfig
from gpucloud.runtime.driver import ContainerState, ContainerStatus, RuncDriver
from gpucloud.runtime.errors import RuntimeFailure
from gpucloud.runtime.logs import tail

log = logging.getLogger(__name__)
MAX_REASON = 200
MAX_MESSAGE = 4000
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 4096
_LIVE = (ContainerState.RUNNING, ContainerState.CREATING)
#: How long after a start, and how often, the log is watched for the first output.
FIRST_OUTPUT_SECONDS = 2.0
FIRST_OUTPUT_POLL_SECONDS = 0.005
#: How long the Running report waits for output the container has not printed yet at its
#: start, so that the first line does not queue behind the report at the server.
FIRST_OUTPUT_HOLD_SECONDS = 0.02


@dataclass(frozen=True)
class NodeRuntime:
    """What every worker of one agent shares.

    ``rootfs_lock`` serializes root filesystem preparation between this agent's workers:
    the layer store's short-link step names its temporary file by process id only, so two
    threads preparing pods of one new image at once can collide. Preparing a rootfs from
    cached layers takes milliseconds, so the lock costs nothing measurable.
    """

    conn: Connection
    driver: RuncDriver
    images: ImageManager
    devices: NodeDevices
    node_name: str
    state_dir: Path
    stop: threading.Event
    grace_seconds: float
    watch_interval: float
    rootfs_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Volume disks and network volumes (None: pods get neither); see agent/volumes.
    volumes: VolumeStore | None = None
    #: How often a running pod's disks are measured against their sizes.
    disk_check_interval: float = 30.0
    #: Pods' network namespaces and public ports (None: no netns with a veth, no ports).
    network: NodeNetwork | None = None
    #: Fetches a migrating pod's volume disk from its source node (agent/migration).
    migrator: VolumeReceiver | None = None
    #: Pull and start durations, usage gauges (agent/metrics).
    metrics: AgentMetrics = field(default_factory=lambda: AgentMetrics(""))
    #: MPS daemons or time-slicing of shared GPUs (gpu/mps; None: shares not enforced).
    sharing: GpuSharing | None = None
    #: MIG instances made where the scheduler placed MIG pods (gpu/mig; None: no MIG).
    mig: MigManager | None = None


@dataclass(frozen=True)
class Outcome:
    phase: PodPhase
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None


NOT_STARTED = Outcome(PodPhase.STOPPED, None, "Stopped", "stopped before it started")


def container_id(pod_id: str, attempt: int) -> str:
    return f"{pod_id}-{attempt}"


def parse_container_id(name: str) -> tuple[str, int] | None:
    pod_id, sep, attempt = name.rpartition("-")
    return (pod_id, int(attempt)) if sep and pod_id and attempt.isdigit() else None


def reason_line(message: str) -> str:
    """A failure message as a pod reason: its first line, cut to what the API takes."""
    first = message.strip().splitlines()[0] if message.strip() else "Error"
    return first if len(first) <= MAX_REASON else first[: MAX_REASON - 1] + "…"


def outcome_of(status: ContainerStatus, memory_bytes: int) -> Outcome:
    """How an ended (or lost) container is reported."""
    info = status.exit
    if info is None:
        return Outcome(PodPhase.FAILED, None, "ContainerLost",
                       "the container's supervisor ended without recording how it exited")
    if info.error:
        return Outcome(PodPhase.FAILED, None, reason_line(info.error), info.error)
    if info.oom_killed:
        limit = format_memory(memory_bytes) if memory_bytes else "its limit"
        return Outcome(PodPhase.FAILED, info.exit_code, "OOMKilled",
                       f"the container used more memory than its limit ({limit}) and was killed")
    if info.checkpointed:
        return Outcome(PodPhase.STOPPED, None, "Checkpointed",
                       "dumped with runc checkpoint (CRIU); its next start restores it")
    if info.stop_requested:
        how = "killed after its grace period" if info.killed_after_grace else "ended on SIGTERM"
        return Outcome(PodPhase.STOPPED, info.exit_code, "Stopped", f"stopped by request; {how}")
    if info.exit_code == 0:
        return Outcome(PodPhase.SUCCEEDED, 0, "Completed")
    message = f"killed by signal {info.signal}" if info.signal else None
    return Outcome(PodPhase.FAILED, info.exit_code, None, message)


def _transparent(assignment: AssignmentOut) -> bool:
    """``--checkpoint transparent``: the node dumps the container (runc/CRIU)."""
    return assignment.checkpoint_mode == CHECKPOINT_TRANSPARENT


def pull_credentials(assignment: AssignmentOut) -> Credentials | None:
    """The pod's registry login (``registry-auth``), when the server sent one."""
    if assignment.registry_username is None or assignment.registry_password is None:
        return None
    return Credentials(assignment.registry_username, assignment.registry_password)


def runtime_image_config(config: StoredImageConfig) -> ImageConfig:
    return ImageConfig(entrypoint=config.entrypoint, cmd=config.cmd, env=config.env,
                       working_dir=config.working_dir, user=config.user)


def container_spec(assignment: AssignmentOut, gpus: tuple[GpuDevice, ...],
                   node_name: str, binds: tuple[BindMount, ...] = (),
                   net: PodNet | None = None) -> ContainerSpec:
    """The runtime's view of a pod. ``net`` is the network the agent made for it (its
    namespace, or the host's for a job's members, and the variables naming its ports)."""
    return ContainerSpec(
        container_id=container_id(assignment.pod_id, assignment.attempt),
        hostname=assignment.name,
        command=tuple(assignment.command) if assignment.command else None,
        entrypoint=None if assignment.entrypoint is None else tuple(assignment.entrypoint),
        env={PREEMPT_FILE_VAR: NOTICE_PATH, **assignment.env,
             **(net.env(assignment.pod_id) if net else {})},
        cpu_milli=assignment.cpu_milli,
        memory_bytes=assignment.memory_bytes, gpus=gpus,
        host_network=net.host_network if net else assignment.host_network,
        netns=net.netns if net else None, ip=net.ip if net and net.netns else None,
        node_name=node_name,
        labels={"pod_id": assignment.pod_id, "attempt": str(assignment.attempt),
                "pod": assignment.name, "project": assignment.project},
        binds=binds,
    )


class PodWorker:
    """Owns one container id; ``assignment`` None means: only kill and clean up."""

    def __init__(self, node: NodeRuntime, cid: str, assignment: AssignmentOut | None) -> None:
        self.node = node
        self.cid = cid
        self._assignment = assignment
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._abandoned = assignment is None
        #: The watch loop signalled the container's stop (``abandon`` then leaves it be).
        self._stop_signalled = False
        self._net: PodNet | None = None
        self._log_shipper: LogShipper | None = None
        #: The log's inotify watch while the first output is awaited (``_pause``).
        self._first_output: LogWatch | None = None
        self._output_watch_tried = False
        #: The MIG device this attempt runs on (reported with Running).
        self._mig: MigInstance | None = None
        self._stop_wanted = assignment is not None and assignment.desired_state == "stopped"
        self.reported: PodPhase | None = assignment.phase if assignment else None
        #: A phase report still in flight on its own thread (``_advance(background=True)``)
        #: and its phase; every later report waits for it, so the server sees them in order.
        self._in_flight: tuple[threading.Thread, PodPhase] | None = None
        self.completed = False
        #: The preemption notice of this attempt (agent/preempt); a checkpoint committed
        #: after it (``self.checkpoints``) acknowledges it.
        self.notice = NoticeState()
        #: The periodic checkpoint request (``request_now``: a drain's, at once).
        self.checkpoint_timer = CheckpointTimer()
        #: Uploads the pod's checkpoint directory on each commit (None: it has none).
        self.checkpoints: checkpoints.CheckpointWatcher | None = None
        self.thread = threading.Thread(target=self._main, name=f"pod-{cid[:16]}", daemon=True)

    # -- control, from the agent's reconcile loop ---------------------------------------

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def assignment(self) -> AssignmentOut:
        with self._lock:
            assert self._assignment is not None
            return self._assignment

    @property
    def current(self) -> AssignmentOut | None:
        """The assignment, None for a worker that only reaps (read from other threads)."""
        with self._lock:
            return None if self._abandoned else self._assignment

    def update(self, assignment: AssignmentOut) -> None:
        with self._lock:
            self._assignment = assignment
            if assignment.desired_state == "stopped":
                self._stop_wanted = True
        self._poke()

    def abandon(self) -> None:
        """The pod is not assigned here any more (deleted, or moved after the node was
        Lost): its started container is killed at once, from the caller's thread, and
        the worker cleans up without reporting. Not left to the worker's loop alone: it
        may be held up for long in a write (a log chunk, a report), retried while the
        server does not hear this node, and the pod already runs elsewhere meanwhile. A
        stop the worker signalled already keeps its grace, as in the loop."""
        with self._lock:
            first, self._abandoned = not self._abandoned, True
        self._poke()
        if not first or self._stop_signalled \
                or not self.node.driver.paths(self.cid).supervisor_pid.exists():
            return
        try:  # the supervisor applies a stop that comes while it starts the container
            if self.node.driver.status(self.cid).state in _LIVE:
                log.info("killing container %s: its pod is no longer assigned here", self.cid)
                self.node.driver.stop(self.cid, 0.0)
        except (GpucloudError, OSError) as error:  # ended and removed meanwhile
            log.debug("killing container %s: %s", self.cid, error)

    # -- the worker thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._run()
            self.completed = True
        except AgentStopped:
            return
        except Exception:  # a bug must not take the agent down; the log says where
            log.exception("worker of container %s failed", self.cid)
        finally:
            self._close_output_watch()

    def _run(self) -> None:
        status = self._existing()
        if self._abandoned:
            self._reap(status)
            return
        if status is None:
            status = self._launch()
            if status is None:
                return
        else:
            self._adopt_network(status)
            if self._gated(status):  # adopted while waiting at the start barrier
                status = self._pass_barrier()
        self._watch(status)

    def _adopt_network(self, status: ContainerStatus) -> None:
        """An adopted live container keeps its namespace; its public ports open again
        (and, on a shared GPU, it is a client of that GPU's MPS daemon again)."""
        if self.node.network is not None and status.state in _LIVE:
            self._net = self.node.network.adopt(self.cid)
        assignment = self.assignment
        if self.node.sharing is not None and assignment.gpu_milli and status.state in _LIVE:
            for gpu in self.node.devices.gpus(assignment.gpu_uuids):
                self.node.sharing.adopt(self.cid, gpu)

    def _share(self, spec: ContainerSpec, assignment: AssignmentOut,
               gpus: tuple[GpuDevice, ...]) -> ContainerSpec:
        """A share of one GPU: its MPS daemon set up with the pod's limits (gpu/mps), the
        daemon's directories mounted and the variables saying what the pod got."""
        if self.node.sharing is None or not assignment.gpu_milli or len(gpus) != 1:
            return spec
        grant = self.node.sharing.admit(self.cid, gpus[0], assignment.gpu_milli,
                                        assignment.gpu_memory_bytes)
        binds = tuple(BindMount(source, target) for source, target in grant.binds)
        return replace(spec, env={**spec.env, **grant.env}, binds=(*spec.binds, *binds),
                       unified=dict(grant.unified))

    def _mig_edits(self, assignment: AssignmentOut,
                   gpus: tuple[GpuDevice, ...]) -> list[ContainerEdits]:
        """A MIG pod gets its MIG device only (made at the scheduler's slot), others their
        GPUs' CDI devices."""
        if assignment.mig_profile is None or assignment.mig_slot is None:
            return self.node.devices.edits(gpus)
        if self.node.mig is None or len(gpus) != 1:
            raise CdiError(f"this node cannot run MIG pods ({assignment.mig_profile})")
        self._mig = self.node.mig.acquire(self.cid, gpus[0].uuid, assignment.mig_profile,
                                          assignment.mig_slot, assignment.mig_policy)
        return self.node.mig.edits(self._mig)

    def _existing(self) -> ContainerStatus | None:
        """The container a previous agent left, if it got as far as being started."""
        paths = self.node.driver.paths(self.cid)
        if not paths.root.is_dir():
            return None
        if not paths.supervisor_pid.exists():
            self._cleanup()  # built (or half-prepared) but never started: start afresh
            return None
        log.info("adopting container %s", self.cid)
        return self.node.driver.status(self.cid)

    def _launch(self) -> ContainerStatus | None:
        """Pull, prepare, build and start; None when the pod ended before running."""
        assignment = self.assignment
        if self._stop_wanted:
            self._finish(NOT_STARTED)
            return None
        launched = time.monotonic()
        mark("agent.launch")
        try:
            status = self._create(assignment)
            mark("agent.started")
        except ImageError as error:
            self._fail_launch(error.reason, error.message)
            return None
        except (RuntimeFailure, CdiError) as error:
            self._fail_launch(reason_line(error.message), error.message)
            return None
        except OSError as error:
            self._fail_launch("ContainerCreateFailed", f"preparing the container: {error}")
            return None
        if status is None:
            return None
        if self._gated(status):
            self._start_over()  # created: the rest waits for the gang's release
            status = self._pass_barrier()
        if status.state is not ContainerState.CREATING:
            self.node.metrics.start_seconds.observe(time.monotonic() - launched)
            # What the user waits for goes first: output printed already, or printed
            # within FIRST_OUTPUT_HOLD_SECONDS, ships before the Running report (the
            # server stores one write at a time), which then goes on its own thread
            # while the watch begins.
            shipper = self._shipper()
            shipper.ship()
            if not shipper.shipped_any() and self._await_output(shipper,
                                                                FIRST_OUTPUT_HOLD_SECONDS):
                shipper.ship()
            mark("agent.shipped.at.start")
            self._advance(PodPhase.RUNNING, "Started", None, background=True)
        self._start_over()
        return status

    def _start_over(self) -> None:
        """Tell the node's network that this start no longer needs the CPU (spare
        namespaces are made between starts)."""
        if self.node.network is not None:
            self.node.network.started(self.cid)

    def _create(self, assignment: AssignmentOut) -> ContainerStatus | None:
        if self.node.network is not None:  # its namespace is made while the rest is
            self.node.network.prepare(self.cid, assignment)
        pulling = time.monotonic()
        image = self._stored_image(assignment)
        if image is None:
            # In the background: the pull and the container's start need not wait for
            # the server's acknowledgement.
            self._advance(PodPhase.PULLING, "Pulling", f"pulling image {assignment.image}",
                          background=True)
            image = self.node.images.pull(assignment.image,
                                          credentials=pull_credentials(assignment))
        self.node.metrics.pull_seconds.observe(time.monotonic() - pulling)
        mark("agent.image.ready")
        if self._abandoned or self._stop_wanted:
            self._cleanup()
            if not self._abandoned:
                self._finish(NOT_STARTED)
            return None
        driver = self.node.driver
        with self.node.rootfs_lock:  # see NodeRuntime: one preparation at a time
            rootfs = self.node.images.prepare_rootfs(image, driver.paths(self.cid).root,
                                                     pull_credentials(assignment))
        gpus = self.node.devices.gpus(assignment.gpu_uuids)
        if self.node.migrator is not None:
            self.node.migrator.receive(assignment)  # before its volume disk is bound
        binds = self.node.volumes.binds(assignment) if self.node.volumes else ()
        if self.node.network is not None:
            self._net = self.node.network.attach(self.cid, assignment)
        kept, kept_env = checkpoints.binds_and_env(self.node.state_dir, assignment)
        spec = container_spec(assignment, gpus, self.node.node_name, binds + kept, self._net)
        spec = replace(spec, env={**spec.env, **kept_env})
        spec = self._share(spec, assignment, gpus)
        edits = self._mig_edits(assignment, gpus)
        if self._mig is not None:  # CUDA and the NVIDIA stack see the MIG device itself
            spec = replace(spec, gpus=(gpus[0].model_copy(update={"uuid": self._mig.uuid}),))
        mark("agent.spec.ready")
        driver.build(spec, rootfs, runtime_image_config(image.config), edits)
        mark("agent.bundle.built")
        checkpoints.install_tool(driver.paths(self.cid).run_dir,
                                 self.node.state_dir / "tools" / "gpucloud-ckpt")
        if self.node.network is not None:
            self.node.network.ready(self.cid)
        mark("agent.bundle.ready")
        if _transparent(assignment):  # dumpable (stdio on pipes), restored from its dump
            return driver.start(self.cid, pipe_log=True,
                                restore_from=self._restore_dump(assignment))
        self._restore_checkpoint(assignment)
        if assignment.barrier:
            return driver.create(self.cid)
        with self._shipping_early():
            return driver.start(self.cid)

    @contextmanager
    def _shipping_early(self) -> Iterator[None]:
        """While the container starts, its first output ships the moment it is written,
        from a thread of its own: ``runc run --detach`` returns 4–5 ms after the process
        printed, and the supervisor's report and the status read take 2 ms more, which
        the first line no longer waits for (s43). The server stores a chunk of a pod that
        is still ``Scheduled``, as it stores output shipped before the ``Running`` report.
        Where inotify cannot watch the log the output ships after the start, as before."""
        shipper = self._shipper()
        try:  # the watch needs the file: made as the supervisor makes it, which appends
            os.close(os.open(shipper.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640))
        except OSError:
            yield
            return
        watch = LogWatch.open(shipper.log_path)
        if watch is None:
            yield
            return
        thread = threading.Thread(target=self._ship_first_output, args=(shipper, watch),
                                  name=f"ship-{self.cid[:16]}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            watch.interrupt()  # started (or failed): the worker ships what follows
            thread.join()
            watch.close()

    def _ship_first_output(self, shipper: LogShipper, watch: LogWatch) -> None:
        """Wait for the log's first write (or the end of the start), then ship it."""
        if not shipper.behind():  # looked after the watch began: no write is missed
            watch.wait(self.node.driver.start_timeout)
        if not shipper.behind():
            return
        try:
            shipper.ship()
        except AgentStopped:
            return
        except Exception:  # noqa: BLE001 - the worker ships it after the start then
            log.exception("shipping the first output of container %s failed", self.cid)

    def _stored_image(self, assignment: AssignmentOut) -> StoredImage | None:
        """The pod's image when the node's store has it whole (nothing to pull: the pod
        goes from Scheduled to Running, no Pulling report on the start path); None when
        it must be pulled (the pull raises what is wrong with the reference)."""
        try:
            return self.node.images.get(assignment.image)
        except ImageError:
            return None

    # -- the start barrier of a job's members -------------------------------------------

    def _gated(self, status: ContainerStatus) -> bool:
        """A member's container created but not released yet."""
        return (status.state is ContainerState.CREATING and self.assignment.barrier
                and not self.node.driver.paths(self.cid).start_release.exists())

    def _pass_barrier(self) -> ContainerStatus:
        """Report ready, wait for the server's release (or a stop), then start."""
        self._report_ready()
        while not self.assignment.barrier_released:
            if self.node.stop.is_set():
                raise AgentStopped
            if self._abandoned or self._stop_wanted:
                return self.node.driver.status(self.cid)  # _watch stops it
            self._wake.wait(self.node.watch_interval)
            self._wake.clear()
        return self.node.driver.release(self.cid)

    def _report_ready(self) -> None:
        self._await_in_flight()  # after the phase reports, never ahead of them
        assignment = self.assignment

        def send(client: AgentClient, token: int) -> None:
            client.report_ready(assignment.pod_id,
                                AgentPodReadyRequest(fencing_token=token,
                                                     attempt=assignment.attempt))

        self.node.conn.write(f"ready of pod {assignment.name}", send)

    def _stop_grace(self) -> float:
        """The grace the user asked for at `pod stop --grace`, else the node's default."""
        asked = self.assignment.stop_grace_seconds if self.assignment else None
        return self.node.grace_seconds if asked is None else asked

    def _give_notice(self) -> bool:
        """Write the notice file when the server's stop carries a notice for this attempt;
        True then (SIGTERM goes to the container's whole process group)."""
        notice = self.assignment.stop_notice if not self._abandoned else None
        if notice is None or notice.attempt != self.assignment.attempt:
            return False
        if notice.reason is StopReason.DRAIN and self.assignment.checkpoint_signal is not None \
                and not _transparent(self.assignment):
            # A drain asks for a checkpoint first (the periodic request's signal, at once),
            # then gives the notice: a program that checkpoints only on its request starts
            # saving its state before SIGTERM (a transparent pod is dumped on the notice).
            self.checkpoint_timer.request_now()
            self._checkpoint_request()
        try:
            self.notice.give(self.node.driver.paths(self.cid).run_dir, notice)
        except OSError as error:
            log.warning("pod %s: writing its preemption notice: %s", self.cid, error)
        return True

    def _fail_launch(self, reason: str, message: str) -> None:
        self._cleanup()
        self._finish(Outcome(PodPhase.FAILED, None, reason, message))

    def _watch(self, status: ContainerStatus) -> None:
        """Until the container ends: stop it when asked, ship its log; then report."""
        shipper = self._shipper()
        if status.state is not ContainerState.CREATING and (
                status.exit is None or status.exit.started_at is not None):
            self._advance(PodPhase.RUNNING, "Started", None)
        signalled = False
        full: Outcome | None = None
        disks = self._disk_limits()
        self._watch_checkpoints()
        first_output_until = time.monotonic() + FIRST_OUTPUT_SECONDS
        while status.state in _LIVE:
            if self.node.stop.is_set():
                raise AgentStopped
            if not signalled and full is None:
                full = self._over_size(disks)
            if not signalled and (self._abandoned or self._stop_wanted or full):
                grace = 0.0 if self._abandoned else self._stop_grace()
                noticed = self._give_notice()
                if not (noticed and self._dump_on_notice()):
                    self.node.driver.stop(self.cid, grace, group=noticed)
                signalled = self._stop_signalled = True
            elif signalled and self.notice.newly_acknowledged(self.checkpoints):
                log.info("pod %s acknowledged its notice: stopping it now", self.cid)
                self.node.driver.stop(self.cid, 0.0, group=True)
            if not signalled and status.state is ContainerState.RUNNING:
                self._checkpoint_request()
            shipper.ship()
            self._lazy_events()
            self._pause(shipper, first_output_until)
            self._wake.clear()
            status = self.node.driver.status(self.cid)
        self._close_output_watch()
        if self.checkpoints is not None:
            self.checkpoints.stop()
            if not self._abandoned:
                self.checkpoints.flush()  # a commit the program asked for before it ended
        if not self._abandoned:
            shipper.ship(final=True)
            outcome = outcome_of(status, self.assignment.memory_bytes)
            if full is not None and not self._stop_wanted:
                outcome = Outcome(full.phase, outcome.exit_code, full.reason, full.message)
            self._finish(outcome, self._log_tail())
        self._cleanup()
        shipper.forget()

    def _pause(self, shipper: LogShipper, first_output_until: float) -> None:
        """Wait the watch interval (or until woken). Until the pod's first output has
        shipped, for its first ``FIRST_OUTPUT_SECONDS``, the wait ends the moment the log
        is written to (``LogWatch``: inotify), so the first line reaches the user at once,
        not up to an interval later; where inotify is unavailable the log is looked at
        every ``FIRST_OUTPUT_POLL_SECONDS`` (a ``stat``) instead."""
        deadline = time.monotonic() + self.node.watch_interval
        if not shipper.shipped_any() and time.monotonic() < first_output_until:
            watch = self._output_watch(shipper)
            if watch is not None:
                if self._wake.is_set() or shipper.behind():  # looked after the watch began
                    return
                if watch.wait(min(deadline, first_output_until) - time.monotonic()):
                    return
        else:
            self._close_output_watch()
        while not shipper.shipped_any() and time.monotonic() < min(deadline,
                                                                   first_output_until):
            if self._wake.wait(FIRST_OUTPUT_POLL_SECONDS) or shipper.behind():
                return
        self._wake.wait(max(0.0, deadline - time.monotonic()))

    def _await_output(self, shipper: LogShipper, seconds: float) -> bool:
        """Wait up to ``seconds`` for the log to be written to (or the worker woken);
        whether it holds unshipped bytes. Without inotify: no wait."""
        watch = self._output_watch(shipper)
        if watch is None or self._wake.is_set():
            return shipper.behind()
        if not shipper.behind():  # looked after the watch began: no write is missed
            watch.wait(seconds)
        return shipper.behind()

    def _output_watch(self, shipper: LogShipper) -> LogWatch | None:
        """The inotify watch on the log while the first output is awaited (opened once;
        None where it cannot be)."""
        if not self._output_watch_tried:
            self._output_watch_tried = True
            with self._lock:
                self._first_output = LogWatch.open(shipper.log_path)
        return self._first_output

    def _close_output_watch(self) -> None:
        with self._lock:
            watch, self._first_output = self._first_output, None
        if watch is not None:
            watch.close()

    def _poke(self) -> None:
        """Wake the worker: its wait on ``_wake``, or on the log's first output."""
        self._wake.set()
        with self._lock:
            watch = self._first_output
            if watch is not None:
                watch.interrupt()

    def _pod_checkpoints(self) -> checkpoints.PodCheckpoints | None:
        assignment = self.assignment
        if assignment.checkpoint_key is None:
            return None
        return checkpoints.PodCheckpoints(
            self.node.conn, assignment,
            checkpoints.host_dir(self.node.state_dir, assignment.checkpoint_key))

    def _restore_checkpoint(self, assignment: AssignmentOut) -> None:
        """The latest good checkpoint into the directory, before the command starts."""
        pod = self._pod_checkpoints()
        if pod is None or assignment.restore_checkpoint is None:
            return
        try:
            restored = pod.restore()
        except (checkpoints.CheckpointFailed, OSError) as error:
            raise RuntimeFailure(f"restoring the checkpoint directory: {error}") from None
        log.info("pod %s: restored checkpoint %s", assignment.name,
                 restored.id if restored else "(none usable)")

    def _restore_dump(self, assignment: AssignmentOut) -> Path | None:
        """A transparent pod's latest good dump, fetched (every chunk verified) into its
        dump directory: what ``runc restore`` starts it from; None: start afresh."""
        pod = self._pod_checkpoints()
        if pod is None or assignment.restore_checkpoint is None:
            return None
        try:
            restored = pod.restore()
        except (checkpoints.CheckpointFailed, OSError) as error:
            raise RuntimeFailure(f"restoring the transparent checkpoint: {error}") from None
        log.info("pod %s: restoring from dump %s", assignment.name,
                 restored.id if restored else "(none usable: starting afresh)")
        return pod.directory if restored is not None else None

    def _dump_on_notice(self) -> bool:
        """A transparent pod given notice: dumped (it ends) and the dump uploaded. False
        when it could not be dumped: then it gets SIGTERM and its grace as any other."""
        return _transparent(self.assignment) and self._dump(leave_running=False)

    def _dump(self, *, leave_running: bool) -> bool:
        """``runc checkpoint`` the container into its dump directory and upload that like
        a checkpoint directory (δ: from the dump's start to the committed manifest).
        Whether the dump was taken; an upload that fails is logged (the previous
        committed dump stays the one restored)."""
        pod = self._pod_checkpoints()
        if pod is None:
            return False
        started = time.time()
        try:
            self.node.driver.dump(self.cid, pod.directory, leave_running=leave_running,
                                  gpus=bool(self.assignment.gpu_uuids))
        except (RuntimeFailure, OSError) as error:
            log.warning("pod %s: transparent checkpoint failed: %s", self.cid, error)
            return False
        try:
            committed = pod.upload(started)
        except (checkpoints.CheckpointFailed, OSError) as error:
            log.warning("pod %s: uploading its dump failed: %s", self.cid, error)
            return True
        log.info("pod %s: dump %s committed (%d bytes, %d sent)", self.cid, committed.id,
                 committed.size_bytes, committed.bytes_sent)
        return True

    def _watch_checkpoints(self) -> None:
        pod = self._pod_checkpoints()
        if _transparent(self.assignment):
            return  # no commit markers: the agent dumps it (``_dump``)
        if pod is not None and self.checkpoints is None:
            self.checkpoints = checkpoints.CheckpointWatcher(
                pod, self.node.watch_interval, self.node.stop).start()

    def _checkpoint_request(self) -> None:
        """Send the pod its checkpoint signal when the timer says it is due."""
        assignment = self.assignment
        if not self.checkpoint_timer.due(assignment.checkpoint_interval_seconds):
            return
        if _transparent(assignment):
            self._dump(leave_running=True)  # in this loop: one dump at a time, in order
        elif assignment.checkpoint_signal is not None:
            try:
                self.node.driver.signal(self.cid, assignment.checkpoint_signal)
            except GpucloudError as error:
                log.warning("pod %s: checkpoint request: %s", assignment.name, error.message)
        self.checkpoint_timer.mark_sent()

    def _disk_limits(self) -> list[tuple[DiskLimit, list[float]]]:
        """The pod's sized disks, each with the monotonic time of its next check."""
        if self.node.volumes is None:
            return []
        root = self.node.driver.paths(self.cid).root
        upper = root / "overlay" / "upper"  # the writable layer; a copied rootfs otherwise
        layer = upper if upper.is_dir() else root / "rootfs"
        return [(limit, [0.0]) for limit in self.node.volumes.limits(self.assignment, layer)]

    def _over_size(self, disks: list[tuple[DiskLimit, list[float]]]) -> Outcome | None:
        """Measure the disks that are due; the outcome to stop the pod with if one is over
        its size (the checked limit of agent/volumes)."""
        now = time.monotonic()
        for limit, due in disks:
            if now < due[0]:
                continue
            due[0] = now + self.node.disk_check_interval
            message = limit.excess()
            if message is not None:
                log.info("pod %s: %s", self.assignment.name, message)
                return Outcome(PodPhase.FAILED, None, limit.reason, message)
        return None

    def _reap(self, status: ContainerStatus | None) -> None:
        """Kill a container whose pod is not ours any more, and remove it."""
        if status is not None and status.state in _LIVE:
            log.info("killing container %s: its pod is no longer assigned here", self.cid)
            self.node.driver.stop(self.cid, 0.0)
            while self.node.driver.status(self.cid).state in _LIVE:
                if self.node.stop.wait(self.node.watch_interval):
                    raise AgentStopped
        self._cleanup()
        self._shipper().forget()

    # -- reporting ----------------------------------------------------------------------

    def _advance(self, phase: PodPhase, reason: str | None, message: str | None, *,
                 background: bool = False) -> None:
        """Report ``phase`` unless the server already has it (or is past it, or a report
        of it is in flight). ``background``: on a thread of its own, the worker goes on."""
        order = [PodPhase.SCHEDULED, PodPhase.PULLING, PodPhase.RUNNING]
        known = self._in_flight[1] if self._in_flight else self.reported
        if known in order and order.index(known) >= order.index(phase):
            return
        outcome = Outcome(phase, None, reason, message)
        if not background:
            self._report(outcome)
            return
        self._await_in_flight()
        thread = threading.Thread(target=self._report_quietly, args=(outcome,), daemon=True,
                                  name=f"report-{self.cid[:16]}")
        self._in_flight = (thread, phase)
        thread.start()

    def _report_quietly(self, outcome: Outcome) -> None:
        try:
            self._report(outcome)
        except AgentStopped:
            pass  # the agent is stopping: the next agent reports from what it finds
        except Exception:  # a bug must not take the agent down; the log says where
            log.exception("reporting %s of container %s failed", outcome.phase, self.cid)

    def _await_in_flight(self) -> None:
        """Wait for a background report (from the worker's thread; it is not reentrant)."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight[0] is not threading.current_thread():
            in_flight[0].join()
            self._in_flight = None

    def _finish(self, outcome: Outcome, log_tail: str | None = None) -> None:
        self._report(outcome, log_tail)
        log.info("pod %s attempt %d: %s %s %s", self.assignment.name, self.assignment.attempt,
                 outcome.phase, outcome.reason or "", outcome.message or "")

    def _report(self, outcome: Outcome, log_tail: str | None = None) -> None:
        self._await_in_flight()
        assignment = self.assignment

        def send(client: AgentClient, token: int) -> str:
            request = AgentPodStatusRequest(
                fencing_token=token, phase=outcome.phase, exit_code=outcome.exit_code,
                reason=reason_line(outcome.reason) if outcome.reason else None,
                message=outcome.message[:MAX_MESSAGE] if outcome.message else None,
                log_tail=log_tail, attempt=assignment.attempt,
                mig_device=(_mig_device(self._mig) if self._mig is not None
                            and outcome.phase is PodPhase.RUNNING else None),
                network=(self._net.report() if self._net is not None
                         and outcome.phase is PodPhase.RUNNING else None),
            )
            return client.report_status(assignment.pod_id, request)

        what = f"{outcome.phase} of pod {assignment.name}"
        mark("agent.report.send", phase=outcome.phase.value)
        if self.node.conn.write(what, send) is not None:
            self.reported = outcome.phase
        mark("agent.report.done", phase=outcome.phase.value)

    def _lazy_events(self) -> None:
        """The lazy pull's events of this pod (a fallback to a full pull, a chunk digest
        mismatch, a failed prefetch) as same-phase reports: each becomes a pod event."""
        if self.reported is not PodPhase.RUNNING:
            return
        for reason, message in self.node.images.lazy_events(self.node.driver.paths(self.cid).root):
            self._report(Outcome(PodPhase.RUNNING, None, reason, message))

    # -- helpers ------------------------------------------------------------------------

    def _shipper(self) -> LogShipper:
        """The container's log shipper (one per worker: it keeps the shipped offsets)."""
        if self._log_shipper is None:
            parsed = parse_container_id(self.cid)
            self._log_shipper = LogShipper(
                self.node.conn, parsed[0] if parsed else self.cid,
                self.node.driver.log_path(self.cid),
                self.node.state_dir / "logship" / f"{self.cid}.json",
                attempt=parsed[1] if parsed else None)
        return self._log_shipper

    def _log_tail(self) -> str:
        text = tail(self.node.driver.log_path(self.cid), LOG_TAIL_LINES)
        return text[-LOG_TAIL_BYTES:].decode(errors="replace")

    def _cleanup(self) -> None:
        """Unmount and delete the pod's root filesystem and the container's directory."""
        bundle = self.node.driver.paths(self.cid).root
        try:
            if self.node.sharing is not None:
                self.node.sharing.release(self.cid)
            if self.node.mig is not None:
                self.node.mig.release(self.cid)
            if self.node.network is not None:
                self.node.network.detach(self.cid)
            self.node.images.release_rootfs(bundle)
            self.node.driver.remove(self.cid)
        except (GpucloudError, OSError) as error:
            log.warning("cleaning up container %s: %s", self.cid, error)


def _mig_device(instance: MigInstance) -> MigDevice:
    return MigDevice(gpu_uuid=instance.gpu_uuid, mig_uuid=instance.uuid,
                     profile=instance.profile, slot=instance.slot)
