"""The agent process: a lease thread, an assignments long-poll thread, a worker per pod.

``Agent.run`` blocks until ``stop`` (or a fatal error). Stopping leaves every container
running: a restarted agent registers again, finds them in its state directory and adopts
them. Registry logins are read from ``<state-dir>/registries.json``::

    {"registry.example.com": {"username": "me", "password": "token"}}
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import httpx

from gpucloud.agent.access import AccessServer, PodContainer, running_container
from gpucloud.agent.backoff import Backoff
from gpucloud.agent.config import AgentConfig, poll_wait
from gpucloud.agent.connection import AgentFailure, AgentStopped, Connection, is_transient
from gpucloud.agent.hardware import NodeDevices, prepare_devices, registration
from gpucloud.agent.health import node_health
from gpucloud.agent.identity import IdentityFile
from gpucloud.agent.metrics import AgentMetrics, JobMapping, ObservedSampler
from gpucloud.agent.migration import VolumeExports, VolumeReceiver
from gpucloud.agent.plan import plan
from gpucloud.agent.podnetwork import node_network
from gpucloud.agent.podworker import NodeRuntime, PodWorker, container_id
from gpucloud.agent.renewal import RenewalSchedule
from gpucloud.agent.usage import Target, UsageReporter
from gpucloud.agent.usage_spool import UsageSpool
from gpucloud.agent.volumes import VolumeStore, default_volume_mode
from gpucloud.core.capabilities import NodeCapabilities
from gpucloud.core.errors import GpucloudError, Unauthorized
from gpucloud.core.models import AssignmentOut, NodeRegisterResponse
from gpucloud.core.trace import mark
from gpucloud.gpu.dmem import dmem_regions, dmem_unified
from gpucloud.gpu.mig import mig_manager, with_mig_layout
from gpucloud.gpu.mps import GpuSharing, SharingMode, node_sharing
from gpucloud.gpu.nvml import DEFAULT_NVML
from gpucloud.gpu.usage import gpu_usage
from gpucloud.images import Credentials, ImageManager
from gpucloud.images.lazy.mounter import node_lazyfs
from gpucloud.runtime import criu
from gpucloud.runtime.driver import ContainerState, RuncDriver
from gpucloud.runtime.layout import read_json

log = logging.getLogger(__name__)
FINISHED_MEMORY_SECONDS = 600.0
SHUTDOWN_JOIN_SECONDS = 5.0


def registry_logins(state_dir: Path) -> dict[str, Credentials]:
    """``<state-dir>/registries.json``, if present."""
    path = state_dir / "registries.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise AgentFailure(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise AgentFailure(f"{path} must map registries to a username and password")
    return {str(host): Credentials(str(login["username"]), str(login["password"]))
            for host, login in data.items()}


SIGNAL_CHECK_SECONDS = 0.5
#: The GIL switch interval of an agent process (Python's default: 5 ms); see ``run``.
GIL_SWITCH_SECONDS = 0.001


class Agent:
    def __init__(self, config: AgentConfig, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.config = config
        self.stop_event = threading.Event()
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.devices: NodeDevices = prepare_devices(config.simulate, config.name,
                                                    config.state_dir)
        body = registration(self.devices.hardware, join_token=config.join_token,
                            name=config.name, labels=config.labels, address=config.address)
        self.mig = mig_manager(self.devices.hardware, config.state_dir, DEFAULT_NVML)
        self._mig_reconciled = self.mig is None
        if self.mig is not None:
            with_mig_layout(body, self.mig)
        volume_mode = config.volume_mode or default_volume_mode(config.server)
        body.volume_mode = volume_mode
        body.network_mode = config.network_mode
        # A real dump-and-restore canary decides transparent checkpoints (runtime/criu).
        body.capabilities = criu.probe(config.state_dir, runc=config.runc)
        if not body.capabilities.criu:
            log.info("transparent checkpoints unavailable: %s", body.capabilities.criu_reason)
        self.sharing = self._gpu_sharing(body.capabilities)
        self.health = node_health(config, self.devices.hardware)
        self._registration_body = body
        if self.health is not None and self.mig is not None:
            self.health.mig_mode = self._switch_mig_mode  # node mig-mode (agent/health)
        self.conn = Connection(config.server, body, IdentityFile(config.state_dir),
                               self.stop_event, transport, on_registered=self._registered)
        self.driver = RuncDriver(config.state_dir, runc=config.runc)
        self.registration = body
        self.exports = VolumeExports(config.state_dir / "volumes")
        self.access = AccessServer(
            self.driver, self._pod_container, host_key_path=config.state_dir / "access_host_key",
            host=config.access_host or config.address or "127.0.0.1", port=config.access_port,
            keys_path=config.state_dir / "gateway_keys", exports=self.exports)
        body.access_host_key = self.access.host_public_key
        self.images = ImageManager(config.state_dir,
                                   credentials=registry_logins(config.state_dir),
                                   lazy=node_lazyfs(
                                       config.state_dir, cache_limit=config.lazy_cache_bytes,
                                       read_deadline=config.lazy_read_deadline_seconds))
        self.network = node_network(config.state_dir, mode=config.network_mode,
                                    pod_cidr=config.pod_cidr, address=config.address,
                                    port_range=config.port_range)
        self.runtime = NodeRuntime(
            conn=self.conn, driver=self.driver, images=self.images, devices=self.devices,
            node_name=config.name, state_dir=config.state_dir, stop=self.stop_event,
            grace_seconds=config.stop_grace_seconds,
            watch_interval=config.watch_interval_seconds,
            volumes=VolumeStore(config.state_dir, config.server, volume_mode),
            disk_check_interval=config.disk_check_interval_seconds,
            network=self.network,
            migrator=VolumeReceiver(self.conn, self.access.host_key, config.state_dir),
            metrics=AgentMetrics(config.name),
            sharing=self.sharing,
            mig=self.mig,
        )
        self.workers: dict[str, PodWorker] = {}
        self.finished: dict[str, float] = {}
        self.metrics = self.runtime.metrics
        #: The port ``/metrics`` is served on once running (None: not served).
        self.metrics_port: int | None = None
        self.job_mapping = (JobMapping(config.hpc_job_mapping_dir)
                            if config.hpc_job_mapping_dir is not None else None)
        self.usage = UsageReporter(
            self.conn, UsageSpool(config.state_dir / "usage"),
            ObservedSampler(self.metrics, gpu_usage(self.devices.hardware.provider),
                            disk_interval=config.disk_check_interval_seconds,
                            clock=self.conn.server_clock.now),  # not the node's clock
            self._usage_targets, config.usage_interval_seconds, self.stop_event,
            self._container_ids)
        self.revision: int | None = None
        #: the next long poll's wait (``poll_wait``: longer when the server asks it)
        self.poll_wait_seconds = config.poll_wait_seconds
        self.error: GpucloudError | None = None

    def _gpu_sharing(self, capabilities: NodeCapabilities) -> GpuSharing:
        """The node's sharing policy and dmem regions, reported as capabilities."""
        hardware = self.devices.hardware
        regions = dmem_regions() if hardware.provider == "nvml" else {}
        sharing = node_sharing(cast(SharingMode, self.config.gpu_sharing), self.config.state_dir,
                               hardware.provider, DEFAULT_NVML, regions)
        capabilities.gpu_sharing = self.config.gpu_sharing
        capabilities.dmem_gpus = [gpu.uuid for gpu in hardware.gpus
                                  if dmem_unified(regions, gpu, 1)]
        return sharing

    def _switch_mig_mode(self, index: int, on: bool) -> str:
        """Switch a GPU's MIG mode; a re-registration then advertises the new mode."""
        assert self.mig is not None
        done = self.mig.set_mig_mode(index, on)
        for gpu in self._registration_body.gpus:
            if gpu.index == index:
                gpu.mig_mode = on
        return done

    @property
    def hardware_note(self) -> str | None:
        return self.devices.hardware.note

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> None:
        """Register, then serve until ``stop``; raises AgentFailure if it cannot go on."""
        threads: list[threading.Thread] = []
        # A pod's worker gives up the GIL at every syscall (mkdir, mount, write, a child's
        # pipe) and waits for it again while the poll, lease, usage and report threads run
        # Python: up to the switch interval per wait, dozens of waits per start. As the
        # server does (api/app.py), a shorter interval keeps them from adding up.
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        try:
            # Before registering: the registration carries the access server's endpoint.
            self.registration.access_endpoint = self.access.start()
            self.driver.prestart()  # the first pod need not wait for its interpreter
            if self.config.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.config.metrics_host,
                                                       self.config.metrics_port)
            self.conn.connect()
            threads = [
                threading.Thread(target=self._guard, args=(self._lease_loop,), name="lease",
                                 daemon=True),
                threading.Thread(target=self._guard, args=(self._poll_loop,),
                                 name="assignments", daemon=True),
                threading.Thread(target=self._guard, args=(self.usage.run,), name="usage",
                                 daemon=True),
            ]
            for thread in threads:
                thread.start()
            # Wake up now and then: a SIGTERM delivered to another thread only sets a
            # flag, and the main thread runs Python's handler when it next wakes.
            while not self.stop_event.wait(SIGNAL_CHECK_SECONDS):
                pass
        except AgentStopped:
            pass
        finally:
            self.stop_event.set()
            self.access.stop()  # pod sessions end; the pods keep running
            self.metrics.close()
            self.network.close()  # public ports close; pods and their namespaces stay
            if not self._join(threads):
                self.images.close()
                self.conn.close()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Stop serving; containers keep running (a restarted agent adopts them)."""
        self.stop_event.set()

    def _registered(self, response: NodeRegisterResponse) -> None:
        """Every (re-)registration names the gateway keys that may log in to pods."""
        self.access.set_gateway_keys(response.gateway_public_keys)

    def _pod_container(self, pod_id: str) -> PodContainer | None:
        """The pod's current running container (called from the access server's thread:
        ``list`` copies the workers' ids at once while the poll thread may change them)."""
        return running_container(self.driver, list(self.workers), pod_id)

    def _guard(self, loop: Callable[[], None]) -> None:
        """Run a loop; a fatal error stops the whole agent (and is raised from ``run``)."""
        try:
            loop()
        except AgentStopped:
            pass
        except GpucloudError as error:
            log.error("%s", error.message)
            self.error = error
            self.stop_event.set()

    def _join(self, threads: list[threading.Thread]) -> bool:
        """Give threads a moment to notice the stop; True if some are still busy.

        The long-poll may hang on for up to ``poll_wait_seconds``; it is not waited for
        (closing its client under it would block until it returns), as daemon threads it
        and any slow worker end with the process.
        """
        deadline = time.monotonic() + SHUTDOWN_JOIN_SECONDS
        for thread in [*threads, *(w.thread for w in self.workers.values())]:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()) if thread.name != "assignments"
                            else 0.05)
        return any(t.is_alive() for t in [*threads, *(w.thread for w in self.workers.values())])

    # -- usage --------------------------------------------------------------------------

    def _usage_targets(self) -> list[Target]:
        """The running containers of this agent's workers (called on the usage thread:
        ``list`` copies the workers at once while the poll thread may change them)."""
        targets = []
        for cid, worker in list(self.workers.items()):
            assignment = worker.current
            if assignment is None or not worker.alive:
                continue
            try:
                status = self.driver.status(cid)
                gpus = self.devices.gpus(assignment.gpu_uuids)
            except GpucloudError:
                continue
            if status.state is not ContainerState.RUNNING or status.pid is None:
                continue
            volumes = self.runtime.volumes
            targets.append(Target(
                cid=cid, pod_id=assignment.pod_id, attempt=assignment.attempt,
                pid=status.pid, gpus=gpus, env=assignment.env,
                exclusive_gpus=assignment.gpu_milli == 0, own_netns=self._own_netns(cid),
                volume_dir=(volumes.disk(assignment.pod_id)
                            if volumes is not None and assignment.volume_bytes else None)))
        self.metrics.usage.keep({t.cid for t in targets})
        if self.job_mapping is not None:
            self.job_mapping.write(targets)
        return targets

    def _own_netns(self, cid: str) -> bool:
        """Whether the container has its own network namespace (``network.json``)."""
        data = read_json(self.network.path(cid)) if self.network is not None else None
        return isinstance(data, dict) and not data.get("host_network") and bool(
            data.get("netns"))

    def _container_ids(self) -> set[str]:
        return {p.name for p in self.driver.containers_dir.iterdir() if p.is_dir()}

    # -- the lease ----------------------------------------------------------------------

    def _lease_loop(self) -> None:
        """Renew every third of the TTL at a fixed rate (from when the last renewal was
        sent, agent/renewal.py), holding the current fencing token; retry sooner (but
        never later than that) while the server cannot be reached."""
        backoff = Backoff()
        schedule = RenewalSchedule(self.conn.renewal_period)  # TTL/3, jittered
        while not self.stop_event.wait(schedule.wait_seconds()):
            sent = schedule.sending()
            try:
                self.conn.renew(self.health.report() if self.health is not None else None)
                backoff.reset()
                schedule.renewed(sent)
            except GpucloudError as error:
                if not is_transient(error):
                    raise
                log.warning("lease renewal failed: %s", error.message)
                schedule.retry_in(min(backoff.next_delay(), self.conn.lease_ttl_seconds / 3))

    # -- assignments --------------------------------------------------------------------

    def _poll_loop(self) -> None:
        backoff = Backoff()
        while not self.stop_event.is_set():
            try:
                snapshot = self.conn.client.assignments(self.revision, self.poll_wait_seconds)
            except Unauthorized:
                self.conn.connect()
                continue
            except GpucloudError as error:
                if self.stop_event.is_set():
                    return
                if not is_transient(error):
                    raise
                log.warning("fetching assignments failed: %s", error.message)
                if backoff.wait(self.stop_event):
                    return
                continue
            backoff.reset()
            if self.stop_event.is_set():
                return
            mark("agent.poll.answer", revision=snapshot.revision, pods=len(snapshot.pods))
            self.revision = snapshot.revision
            self.poll_wait_seconds = poll_wait(self.config.poll_wait_seconds,
                                               snapshot.poll_wait_seconds)
            self.exports.update(snapshot.volume_exports)
            self.reconcile(snapshot.pods)
            self._collect_volumes(snapshot.volume_pods)
            if self.health is not None:  # node gpu-reset / node diag (agent/health)
                self.health.submit(snapshot.gpu_actions)

    def reconcile(self, assigned: list[AssignmentOut]) -> None:
        """Bring workers and containers in line with what the server assigns."""
        self._collect()
        containers = [p.name for p in self.driver.containers_dir.iterdir() if p.is_dir()]
        if not self._mig_reconciled and self.mig is not None:
            # Once, before any worker starts: adopt the instances of containers still
            # here, destroy the ones made for containers that are gone (orphans).
            gone = self.mig.reconcile(set(containers))
            if gone:
                log.info("destroyed orphaned MIG instances: %s", ", ".join(gone))
            self._mig_reconciled = True
        steps = plan(assigned, self.workers.keys(), containers, self.finished.keys())
        for assignment in steps.update:
            self.workers[container_id(assignment.pod_id, assignment.attempt)].update(assignment)
        for cid in steps.abandon:
            self.workers[cid].abandon()
        for assignment in steps.start:
            self._spawn(container_id(assignment.pod_id, assignment.attempt), assignment)
        for cid in steps.reap:
            self._spawn(cid, None)

    def _collect_volumes(self, volume_pods: list[str] | None) -> None:
        """Delete volume disks the server no longer places here; only from a complete
        list (None: a server that does not send one), never under a live worker."""
        volumes = self.runtime.volumes
        if volume_pods is None or volumes is None:
            return
        busy = [cid.rpartition("-")[0] for cid, worker in self.workers.items() if worker.alive]
        volumes.collect(volume_pods, busy)

    def _spawn(self, cid: str, assignment: AssignmentOut | None) -> None:
        mark("agent.spawn", cid=cid)
        worker = PodWorker(self.runtime, cid, assignment)
        self.workers[cid] = worker
        worker.start()

    def _collect(self) -> None:
        """Forget ended workers, remembering the ones that finished their pod."""
        now = time.monotonic()
        for cid, worker in list(self.workers.items()):
            if not worker.alive:
                del self.workers[cid]
                if worker.completed:
                    self.finished[cid] = now
        for cid, when in list(self.finished.items()):
            if now - when > FINISHED_MEMORY_SECONDS:
                del self.finished[cid]
