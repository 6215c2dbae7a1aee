"""Build an OCI runtime bundle (``config.json`` + per-pod files) for one pod attempt.

The rootfs is prepared elsewhere (images/); the config points at it. Resolution follows
Docker: argv is the image's Entrypoint followed by the pod's command, or by the image's Cmd
when the pod gives none; the environment is the image's, then the pod's, then the CDI
edits', then the GPU variables, each overriding the one before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpucloud.gpu.cdi import ContainerEdits, apply_edits
from gpucloud.gpu.domain import GpuDevice
from gpucloud.runtime import oci
from gpucloud.runtime.errors import BundleError, CommandNotFound
from gpucloud.runtime.layout import ContainerPaths
from gpucloud.runtime.rootfs import DEFAULT_PATH, User, find_executable, resolve_user

GPUS_JSON_DIR = "/run/gpucloud"
DEFAULT_SHM_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config (``config`` object) a container needs."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ImageConfig:
        """From an image config's ``config`` object, or a whole image config holding one."""
        data = dict(data or {})
        if isinstance(data.get("config"), dict):
            data = data["config"]
        return cls(
            entrypoint=tuple(data.get("Entrypoint") or ()),
            cmd=tuple(data.get("Cmd") or ()),
            env=tuple(data.get("Env") or ()),
            working_dir=data.get("WorkingDir") or "",
            user=data.get("User") or "",
        )


@dataclass(frozen=True)
class ContainerSpec:
    """What the pod asks for. ``command`` replaces the image's Cmd; ``entrypoint``, when
    given, replaces its Entrypoint (``()``: none, the command alone runs), as
    ``docker run --entrypoint`` does — and, as there, then drops the image's Cmd too.

    ``host_network`` shares the host's network namespace; otherwise the container joins
    ``netns`` (a namespace the agent made: veth, address ``ip``, see runtime/network), or,
    without one, gets a namespace of its own with only loopback.
    """

    container_id: str
    hostname: str
    command: Sequence[str] | None = None
    entrypoint: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    cpu_milli: int = 0
    memory_bytes: int = 0
    gpus: Sequence[GpuDevice] = ()
    host_network: bool = False
    pids_limit: int | None = None
    node_name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Host directories bound into the container (volume disk, network volumes).
    binds: Sequence[BindMount] = ()
    #: The network namespace to join (a path) and the pod's address in it.
    netns: str | None = None
    ip: str | None = None
    #: cgroup v2 files for ``linux.resources.unified`` (``dmem.max`` of a GPU share).
    unified: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BindMount:
    """A host directory at ``destination`` in the container (runc creates the mount point)."""

    source: Path
    destination: str
    readonly: bool = False


@dataclass(frozen=True)
class Bundle:
    paths: ContainerPaths
    argv: tuple[str, ...]
    env: tuple[str, ...]
    config: dict[str, Any]


def _argv(image: ImageConfig, spec: ContainerSpec) -> tuple[str, ...]:
    if spec.entrypoint is not None:
        argv = tuple(spec.entrypoint) + tuple(spec.command or ())
    else:
        argv = image.entrypoint + (tuple(spec.command) if spec.command is not None
                                   else image.cmd)
    if not argv:
        raise BundleError("no command: the image has no Entrypoint or Cmd and the pod gives none")
    return argv


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key:
            pairs[key] = value
    return pairs


def gpu_env(gpus: Sequence[GpuDevice]) -> dict[str, str]:
    """The variables that tell CUDA and the NVIDIA stack which GPUs are the container's."""
    uuids = ",".join(gpu.uuid for gpu in gpus)
    return {"NVIDIA_VISIBLE_DEVICES": uuids or "void", "CUDA_VISIBLE_DEVICES": uuids}


def _base_env(image: ImageConfig, spec: ContainerSpec, user: User) -> dict[str, str]:
    env = _env_pairs(image.env)
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(spec.env)
    env.setdefault("HOME", user.home)
    env.setdefault("HOSTNAME", spec.hostname)
    return env


def gpus_document(spec: ContainerSpec) -> dict[str, Any]:
    """The content of /run/gpucloud/gpus.json: the container's GPUs in container order.

    ``nvlink_peers`` lists the UUIDs of the container's other GPUs reachable over NVLink.
    """
    assigned = {gpu.index: gpu.uuid for gpu in spec.gpus}
    gpus = [
        {
            "index": position, "uuid": gpu.uuid, "model": gpu.model,
            "memory_mib": gpu.memory_mib, "host_index": gpu.index, "numa_node": gpu.numa_node,
            "pci_bus_id": gpu.pci_bus_id, "mig_mode": gpu.mig_mode, "simulated": gpu.simulated,
            "nvlink_peers": [assigned[peer] for peer in gpu.nvlink_peers if peer in assigned],
        }
        for position, gpu in enumerate(spec.gpus)
    ]
    return {
        "node": spec.node_name,
        "container_id": spec.container_id,
        "visible_devices": ",".join(gpu.uuid for gpu in spec.gpus),
        "count": len(gpus),
        "gpus": gpus,
    }


def _write_etc(paths: ContainerPaths, spec: ContainerSpec, resolv_conf: Path) -> None:
    paths.etc_dir.mkdir(parents=True, exist_ok=True)
    (paths.etc_dir / "hostname").write_text(spec.hostname + "\n")
    (paths.etc_dir / "hosts").write_text(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"{spec.ip or '127.0.1.1'}\t{spec.hostname}\n"
    )
    try:
        resolv = resolv_conf.read_text()
    except OSError:
        resolv = ""
    (paths.etc_dir / "resolv.conf").write_text(resolv)


def _mounts(paths: ContainerPaths, spec: ContainerSpec) -> list[dict[str, Any]]:
    shm = spec.memory_bytes if spec.memory_bytes > 0 else DEFAULT_SHM_BYTES
    return [
        *oci.standard_mounts(shm),
        oci.bind_mount(paths.etc_dir / "hosts", "/etc/hosts", readonly=False),
        oci.bind_mount(paths.etc_dir / "hostname", "/etc/hostname", readonly=False),
        oci.bind_mount(paths.etc_dir / "resolv.conf", "/etc/resolv.conf", readonly=False),
        oci.bind_mount(paths.run_dir, GPUS_JSON_DIR, readonly=True),
        *(oci.bind_mount(b.source, b.destination, readonly=b.readonly) for b in spec.binds),
    ]


def _namespaces(spec: ContainerSpec) -> list[dict[str, str]]:
    namespaces = [{"type": kind} for kind in ("pid", "ipc", "uts", "mount")]
    if not spec.host_network:
        namespaces.append({"type": "network", **({"path": spec.netns} if spec.netns else {})})
    return namespaces


def _resources(spec: ContainerSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if cpu := oci.cpu_resources(spec.cpu_milli):
        resources["cpu"] = cpu
    if memory := oci.memory_resources(spec.memory_bytes):
        resources["memory"] = memory
    if spec.pids_limit:
        resources["pids"] = {"limit": spec.pids_limit}
    if spec.unified:
        resources["unified"] = dict(spec.unified)
    return resources


def _process(argv: Sequence[str], env: Mapping[str, str], cwd: str, user: User) -> dict[str, Any]:
    process_user: dict[str, Any] = {"uid": user.uid, "gid": user.gid}
    if user.additional_gids:
        process_user["additionalGids"] = list(user.additional_gids)
    return {
        "terminal": False,
        "user": process_user,
        "args": list(argv),
        "env": [f"{key}={value}" for key, value in env.items()],
        "cwd": cwd,
        "capabilities": oci.capabilities(),
        "rlimits": oci.rlimits(),
        "noNewPrivileges": True,
    }


def _config(
    rootfs: Path, process: dict[str, Any], paths: ContainerPaths, spec: ContainerSpec,
    cgroup_path: str,
) -> dict[str, Any]:
    return {
        "ociVersion": oci.OCI_VERSION,
        "process": process,
        "root": {"path": str(rootfs.resolve()), "readonly": False},
        "hostname": spec.hostname,
        "mounts": _mounts(paths, spec),
        "annotations": {f"gpucloud.{key}": value for key, value in spec.labels.items()},
        "linux": {
            "namespaces": _namespaces(spec),
            "cgroupsPath": cgroup_path,
            "resources": _resources(spec),
            "maskedPaths": list(oci.MASKED_PATHS),
            "readonlyPaths": list(oci.READONLY_PATHS),
            # The process's one decoded copy: ``config_text`` writes its cached text.
            "seccomp": oci.shared_seccomp_profile(),
        },
    }


def config_text(config: Mapping[str, Any]) -> str:
    """``config`` as ``config.json``'s JSON, its ``linux.seccomp`` (the shared profile:
    ``_config``) spliced in as the process's cached text (``oci.seccomp_text``) instead of
    being encoded again on every pod's start. The splice goes by position, not by a
    marker a pod's own strings could imitate: ``linux`` is written last and ``seccomp``
    last in it. One line: ``indent`` makes ``json`` use its pure-Python encoder, which
    took most of a bundle's build (s40)."""
    if config["linux"].get("seccomp") is not oci.shared_seccomp_profile():
        return json.dumps(config)  # changed or removed: encoded as it is
    linux = {key: value for key, value in config["linux"].items() if key != "seccomp"}
    rest = {key: value for key, value in config.items() if key != "linux"}
    return _with_last(rest, "linux", _with_last(linux, "seccomp", oci.seccomp_text()))


def _with_last(obj: Mapping[str, Any], key: str, value_text: str) -> str:
    """``obj`` as JSON with ``key`` added last, its value the JSON text ``value_text``."""
    head = json.dumps(obj)
    return f"{head[:-1]}{', ' if obj else ''}{json.dumps(key)}: {value_text}}}"


def _working_dir(image: ImageConfig, spec: ContainerSpec) -> str:
    cwd = spec.working_dir or image.working_dir or "/"
    if not cwd.startswith("/"):
        raise BundleError(f"working directory {cwd!r} is not an absolute path")
    return str(PurePosixPath(cwd))


def build_bundle(
    paths: ContainerPaths,
    rootfs: Path,
    image: ImageConfig,
    spec: ContainerSpec,
    *,
    cgroup_path: str,
    cdi_edits: Sequence[ContainerEdits] = (),
    resolv_conf: Path = Path("/etc/resolv.conf"),
) -> Bundle:
    """Write the bundle into ``paths.root`` and return what it runs.

    Raises CommandNotFound when argv[0] is not an executable in the rootfs (searched with
    the container's own PATH), and BundleError for other unrunnable combinations.
    """
    if not rootfs.is_dir():
        raise BundleError(f"root filesystem {rootfs} does not exist")
    argv, cwd = _argv(image, spec), _working_dir(image, spec)
    user = resolve_user(rootfs, image.user)
    env = _base_env(image, spec, user)
    if find_executable(rootfs, argv[0], env.get("PATH", DEFAULT_PATH), cwd) is None:
        raise CommandNotFound(argv[0])
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.run_dir.mkdir(exist_ok=True)
    paths.gpus_json.write_text(json.dumps(gpus_document(spec), indent=2) + "\n")
    _write_etc(paths, spec, resolv_conf)
    config = _config(rootfs, _process(argv, env, cwd, user), paths, spec, cgroup_path)
    apply_edits(config, cdi_edits)
    final_env = _env_pairs(config["process"]["env"]) | gpu_env(spec.gpus)
    config["process"]["env"] = [f"{key}={value}" for key, value in final_env.items()]
    paths.config.write_text(config_text(config) + "\n")
    paths.meta.write_text(json.dumps(dict(spec.labels), indent=2) + "\n")
    return Bundle(paths, argv, tuple(config["process"]["env"]), config)
