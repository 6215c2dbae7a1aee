"""Sampling what each pod uses, and sending it to the server until it is acknowledged.

Every ``interval`` seconds the reporter samples each running container of this agent:

* CPU time and memory from its cgroup — v1 (``cpuacct.usage`` in ns,
  ``memory.usage_in_bytes`` less ``total_inactive_file``, ``memory.max_usage_in_bytes``)
  or v2 (``cpu.stat`` ``usage_usec``, ``memory.current`` less ``inactive_file``,
  ``memory.peak`` where the kernel has it, else the highest current seen);
* GPU utilisation and memory per assigned GPU (``gpu/usage``: NVML, or the simulated
  model of ``GPUCLOUD_SIM_GPU_UTIL``);
* network bytes from its own network namespace (``/proc/<pid>/net/dev``, loopback left
  out; None for a pod on the host's network, whose bytes are not its own);
* bytes used by its volume disk, measured every ``disk_interval`` seconds.

Counters are cumulative since the container started. A sample's time is the server's as
the agent reckons it (the agent passes ``Connection.server_clock``: the last lease answer
carried forward on the monotonic clock, agent/server_time.py), not the node's wall clock,
which may be stepped or wrong. Each sample goes into the spool
(``agent/usage_spool``) before it is sent, in batches carrying the fencing token
(a stale token is refreshed and the batch sent again; an unreachable server is tried
again next round while sampling goes on; a busy server's 503 or 429 is honoured: nothing
is sent before its ``Retry-After``, doubled for each refusal in a row). A refused
batch (a pod attempt the server says was never here, a time it finds far in the future)
is split per container, and only the refused containers' samples are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gpucloud.agent.connection import MAX_STALE_RETRIES, Connection, is_transient
from gpucloud.agent.usage_spool import UsageSpool
from gpucloud.agent.volumes import disk_usage
from gpucloud.client.sdk import ApiError
from gpucloud.core.errors import (
    Conflict,
    GpucloudError,
    InvalidInput,
    NotFound,
    StaleFencingToken,
    Unauthorized,
)
from gpucloud.core.usage import (
    MAX_BATCH_SAMPLES,
    AgentUsageBatchOut,
    AgentUsageBatchRequest,
    UsageSample,
)
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.usage import GpuUsage
from gpucloud.runtime.cgroups import cgroup_dir

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_SECONDS = 5.0
#: One POST carries up to the server's maximum: fewer, bigger batches cost the server
#: one fencing read, one validation query and one INSERT each.
BATCH_SAMPLES = MAX_BATCH_SAMPLES
#: The longest wait after refusals in a row from a busy server (503 + Retry-After).
MAX_BACKOFF_SECONDS = 60.0


# -- cgroups -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupUsage:
    cpu_seconds: float
    memory_bytes: int
    memory_peak_bytes: int | None


def _int_file(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    """``key value`` lines (``cpu.stat``, ``memory.stat``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


def read_cgroup_v1(cpuacct: Path, memory: Path) -> CgroupUsage | None:
    """cgroup v1: None when the cgroup is gone (the container ended)."""
    cpu_ns = _int_file(cpuacct / "cpuacct.usage")
    usage = _int_file(memory / "memory.usage_in_bytes")
    if cpu_ns is None or usage is None:
        return None
    inactive = _keyed(memory / "memory.stat").get("total_inactive_file", 0)
    return CgroupUsage(cpu_ns / 1e9, max(0, usage - inactive),
                       _int_file(memory / "memory.max_usage_in_bytes"))


def read_cgroup_v2(directory: Path) -> CgroupUsage | None:
    """cgroup v2 (unified): None when the cgroup is gone."""
    cpu_usec = _keyed(directory / "cpu.stat").get("usage_usec")
    current = _int_file(directory / "memory.current")
    if cpu_usec is None or current is None:
        return None
    inactive = _keyed(directory / "memory.stat").get("inactive_file", 0)
    return CgroupUsage(cpu_usec / 1e6, max(0, current - inactive),
                       _int_file(directory / "memory.peak"))


def cgroup_usage(pid: int, proc: Path = Path("/proc"),
                 mountinfo: Path = Path("/proc/self/mountinfo")) -> CgroupUsage | None:
    """The cgroup counters of the container whose init process is ``pid``."""
    memory = cgroup_dir(pid, "memory", proc, mountinfo)
    if memory is None:
        return None
    if (memory / "memory.current").exists() or (memory / "cgroup.controllers").exists():
        return read_cgroup_v2(memory)
    cpuacct = cgroup_dir(pid, "cpuacct", proc, mountinfo)
    return read_cgroup_v1(cpuacct, memory) if cpuacct is not None else None


def cgroup_pids(pid: int, proc: Path = Path("/proc"),
                mountinfo: Path = Path("/proc/self/mountinfo")) -> list[int]:
    """Host pids of every process in the container's cgroup (for NVML's per-process data)."""
    memory = cgroup_dir(pid, "memory", proc, mountinfo)
    if memory is None:
        return [pid]
    try:
        return [int(line) for line in (memory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return [pid]


# -- network -----------------------------------------------------------------------------


def parse_net_dev(text: str) -> tuple[int, int]:
    """(rx, tx) bytes summed over the interfaces of ``/proc/net/dev``, loopback excluded."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, sep, counters = line.partition(":")
        fields = counters.split()
        if not sep or name.strip() == "lo" or len(fields) < 9:
            continue
        rx += int(fields[0])
        tx += int(fields[8])
    return rx, tx


def net_bytes(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """The counters of ``pid``'s network namespace."""
    try:
        return parse_net_dev((proc / str(pid) / "net" / "dev").read_text())
    except (OSError, ValueError):
        return None


# -- sampling ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A running container to sample (the agent builds these from its workers)."""

    cid: str
    pod_id: str
    attempt: int
    pid: int
    gpus: tuple[GpuDevice, ...]
    env: Mapping[str, str]
    exclusive_gpus: bool
    own_netns: bool
    volume_dir: Path | None


class PodSampler:
    """Reads one sample of a target; remembers peaks and disk readings between calls.
    ``clock``: the samples' time (the agent's is the server's, ``ServerClock.now``)."""

    def __init__(self, gpus: GpuUsage, disk_interval: float = 30.0,
                 proc: Path = Path("/proc"),
                 mountinfo: Path = Path("/proc/self/mountinfo"),
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.gpus = gpus
        self.disk_interval = disk_interval
        self.proc, self.mountinfo, self.clock = proc, mountinfo, clock
        self._peaks: dict[str, int] = {}
        self._disks: dict[str, tuple[datetime, int]] = {}

    def sample(self, target: Target, seq: int) -> UsageSample | None:
        """None when the container's cgroup is gone (it ended between listing and now)."""
        cgroup = cgroup_usage(target.pid, self.proc, self.mountinfo)
        if cgroup is None:
            return None
        now = self.clock()
        peak = max(self._peaks.get(target.cid, 0), cgroup.memory_bytes,
                   cgroup.memory_peak_bytes or 0)
        self._peaks[target.cid] = peak
        net = net_bytes(target.pid, self.proc) if target.own_netns else None
        pids = cgroup_pids(target.pid, self.proc, self.mountinfo) if target.gpus else []
        return UsageSample(
            pod_id=target.pod_id, attempt=target.attempt, seq=seq, time=now,
            cpu_seconds=cgroup.cpu_seconds, memory_bytes=cgroup.memory_bytes,
            memory_peak_bytes=peak,
            gpus=self.gpus.sample(target.gpus, target.env, pids, target.exclusive_gpus),
            net_rx_bytes=net[0] if net else None, net_tx_bytes=net[1] if net else None,
            disk_bytes=self._disk(target, now))

    def _disk(self, target: Target, now: datetime) -> int | None:
        if target.volume_dir is None:
            return None
        last = self._disks.get(target.cid)
        if last is None or (now - last[0]).total_seconds() >= self.disk_interval:
            last = (now, disk_usage(target.volume_dir))
            self._disks[target.cid] = last
        return last[1]

    def forget(self, cid: str) -> None:
        self._peaks.pop(cid, None)
        self._disks.pop(cid, None)


# -- the reporter ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Refused:
    message: str


class UsageReporter:
    """The agent's ``usage`` thread: sample, spool, send, every ``interval`` seconds."""

    def __init__(self, conn: Connection, spool: UsageSpool, sampler: PodSampler,
                 targets: Callable[[], Iterable[Target]], interval: float,
                 stop: threading.Event, live: Callable[[], set[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.conn, self.spool, self.sampler = conn, spool, sampler
        self.targets, self.interval, self.stop, self.live = targets, interval, stop, live
        self.clock = clock
        #: No send before this (the server's Retry-After, backed off while it refuses).
        self.not_before = float("-inf")
        self._refusals = 0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.tick()
            except OSError as error:  # a full or failing disk under the spool
                log.warning("usage spool: %s", error)

    def tick(self) -> None:
        """One round: a sample of every running container, then send what is pending."""
        for target in self.targets():
            self._take(target)
        self.send()
        self._forget_ended()

    def _take(self, target: Target) -> None:
        def make(seq: int) -> UsageSample:
            sample = self.sampler.sample(target, seq)
            if sample is None:
                raise _Gone
            return sample

        try:
            self.spool.append(target.cid, make)
        except _Gone:
            return
        except (OSError, GpucloudError) as error:
            log.warning("sampling usage of %s: %s", target.cid, error)

    def send(self) -> None:
        """Everything pending, in batches; containers the server refuses are dropped."""
        while self.clock() >= self.not_before:
            batch = self.spool.pending(BATCH_SAMPLES)
            if not batch:
                return
            result = self._post(batch)
            if result is None:
                return  # the agent stops, or the server is unreachable: try next round
            if isinstance(result, _Refused):
                self._send_apart(batch, result)
                continue
            self._acknowledge(batch)
            self._refusals = 0

    def _back_off(self, retry_after: float | None) -> None:
        """A busy server (503/429): nothing is sent before its ``Retry-After``, doubled
        for each refusal in a row (up to ``MAX_BACKOFF_SECONDS``); the samples stay in
        the spool meanwhile, and sampling goes on."""
        self._refusals += 1
        wait = (retry_after if retry_after is not None else self.interval)
        wait = min(MAX_BACKOFF_SECONDS, wait * 2 ** (self._refusals - 1))
        self.not_before = self.clock() + max(wait, retry_after or 0.0)

    def _send_apart(self, batch: list[UsageSample], refused: _Refused) -> None:
        """Each container's samples alone: drop only those the server refuses."""
        groups: dict[str, list[UsageSample]] = {}
        for sample in batch:
            groups.setdefault(_cid(sample), []).append(sample)
        if len(groups) == 1:
            [(cid, samples)] = groups.items()
            log.warning("usage of %s refused, dropping %d sample(s): %s", cid, len(samples),
                        refused.message)
            self.spool.acknowledge(cid, samples[-1].seq)
            return
        for samples in groups.values():
            result = self._post(samples)
            if result is None:
                return
            if isinstance(result, _Refused):
                self._send_apart(samples, result)
            else:
                self._acknowledge(samples)

    def _acknowledge(self, batch: list[UsageSample]) -> None:
        highest: dict[str, int] = {}
        for sample in batch:
            cid = _cid(sample)
            highest[cid] = max(highest.get(cid, -1), sample.seq)
        for cid, seq in highest.items():
            self.spool.acknowledge(cid, seq)

    def _post(self, batch: list[UsageSample]) -> AgentUsageBatchOut | _Refused | None:
        """One send (not ``Connection.write``, which retries until the server answers:
        sampling must go on meanwhile); None: try again next round."""
        for _ in range(MAX_STALE_RETRIES + 1):
            token = self.conn.fencing_token
            try:
                return self.conn.client.post_usage(
                    AgentUsageBatchRequest(fencing_token=token, samples=batch))
            except StaleFencingToken:
                self._reacquire(token)
            except Unauthorized:
                return None  # the lease thread registers again
            except (InvalidInput, NotFound, Conflict) as error:
                return _Refused(error.message)
            except ApiError as error:
                if error.status in (429, 503):
                    self._back_off(error.retry_after)
                elif not is_transient(error):
                    log.warning("sending usage failed: %s", error.message)
                log.debug("sending usage: %s; next round", error.message)
                return None
        return None

    def _reacquire(self, used: int) -> None:
        """A new grant unless the lease thread took one since ``used`` was read."""
        if self.conn.fencing_token != used:
            return
        try:
            self.conn.reacquire()
        except GpucloudError as error:
            log.debug("re-acquiring the lease for usage: %s", error.message)

    def _forget_ended(self) -> None:
        """Spools of containers that are gone and fully acknowledged."""
        live = self.live()
        for cid in self.spool.containers():
            if cid not in live and not self.spool.pending_of(cid):
                self.spool.forget(cid)
                self.sampler.forget(cid)


class _Gone(Exception):
    """The container ended while it was being sampled."""


def _cid(sample: UsageSample) -> str:
    return f"{sample.pod_id}-{sample.attempt}"

