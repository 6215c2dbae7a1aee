"""MIG instances on a node: create them where the scheduler placed a pod, hand the
container its MIG device through CDI, destroy them when the pod ends, reconcile at start.

Two backends implement one small instance API: ``NvmlMig`` drives the driver through NVML
(``nvmlDeviceGetGpuInstancePossiblePlacements`` → ``nvmlDeviceCreateGpuInstanceWithPlacement``
→ ``nvmlGpuInstanceCreateComputeInstance``); ``SimulatedMig`` keeps the same state in a
JSON file (standing in for the GPU, so it survives an agent restart as hardware does) and
follows the scheduler's placement rules (``scheduler.mig``: start slots and sizes).

``MigManager`` owns the agent's side: which container holds which instance (a record is
written *before* an instance is created, so a crash in between leaves an orphan the next
start finds and destroys), and the CDI spec with one device per instance, named by MIG
UUID (index names shift as instances come and go), rewritten on every change. Instances
the agent did not make (a fixed layout an admin created) are never destroyed.
"""

from __future__ import annotations

import json
import threading
import uuid as uuid_module
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gpucloud.core.models import MigDevice, NodeRegisterRequest
from gpucloud.gpu.cdi import CdiError, CdiRegistry, ContainerEdits
from gpucloud.gpu.domain import GpuDevice, NodeHardware
from gpucloud.gpu.health import Runner, run_tool
from gpucloud.scheduler.mig import MIG_PROFILES, MIG_SLOTS, MigGeometry, geometry

MIG_SPEC_FILE = "gpucloud-mig.json"
NVIDIA_MIG_KIND = "gpucloud.io/mig"
SIMULATED_MIG_KIND = "gpucloud.sim/mig"
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


class MigError(CdiError):
    """A MIG instance that cannot be made, found or removed (a device the container
    cannot get, as a missing CDI device)."""


@dataclass(frozen=True)
class MigInstance:
    """One GPU instance with its compute instance: the MIG device a pod runs on."""

    gpu_index: int
    gpu_uuid: str
    profile: str
    slot: int
    size: int
    gi_id: int
    ci_id: int
    uuid: str


class MigBackend(Protocol):
    kind: str

    def instances(self) -> list[MigInstance]: ...
    def possible_starts(self, gpu: GpuDevice, profile: str) -> list[int]: ...
    def create(self, gpu: GpuDevice, profile: str, slot: int) -> MigInstance: ...
    def destroy(self, instance: MigInstance) -> None: ...
    def device_edits(self, instance: MigInstance) -> dict[str, Any]: ...
    def set_mode(self, gpu: GpuDevice, on: bool) -> str: ...


def _geometry(gpu: GpuDevice, profile: str) -> MigGeometry:
    geom = geometry(gpu.model, profile)
    if geom is None:
        raise MigError(f"GPU {gpu.index} ({gpu.model}) has no MIG profile {profile}")
    return geom


def _visible_env(uuid: str) -> list[str]:
    return [f"NVIDIA_VISIBLE_DEVICES={uuid}", f"CUDA_VISIBLE_DEVICES={uuid}",
            f"GPUCLOUD_MIG_DEVICE={uuid}"]


# -- the simulated provider ---------------------------------------------------------------


class SimulatedMig:
    """MIG on simulated GPUs, faithful to the placement rules: an instance of a profile
    may start only at that profile's start slots, on memory slices no other instance
    holds, on a GPU whose MIG mode is on. The state file is the "hardware"."""

    kind = SIMULATED_MIG_KIND

    def __init__(self, hardware: NodeHardware, state_file: Path) -> None:
        self.hardware = hardware
        self.path = state_file
        self.calls: list[str] = []

    def _load(self) -> list[MigInstance]:
        try:
            return [MigInstance(**item) for item in json.loads(self.path.read_text())]
        except FileNotFoundError:
            return []

    def _save(self, instances: list[MigInstance]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps([asdict(i) for i in instances], indent=1))
        temporary.replace(self.path)

    def instances(self) -> list[MigInstance]:
        return self._load()

    def _used(self, gpu_index: int) -> int:
        used = 0
        for item in self._load():
            if item.gpu_index == gpu_index:
                used |= ((1 << item.size) - 1) << item.slot
        return used

    def possible_starts(self, gpu: GpuDevice, profile: str) -> list[int]:
        self.calls.append(f"possible_starts {gpu.index} {profile}")
        if not gpu.mig_mode:
            raise MigError(f"MIG mode is off on GPU {gpu.index} (enable it at drain time)")
        geom, used = _geometry(gpu, profile), self._used(gpu.index)
        return [start for start in geom.starts if used & geom.mask(start) == 0]

    def create(self, gpu: GpuDevice, profile: str, slot: int) -> MigInstance:
        self.calls.append(f"create {gpu.index} {profile} {slot}")
        if slot not in self.possible_starts(gpu, profile):
            raise MigError(f"no {profile} instance can start at slot {slot} of GPU {gpu.index}")
        existing = self._load()
        gi_id = 1 + max((i.gi_id for i in existing if i.gpu_index == gpu.index), default=0)
        mig_uuid = f"MIG-{uuid_module.uuid4()}"
        made = MigInstance(gpu.index, gpu.uuid, profile, slot, _geometry(gpu, profile).size,
                           gi_id, 0, mig_uuid)
        self._save([*existing, made])
        return made

    def destroy(self, instance: MigInstance) -> None:
        self.calls.append(f"destroy {instance.uuid}")
        self._save([i for i in self._load() if i.uuid != instance.uuid])

    @property
    def modes_path(self) -> Path:
        """The GPUs' MIG modes an admin switched (``node mig-mode``), by GPU index."""
        return self.path.with_name("simulated-modes.json")

    def modes(self) -> dict[int, bool]:
        try:
            return {int(k): bool(v) for k, v in json.loads(self.modes_path.read_text()).items()}
        except FileNotFoundError:
            return {}

    def set_mode(self, gpu: GpuDevice, on: bool) -> str:
        """Flip the simulated GPU's MIG mode (it keeps it across agent restarts, as the
        hardware does); refused while it has MIG instances, as the driver refuses."""
        self.calls.append(f"set_mode {gpu.index} {'on' if on else 'off'}")
        if any(i.gpu_index == gpu.index for i in self._load()):
            raise MigError(f"GPU {gpu.index} still has MIG instances; destroy them first")
        modes = self.modes()
        modes[gpu.index] = on
        self.modes_path.parent.mkdir(parents=True, exist_ok=True)
        self.modes_path.write_text(json.dumps({str(k): v for k, v in modes.items()}))
        return f"simulated MIG mode {'on' if on else 'off'} on GPU {gpu.index}"

    def device_edits(self, instance: MigInstance) -> dict[str, Any]:
        return {"env": [*_visible_env(instance.uuid),
                        f"GPUCLOUD_SIM_MIG={instance.profile}@{instance.slot}"]}


# -- NVML ---------------------------------------------------------------------------------


def _gi_profile(nvml: Any, geom: MigGeometry) -> int:
    """NVML's GPU instance profile constant for a shape (the double-memory 1g is REV2)."""
    if geom.compute == 1 and geom.size == 2:
        return int(nvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    return int(getattr(nvml, f"NVML_GPU_INSTANCE_PROFILE_{geom.compute}_SLICE"))


def _ci_profile(nvml: Any, geom: MigGeometry) -> int:
    return int(getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{geom.compute}_SLICE"))


def read_mig_minors(path: Path = MIG_MINORS) -> dict[str, int]:
    """``gpu0/gi1/access`` → minor of its ``/dev/nvidia-caps/nvidia-capN`` node."""
    minors: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, minor = line.strip().rpartition(" ")
        if name and minor.isdigit():
            minors[name] = int(minor)
    return minors


class NvmlMig:
    """MIG through NVML on real GPUs (root, MIG mode enabled by an admin beforehand)."""

    kind = NVIDIA_MIG_KIND

    def __init__(self, nvml: Any, hardware: NodeHardware, *, minors: Path = MIG_MINORS,
                 dev: Path = Path("/dev"), run: Runner = run_tool) -> None:
        self.nvml = nvml
        self.hardware = hardware
        self.run = run  # nvidia-smi, for the reset a MIG mode switch may need
        self.minors_path = minors
        self.dev = dev
        nvml.nvmlInit()

    def _handle(self, index: int) -> Any:
        return self.nvml.nvmlDeviceGetHandleByIndex(index)

    def _profile_id(self, handle: Any, geom: MigGeometry) -> int:
        info = self.nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, _gi_profile(self.nvml, geom))
        return int(info.id)

    def possible_starts(self, gpu: GpuDevice, profile: str) -> list[int]:
        handle = self._handle(gpu.index)
        placements = self._placements(handle, _geometry(gpu, profile))
        return [int(p.start) for p in placements]

    def _placements(self, handle: Any, geom: MigGeometry) -> list[Any]:
        profile_id = self._profile_id(handle, geom)
        return list(self.nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id))

    def create(self, gpu: GpuDevice, profile: str, slot: int) -> MigInstance:
        nvml, geom = self.nvml, _geometry(gpu, profile)
        handle = self._handle(gpu.index)
        placement = next((p for p in self._placements(handle, geom) if int(p.start) == slot),
                         None)
        if placement is None:
            raise MigError(f"NVML offers no {profile} placement at slot {slot} of GPU "
                           f"{gpu.index}")
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, self._profile_id(handle, geom), placement)
        try:
            ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, _ci_profile(nvml, geom), nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            mig_uuid = self._mig_uuid(handle, gi_id, ci_id)
        except nvml.NVMLError as error:
            nvml.nvmlGpuInstanceDestroy(gi)  # nothing half-made stays behind
            raise MigError(f"creating the {profile} compute instance on GPU {gpu.index}: "
                           f"{error}") from None
        return MigInstance(gpu.index, gpu.uuid, profile, slot, geom.size, gi_id, ci_id,
                           mig_uuid)

    def _mig_uuid(self, handle: Any, gi_id: int, ci_id: int) -> str:
        nvml = self.nvml
        for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except nvml.NVMLError:
                continue
            if (int(nvml.nvmlDeviceGetGpuInstanceId(device)) == gi_id
                    and int(nvml.nvmlDeviceGetComputeInstanceId(device)) == ci_id):
                value = nvml.nvmlDeviceGetUUID(device)
                return value.decode() if isinstance(value, bytes) else str(value)
        raise MigError(f"NVML lists no MIG device for GPU instance {gi_id}")

    def instances(self) -> list[MigInstance]:
        found: list[MigInstance] = []
        for gpu in self.hardware.gpus:
            if gpu.mig_mode:
                found.extend(self._gpu_instances(gpu))
        return found

    def _gpu_instances(self, gpu: GpuDevice) -> Iterable[MigInstance]:
        nvml, handle = self.nvml, self._handle(gpu.index)
        for profile, geom in MIG_PROFILES.get(gpu.model, {}).items():
            try:
                gis = nvml.nvmlDeviceGetGpuInstances(handle, self._profile_id(handle, geom))
            except nvml.NVMLError:
                continue
            for gi in gis:
                info = nvml.nvmlGpuInstanceGetInfo(gi)
                ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, _ci_profile(nvml, geom), nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                for ci in nvml.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id):
                    ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
                    yield MigInstance(gpu.index, gpu.uuid, profile, int(info.placement.start),
                                      geom.size, int(info.id), ci_id,
                                      self._mig_uuid(handle, int(info.id), ci_id))

    def destroy(self, instance: MigInstance) -> None:
        nvml = self.nvml
        gi = nvml.nvmlDeviceGetGpuInstanceById(self._handle(instance.gpu_index), instance.gi_id)
        ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, instance.ci_id)
        nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(gi)

    def device_edits(self, instance: MigInstance) -> dict[str, Any]:
        """The parent ``/dev/nvidiaN`` and the instance's two ``nvidia-caps`` nodes."""
        minor = int(self.nvml.nvmlDeviceGetMinorNumber(self._handle(instance.gpu_index)))
        minors = read_mig_minors(self.minors_path)
        gi_key = f"gpu{minor}/gi{instance.gi_id}/access"
        ci_key = f"gpu{minor}/gi{instance.gi_id}/ci{instance.ci_id}/access"
        missing = [key for key in (gi_key, ci_key) if key not in minors]
        if missing:
            raise MigError(f"{self.minors_path} has no {', '.join(missing)}")
        caps = self.dev / "nvidia-caps"
        nodes = [{"path": str(self.dev / f"nvidia{minor}")},
                 {"path": str(caps / f"nvidia-cap{minors[gi_key]}")},
                 {"path": str(caps / f"nvidia-cap{minors[ci_key]}")}]
        return {"env": _visible_env(instance.uuid), "deviceNodes": nodes}

    def set_mode(self, gpu: GpuDevice, on: bool) -> str:
        """``nvmlDeviceSetMigMode``; where the driver leaves the change pending (the GPU
        needs a reset to apply it), ``nvidia-smi --gpu-reset`` applies it. The mode NVML
        reads back afterwards must be the one asked for."""
        nvml, handle = self.nvml, self._handle(gpu.index)
        wanted = nvml.NVML_DEVICE_MIG_ENABLE if on else nvml.NVML_DEVICE_MIG_DISABLE
        try:
            nvml.nvmlDeviceSetMigMode(handle, wanted)
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as error:
            raise MigError(f"setting MIG mode on GPU {gpu.index}: {error}") from None
        notes = [f"nvmlDeviceSetMigMode({'enable' if on else 'disable'})"]
        if int(current) != int(wanted) and int(pending) == int(wanted):
            status, output = self.run(["nvidia-smi", "--gpu-reset", "-i", str(gpu.index)])
            notes.append(f"reset to apply it: {output.strip() or status}")
            current, _ = nvml.nvmlDeviceGetMigMode(self._handle(gpu.index))
        if int(current) != int(wanted):
            raise MigError(f"GPU {gpu.index} MIG mode is still {int(current)} after "
                           f"{'; '.join(notes)}")
        return "; ".join(notes)


# -- the agent's side ---------------------------------------------------------------------


class MigManager:
    """Which container holds which instance, and the CDI spec of the instances."""

    def __init__(self, backend: MigBackend, hardware: NodeHardware, state_dir: Path,
                 cdi_dir: Path) -> None:
        self.backend = backend
        self.hardware = hardware
        self.records_path = state_dir / "mig" / "owners.json"
        self.cdi_dir = cdi_dir
        self.lock = threading.Lock()

    # records: container id -> {"gpu_index", "slot", "profile", "uuid" (None: creating)}
    def _records(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.records_path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self, records: dict[str, dict[str, Any]]) -> None:
        self.records_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.records_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(records, indent=1, sort_keys=True))
        temporary.replace(self.records_path)

    def _gpu(self, uuid: str) -> GpuDevice:
        gpu = self.hardware.gpu_by_uuid(uuid)
        if gpu is None:
            raise MigError(f"GPU {uuid} is not on this node")
        return gpu

    def acquire(self, cid: str, gpu_uuid: str, profile: str, slot: int,
                policy: str = "dynamic") -> MigInstance:
        """The instance for container ``cid`` at the scheduler's slot: its own (adopted),
        else a new one (dynamic), else the free existing one there (fixed)."""
        if not 0 <= slot < MIG_SLOTS:
            raise MigError(f"MIG slot {slot} is outside 0..{MIG_SLOTS - 1}")
        gpu = self._gpu(gpu_uuid)
        with self.lock:
            records = self._records()
            own = self._own(records.get(cid))
            if own is not None:
                return own
            if policy == "fixed":
                made = self._take_fixed(records, gpu, profile, slot)
            else:
                if slot not in self.backend.possible_starts(gpu, profile):
                    raise MigError(f"the node cannot place {profile} at slot {slot} of GPU "
                                   f"{gpu.index} (possible: "
                                   f"{self.backend.possible_starts(gpu, profile)})")
                records[cid] = {"gpu_index": gpu.index, "slot": slot, "profile": profile,
                                "uuid": None, "created": True}
                self._save(records)
                made = self.backend.create(gpu, profile, slot)
            records[cid] = {"gpu_index": gpu.index, "slot": slot, "profile": profile,
                            "uuid": made.uuid, "created": policy != "fixed"}
            self._save(records)
            self.write_spec()
            return made

    def _own(self, record: dict[str, Any] | None) -> MigInstance | None:
        if not record or not record.get("uuid"):
            return None
        return next((i for i in self.backend.instances() if i.uuid == record["uuid"]), None)

    def _take_fixed(self, records: dict[str, dict[str, Any]], gpu: GpuDevice, profile: str,
                    slot: int) -> MigInstance:
        taken = {r.get("uuid") for r in records.values()}
        found = next((i for i in self.backend.instances()
                      if i.gpu_index == gpu.index and i.slot == slot and i.profile == profile
                      and i.uuid not in taken), None)
        if found is None:
            raise MigError(f"fixed MIG layout: no free {profile} instance at slot {slot} of "
                           f"GPU {gpu.index}")
        return found

    def release(self, cid: str) -> None:
        """The container ended: destroy the instance the agent made for it."""
        with self.lock:
            records = self._records()
            record = records.pop(cid, None)
            if record is None:
                return
            if record.get("created"):
                for instance in self._matching(record):
                    self.backend.destroy(instance)
            self._save(records)
            self.write_spec()

    def _matching(self, record: dict[str, Any]) -> list[MigInstance]:
        """The instance a record names (by UUID; a record left mid-creation by its slot)."""
        if record.get("uuid"):
            return [i for i in self.backend.instances() if i.uuid == record["uuid"]]
        return [i for i in self.backend.instances()
                if i.gpu_index == record["gpu_index"] and i.slot == record["slot"]]

    def reconcile(self, keep: set[str]) -> list[str]:
        """At start: keep the instances of the containers in ``keep`` (adopted), destroy
        the ones the agent made for any other (orphans); returns the destroyed UUIDs."""
        destroyed: list[str] = []
        with self.lock:
            records = self._records()
            for cid in [c for c in records if c not in keep]:
                record = records.pop(cid)
                if record.get("created"):
                    for instance in self._matching(record):
                        self.backend.destroy(instance)
                        destroyed.append(instance.uuid)
            self._save(records)
            self.write_spec()
        return destroyed

    def spec(self) -> dict[str, Any]:
        devices = [{"name": i.uuid, "containerEdits": self.backend.device_edits(i)}
                   for i in self.backend.instances()]
        return {"cdiVersion": "0.6.0", "kind": self.backend.kind, "devices": devices}

    def write_spec(self) -> Path:
        """Rewrite the CDI spec of the node's MIG devices (atomically)."""
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        path = self.cdi_dir / MIG_SPEC_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.spec(), indent=2) + "\n")
        temporary.replace(path)
        return path

    def edits(self, instance: MigInstance) -> list[ContainerEdits]:
        """The CDI edits of one MIG device, read back from the spec on disk."""
        registry = CdiRegistry.load([self.cdi_dir])
        return registry.resolve([f"{self.backend.kind}={instance.uuid}"])

    def inventory(self) -> dict[str, list[dict[str, Any]]]:
        """The MIG devices per GPU UUID, as ``GpuInventory.mig_instances``."""
        out: dict[str, list[dict[str, Any]]] = {}
        for i in self.backend.instances():
            out.setdefault(i.gpu_uuid, []).append(
                {"gpu_uuid": i.gpu_uuid, "mig_uuid": i.uuid, "profile": i.profile,
                 "slot": i.slot})
        return out


    def set_mig_mode(self, index: int, on: bool) -> str:
        """Switch GPU ``index``'s MIG mode (``node mig-mode``; the server only asks once no
        pod holds the GPU) and follow it in the node's view of its hardware, so instances
        can be made there (on) or are no longer expected (off). Returns what was done."""
        with self.lock:
            gpu = next((g for g in self.hardware.gpus if g.index == index), None)
            if gpu is None:
                raise MigError(f"GPU {index} is not on this node")
            if not gpu.mig_capable:
                raise MigError(f"GPU {index} ({gpu.model}) does not support MIG")
            if any(r.get("gpu_index") == index for r in self._records().values()):
                raise MigError(f"containers still hold MIG instances of GPU {index}")
            output = self.backend.set_mode(gpu, on)
            self._follow_modes({index: on})
            self.write_spec()
            return output

    def _follow_modes(self, modes: dict[int, bool]) -> None:
        gpus = tuple(g.model_copy(update={"mig_mode": modes[g.index]})
                     if g.index in modes and g.mig_capable else g for g in self.hardware.gpus)
        self.hardware = self.hardware.model_copy(update={"gpus": gpus})
        if hasattr(self.backend, "hardware"):
            self.backend.hardware = self.hardware


def mig_manager(hardware: NodeHardware, state_dir: Path, nvml: Any | None = None,
                cdi_dir: Path = Path("/var/run/cdi")) -> MigManager | None:
    """The node's MIG manager: simulated GPUs keep their state under ``state_dir``; real
    MIG-capable GPUs go through NVML; None without MIG-capable GPUs."""
    if not any(gpu.mig_capable for gpu in hardware.gpus):
        return None
    if hardware.provider == "simulated":
        simulated = SimulatedMig(hardware, state_dir / "mig" / "simulated-gpus.json")
        manager = MigManager(simulated, hardware, state_dir, state_dir / "cdi")
        manager._follow_modes(simulated.modes())  # the modes an admin switched before
        return manager
    if hardware.provider == "nvml" and nvml is not None:
        return MigManager(NvmlMig(nvml, hardware), hardware, state_dir, cdi_dir)
    return None



def with_mig_layout(body: NodeRegisterRequest, manager: MigManager) -> None:
    """Put the node's MIG devices into a registration body's GPU inventory (what a
    fixed-mode node advertises)."""
    layout = manager.inventory()
    for gpu in body.gpus:
        device = manager.hardware.gpu_by_uuid(gpu.uuid)
        if device is not None:
            gpu.mig_mode = device.mig_mode  # as switched by ``node mig-mode``
        gpu.mig_instances = [MigDevice.model_validate(item) for item in layout.get(gpu.uuid, [])]
