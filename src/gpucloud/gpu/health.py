"""GPU health: XID classes from NVIDIA's catalog, the checks, and faults a test injects.

What an XID means for scheduling (NVIDIA's XID catalog and the device plugin's handling):

- node-level (79 fell off the bus, 74 NVLink error, fabric errors 144-150): the node is
  cordoned with the reason; nothing new lands there.
- reset class (46, 62, 64, 95, 109, 110, 119, 120; 48 double-bit ECC, whose documented
  workflow is a reset that retires the page): that GPU is out of scheduling until it is
  reset and passes a short diag; the node stays usable for its other GPUs.
- application (94 contained ECC error, 13/31/43/45 program faults): only the program that
  hit it is affected; nothing is taken out.
- informational (63, 92 and anything not in the table): recorded, nothing taken out.

Hysteresis: a GPU (or the node) goes back into service only after ``recovery_checks``
checks in a row find nothing wrong, so a flapping GPU does not take pods and lose them;
or at once after an admin's reset and a passed diag (``Maintenance``: ``nvidia-smi
--gpu-reset`` and ``dcgmi diag`` on real GPUs, ``SimulatedMaintenance`` otherwise).
"""

from __future__ import annotations

import enum
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class XidAction(enum.StrEnum):
    NODE = "node"
    GPU_RESET = "gpu-reset"
    APPLICATION = "application"
    INFO = "info"


_NODE_XIDS = frozenset({74, 79, *range(144, 151)})
_RESET_XIDS = frozenset({46, 48, 62, 64, 95, 109, 110, 119, 120})
_APP_XIDS = frozenset({13, 31, 43, 45, 94})


def classify_xid(xid: int) -> XidAction:
    """What XID ``xid`` takes out of service (see the module docstring)."""
    if xid in _NODE_XIDS:
        return XidAction.NODE
    if xid in _RESET_XIDS:
        return XidAction.GPU_RESET
    if xid in _APP_XIDS:
        return XidAction.APPLICATION
    return XidAction.INFO


_KERNEL_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def kernel_log_xids(text: str) -> list[tuple[str, int]]:
    """(PCI bus id, XID) of each ``NVRM: Xid (PCI:0000:18:00): 79, pid=…`` line."""
    found = []
    for match in _KERNEL_XID.finditer(text):
        bus = match.group(1).lower()
        if bus.count(":") == 2 and "." not in bus:
            bus += ".0"  # the kernel prints domain:bus:device; sysfs adds the function
        found.append((bus, int(match.group(2))))
    return found


@dataclass(frozen=True)
class Fault:
    """One observed fault on GPU ``index``: an XID, or another failed check."""

    index: int
    xid: int | None = None
    check: str | None = None

    @property
    def action(self) -> XidAction:
        if self.xid is not None:
            return classify_xid(self.xid)
        return XidAction.NODE if self.check == "lost" else XidAction.GPU_RESET

    def describe(self) -> str:
        what = f"XID {self.xid}" if self.xid is not None else str(self.check)
        return f"GPU{self.index}: {what} ({self.action.value})"


_INJECTED = re.compile(r"^GPU(\d+):(?:xid(\d+)|(ecc|temperature|lost|retired-pages))$",
                       re.IGNORECASE)


def parse_injected(text: str) -> Fault:
    """``GPU3:xid79`` (or ``GPU1:ecc``, ``:temperature``, ``:lost``, ``:retired-pages``)."""
    match = _INJECTED.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not GPU<N>:xid<CODE> (or GPU<N>:ecc|temperature|lost)")
    index = int(match.group(1))
    if match.group(2):
        return Fault(index, xid=int(match.group(2)))
    return Fault(index, check=match.group(3).lower())


@dataclass
class InjectedFaults:
    """The faults of a simulated node: given at start, plus the lines of ``path`` now (a
    test writes the file; emptying it is the simulated reset)."""

    fixed: tuple[Fault, ...] = ()
    path: Path | None = None

    def read(self) -> list[Fault]:
        faults = list(self.fixed)
        if self.path is not None:
            try:
                lines = self.path.read_text().splitlines()
            except OSError:
                lines = []
            faults += [parse_injected(line) for line in lines if line.strip()]
        return faults


@dataclass(frozen=True)
class GpuHealth:
    uuid: str
    healthy: bool
    reason: str | None = None


@dataclass(frozen=True)
class HealthReport:
    gpus: tuple[GpuHealth, ...]
    #: A node-level fault: the node is to be cordoned with this reason (None: none).
    node_fault: str | None


@dataclass
class HealthTracker:
    """Faults found by each check → the health to report, with hysteresis.

    ``uuids[i]`` is the UUID of GPU index ``i``. A GPU with a reset-class or node-level
    fault is unhealthy; it is healthy again after ``recovery_checks`` clean checks in a row
    (for a real GPU: the reset happened and ``dcgmi diag`` passed, see ``NvmlHealth``).
    """

    uuids: tuple[str, ...]
    recovery_checks: int = 2
    _bad: dict[int, str] = field(default_factory=dict)
    _clean: dict[int, int] = field(default_factory=dict)
    _node: str | None = None
    _node_clean: int = 0

    def update(self, faults: Iterable[Fault]) -> HealthReport:
        now: dict[int, str] = {}
        node: list[str] = []
        for fault in faults:
            if fault.action in (XidAction.APPLICATION, XidAction.INFO):
                continue
            now.setdefault(fault.index, fault.describe())
            if fault.action is XidAction.NODE:
                node.append(fault.describe())
        self._gpus(now)
        self._node_level(node)
        gpus = tuple(GpuHealth(uuid, index not in self._bad, self._bad.get(index))
                     for index, uuid in enumerate(self.uuids))
        return HealthReport(gpus, self._node)

    def recovered(self, index: int) -> None:
        """GPU ``index`` was reset and passed a diag: back in service without waiting out
        the clean checks (a fault seen again takes it out again)."""
        self._bad.pop(index, None)
        self._clean.pop(index, None)

    def _gpus(self, now: dict[int, str]) -> None:
        for index, reason in now.items():
            self._bad[index], self._clean[index] = reason, 0
        for index in [i for i in self._bad if i not in now]:
            self._clean[index] = self._clean.get(index, 0) + 1
            if self._clean[index] >= self.recovery_checks:
                del self._bad[index], self._clean[index]

    def _node_level(self, node: list[str]) -> None:
        if node:
            self._node, self._node_clean = "; ".join(node), 0
        elif self._node is not None:
            self._node_clean += 1
            if self._node_clean >= self.recovery_checks:
                self._node, self._node_clean = None, 0


def _nvml_faults_of(nvml: object, index: int, uuid: str) -> list[Fault]:
    """NVML checks of one GPU: fallen off the bus, uncorrected ECC, pending page
    retirement, temperature at the model's slowdown threshold."""
    api: Any = nvml
    try:
        handle = api.nvmlDeviceGetHandleByUUID(uuid)
        api.nvmlDeviceGetPciInfo(handle)
    except api.NVMLError as error:
        lost = getattr(api, "NVML_ERROR_GPU_IS_LOST", None)
        return [Fault(index, check="lost" if getattr(error, "value", None) == lost
                      else "unreachable")]
    faults = []
    checks = (
        ("ecc", lambda: api.nvmlDeviceGetTotalEccErrors(
            handle, api.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, api.NVML_VOLATILE_ECC) > 0),
        ("retired-pages", lambda: api.nvmlDeviceGetRetiredPagesPendingStatus(handle)
         == api.NVML_FEATURE_ENABLED),
        ("temperature", lambda: api.nvmlDeviceGetTemperature(handle, api.NVML_TEMPERATURE_GPU)
         >= api.nvmlDeviceGetTemperatureThreshold(
             handle, api.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
    )
    for name, check in checks:
        failed: Callable[[], bool] = check
        try:
            if failed():
                faults.append(Fault(index, check=name))
        except api.NVMLError:
            continue  # not supported on this GPU or driver
    return faults


def nvml_faults(nvml: object, uuids: tuple[str, ...], bus_ids: tuple[str | None, ...],
                kernel_log: Path | None = None) -> list[Fault]:
    """The faults NVML and the kernel log (``NVRM: Xid`` lines) show now."""
    api: Any = nvml
    api.nvmlInit()
    try:
        faults = [f for i, uuid in enumerate(uuids) for f in _nvml_faults_of(api, i, uuid)]
    finally:
        api.nvmlShutdown()
    if kernel_log is not None:
        try:
            text = kernel_log.read_text(errors="replace")
        except OSError:
            text = ""
        faults += [Fault(bus_ids.index(bus), xid=xid) for bus, xid in kernel_log_xids(text)
                   if bus in bus_ids]
    return faults


# -- admin maintenance: reset and diag ----------------------------------------------------


@dataclass(frozen=True)
class DiagOutcome:
    passed: bool
    output: str


class Maintenance(Protocol):
    """Reset a GPU and run a diagnostic on it (``node gpu-reset`` / ``node diag``)."""

    def reset(self, index: int) -> DiagOutcome: ...
    def diag(self, index: int, level: int) -> DiagOutcome: ...


def _blocking(faults: Iterable[Fault], index: int) -> list[str]:
    """The faults of GPU ``index`` that keep it out of service."""
    return [f.describe() for f in faults if f.index == index
            and f.action not in (XidAction.APPLICATION, XidAction.INFO)]


@dataclass
class SimulatedMaintenance:
    """The simulated provider's reset and diag: a reset clears the GPU's faults written
    into the fault file (a transient fault, as a real reset clears a reset-class XID);
    faults given with ``--inject-fault`` stand for broken hardware and survive it; the
    diag passes when the GPU shows no fault that keeps it out."""

    faults: InjectedFaults

    def reset(self, index: int) -> DiagOutcome:
        path = self.faults.path
        if path is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and parse_injected(line).index != index]
            path.write_text("".join(f"{line}\n" for line in kept))
        return DiagOutcome(True, f"simulated reset of GPU {index}")

    def diag(self, index: int, level: int) -> DiagOutcome:
        bad = _blocking(self.faults.read(), index)
        if bad:
            return DiagOutcome(False, f"simulated diag level {level} failed: {'; '.join(bad)}")
        return DiagOutcome(True, f"simulated diag level {level} passed on GPU {index}")


Runner = Callable[[list[str]], tuple[int, str]]


def run_tool(argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """Run an NVIDIA tool: (exit status, stdout and stderr, the last 4000 characters)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 127, str(error)
    return done.returncode, (done.stdout + done.stderr)[-4000:]


@dataclass
class HostMaintenance:
    """Real GPUs: ``nvidia-smi --gpu-reset -i N`` (root, no process on the GPU), then
    DCGM's ``dcgmi diag -r LEVEL -i N -j`` where DCGM is installed (a JSON report whose
    tests must not fail); without DCGM the diag is the NVML checks alone, and says so."""

    nvml: object
    uuids: tuple[str, ...]
    run: Runner = run_tool
    which: Callable[[str], str | None] = shutil.which

    def reset(self, index: int) -> DiagOutcome:
        if self.which("nvidia-smi") is None:
            return DiagOutcome(False, "nvidia-smi is not installed: cannot reset the GPU")
        status, output = self.run(["nvidia-smi", "--gpu-reset", "-i", str(index)])
        return DiagOutcome(status == 0, output.strip() or f"nvidia-smi exited {status}")

    def diag(self, index: int, level: int) -> DiagOutcome:
        api: Any = self.nvml
        try:
            api.nvmlInit()
        except api.NVMLError as error:
            return DiagOutcome(False, f"NVML cannot start: {error}")
        try:
            bad = _blocking(_nvml_faults_of(api, index, self.uuids[index]), index)
        finally:
            api.nvmlShutdown()
        if bad:
            return DiagOutcome(False, f"NVML checks failed: {'; '.join(bad)}")
        if self.which("dcgmi") is None:
            return DiagOutcome(True, "NVML checks passed (dcgmi not installed: no active test)")
        status, output = self.run(["dcgmi", "diag", "-r", str(level), "-i", str(index), "-j"])
        return DiagOutcome(status == 0 and not dcgm_failed(output), output.strip())


def dcgm_failed(output: str) -> bool:
    """Whether a ``dcgmi diag -j`` report has a failed test (or is no report at all)."""
    try:
        report = json.loads(output)
    except ValueError:
        return True
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.lower() in ("status", "result") and isinstance(value, str):
                    found.append(value.lower())
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(report)
    return any(value in ("fail", "failed") for value in found)
