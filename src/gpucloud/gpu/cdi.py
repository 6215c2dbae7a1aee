"""Container Device Interface (CDI): read specs, resolve devices, edit an OCI config.

Specs follow the CDI specification (v0.5 and later) as written by the NVIDIA Container
Toolkit (``nvidia-ctk cdi generate`` → ``/etc/cdi/nvidia.yaml``, kind ``nvidia.com/gpu``,
devices named by index and UUID). Directories later in the search list take precedence, as
in the reference implementation (``/var/run/cdi`` over ``/etc/cdi``). For simulated GPUs the
agent writes its own spec (kind ``gpucloud.sim/gpu``) that only sets environment variables.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpucloud.core.errors import GpucloudError
from gpucloud.gpu.domain import GpuDevice, NodeHardware

DEFAULT_SPEC_DIRS: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
NVIDIA_KIND = "nvidia.com/gpu"
SIMULATED_KIND = "gpucloud.sim/gpu"
SIMULATED_SPEC_FILE = "gpucloud-sim.json"
MIN_CDI_VERSION = (0, 5, 0)
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
_KIND = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]/[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


class CdiError(GpucloudError):
    """A CDI spec that cannot be read or applied, or a device no spec provides."""


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class DeviceNode(_Model):
    path: str
    host_path: str | None = Field(default=None, alias="hostPath")
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = Field(default=None, alias="fileMode")
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None


class Mount(_Model):
    host_path: str = Field(alias="hostPath")
    container_path: str = Field(alias="containerPath")
    options: tuple[str, ...] = ()
    type: str | None = None


class Hook(_Model):
    hook_name: str = Field(alias="hookName")
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


class ContainerEdits(_Model):
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = Field(default=(), alias="deviceNodes")
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = Field(default=(), alias="additionalGids")


class CdiDevice(_Model):
    name: str
    container_edits: ContainerEdits = Field(default_factory=ContainerEdits, alias="containerEdits")

    @field_validator("name", mode="before")
    @classmethod
    def _name_as_text(cls, value: object) -> object:
        """YAML reads an unquoted ``name: 0`` as a number; CDI names are strings."""
        return str(value) if isinstance(value, int) else value


class CdiSpec(_Model):
    cdi_version: str = Field(alias="cdiVersion")
    kind: str
    devices: tuple[CdiDevice, ...] = ()
    container_edits: ContainerEdits = Field(default_factory=ContainerEdits, alias="containerEdits")

    def device(self, name: str) -> CdiDevice | None:
        return next((device for device in self.devices if device.name == name), None)


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.strip().lstrip("v").split("."))
    except ValueError:
        return ()


def parse_spec(text: str, source: str) -> CdiSpec:
    """A spec from YAML or JSON text (JSON is YAML); CdiError says what is wrong."""
    try:
        spec = CdiSpec.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError) as error:
        raise CdiError(f"{source}: not a valid CDI spec: {error}") from None
    if _version(spec.cdi_version) < MIN_CDI_VERSION:
        raise CdiError(f"{source}: CDI version {spec.cdi_version} is older than 0.5.0")
    if not _KIND.match(spec.kind):
        raise CdiError(f"{source}: kind {spec.kind!r} is not vendor/class")
    bad_hooks = {hook.hook_name for hook in _all_hooks(spec)} - HOOK_NAMES
    if bad_hooks:
        raise CdiError(f"{source}: unknown hook name(s) {sorted(bad_hooks)}")
    return spec


def _all_hooks(spec: CdiSpec) -> Iterable[Hook]:
    yield from spec.container_edits.hooks
    for device in spec.devices:
        yield from device.container_edits.hooks


def _spec_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


class CdiRegistry:
    """The CDI specs found in a list of directories, by kind.

    A spec in a later directory replaces a device of the same kind and name from an earlier
    one. Unreadable specs are kept as ``errors`` (one line each) instead of failing the
    whole registry, as a broken vendor file should not stop unrelated devices.
    """

    def __init__(self, specs: Sequence[CdiSpec] = (), errors: Sequence[str] = ()) -> None:
        self.specs = tuple(specs)
        self.errors = tuple(errors)

    @classmethod
    def load(cls, directories: Sequence[Path] = DEFAULT_SPEC_DIRS) -> CdiRegistry:
        specs, errors = [], []
        for directory in directories:
            for path in _spec_files(directory):
                try:
                    specs.append(parse_spec(path.read_text(), str(path)))
                except (CdiError, OSError) as error:
                    errors.append(str(error))
        return cls(specs, errors)

    def lookup(self, qualified_name: str) -> tuple[CdiSpec, CdiDevice] | None:
        """The spec and device for ``vendor/class=name``; the last spec that has it wins."""
        kind, sep, name = qualified_name.partition("=")
        if not sep:
            raise CdiError(f"{qualified_name!r} is not a qualified CDI device name (kind=name)")
        for spec in reversed(self.specs):
            device = spec.device(name) if spec.kind == kind else None
            if device is not None:
                return spec, device
        return None

    def resolve(self, qualified_names: Sequence[str]) -> list[ContainerEdits]:
        """The edits to apply for these devices: each spec's common edits once, then each
        device's own edits."""
        edits: list[ContainerEdits] = []
        seen_specs: list[CdiSpec] = []
        for qualified in qualified_names:
            found = self.lookup(qualified)
            if found is None:
                raise CdiError(self._missing(qualified))
            spec, device = found
            if not any(spec is seen for seen in seen_specs):
                seen_specs.append(spec)
                edits.append(spec.container_edits)
            edits.append(device.container_edits)
        return edits

    def _missing(self, qualified: str) -> str:
        hint = ""
        if qualified.startswith(NVIDIA_KIND + "="):
            hint = " (generate one with: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml)"
        problems = f"; unreadable specs: {'; '.join(self.errors)}" if self.errors else ""
        return f"no CDI spec provides device {qualified}{hint}{problems}"

    def edits_for_gpus(self, gpus: Sequence[GpuDevice]) -> list[ContainerEdits]:
        """The edits that inject these GPUs, by UUID (falling back to the NVML index)."""
        return self.resolve([self._name_for(gpu) for gpu in gpus])

    def _name_for(self, gpu: GpuDevice) -> str:
        kind = SIMULATED_KIND if gpu.simulated else NVIDIA_KIND
        by_uuid = f"{kind}={gpu.uuid}"
        if gpu.simulated or self.lookup(by_uuid) is not None:
            return by_uuid
        return f"{kind}={gpu.index}"


# -- applying edits to an OCI runtime config (a config.json dict) ---------------------------


def _set_env(env: list[str], assignment: str) -> None:
    key = assignment.split("=", 1)[0]
    env[:] = [item for item in env if item.split("=", 1)[0] != key]
    env.append(assignment)


def _device_facts(node: DeviceNode) -> tuple[str, int, int, int]:
    """(type, major, minor, mode) of a device node, completed from the host's file."""
    if node.type and node.major is not None and node.minor is not None:
        return node.type, node.major, node.minor, node.file_mode or 0o666
    host_path = node.host_path or node.path
    try:
        info = os.stat(host_path)
    except OSError as error:
        raise CdiError(f"CDI device node {host_path}: {error.strerror}") from None
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        raise CdiError(f"CDI device node {host_path} is not a device")
    mode = node.file_mode if node.file_mode is not None else stat.S_IMODE(info.st_mode)
    return kind, os.major(info.st_rdev), os.minor(info.st_rdev), mode


def _add_device_node(config: dict[str, Any], node: DeviceNode) -> None:
    kind, major, minor, mode = _device_facts(node)
    linux = config.setdefault("linux", {})
    device: dict[str, Any] = {"path": node.path, "type": kind, "major": major, "minor": minor,
                              "fileMode": mode}
    if node.uid is not None:
        device["uid"] = node.uid
    if node.gid is not None:
        device["gid"] = node.gid
    devices = [d for d in linux.setdefault("devices", []) if d.get("path") != node.path]
    linux["devices"] = [*devices, device]
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    rules.append({"allow": True, "type": kind, "major": major, "minor": minor,
                  "access": node.permissions or "rwm"})


def _add_mount(config: dict[str, Any], mount: Mount) -> None:
    options = list(mount.options)
    kind = mount.type or "bind"
    if kind == "bind" and not {"bind", "rbind"} & set(options):
        options.append("rbind")
    config.setdefault("mounts", []).append(
        {"destination": mount.container_path, "type": kind, "source": mount.host_path,
         "options": options}
    )


def _add_hook(config: dict[str, Any], hook: Hook) -> None:
    entry: dict[str, Any] = {"path": hook.path}
    if hook.args:
        entry["args"] = list(hook.args)
    if hook.env:
        entry["env"] = list(hook.env)
    if hook.timeout is not None:
        entry["timeout"] = hook.timeout
    config.setdefault("hooks", {}).setdefault(hook.hook_name, []).append(entry)


def apply_edits(config: dict[str, Any], edits: Sequence[ContainerEdits]) -> None:
    """Apply CDI container edits to an OCI runtime config in place."""
    process = config.setdefault("process", {})
    env = process.setdefault("env", [])
    for edit in edits:
        for assignment in edit.env:
            _set_env(env, assignment)
        for node in edit.device_nodes:
            _add_device_node(config, node)
        for mount in edit.mounts:
            _add_mount(config, mount)
        for hook in edit.hooks:
            _add_hook(config, hook)
        if edit.additional_gids:
            user = process.setdefault("user", {"uid": 0, "gid": 0})
            gids = user.setdefault("additionalGids", [])
            gids.extend(gid for gid in edit.additional_gids if gid not in gids)


# -- the spec for simulated GPUs ------------------------------------------------------------


def simulated_spec(hardware: NodeHardware) -> dict[str, Any]:
    """A CDI spec with one device per simulated GPU (named by UUID and by index).

    It mounts nothing and creates no device nodes (the GPUs do not exist); it marks each
    injected device in the environment so a container can tell which edits it received.
    """
    devices = []
    for gpu in hardware.gpus:
        edits = {"env": [f"GPUCLOUD_SIM_GPU_{gpu.index}={gpu.uuid}"]}
        devices.append({"name": gpu.uuid, "containerEdits": edits})
        devices.append({"name": str(gpu.index), "containerEdits": edits})
    return {
        "cdiVersion": "0.6.0",
        "kind": SIMULATED_KIND,
        "containerEdits": {"env": [f"GPUCLOUD_SIMULATED_GPUS={hardware.profile or 'custom'}"]},
        "devices": devices,
    }


def write_simulated_spec(directory: Path, hardware: NodeHardware) -> Path:
    """Write the simulated GPUs' spec into ``directory`` (atomically) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SIMULATED_SPEC_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(simulated_spec(hardware), indent=2) + "\n")
    temporary.replace(path)
    return path
