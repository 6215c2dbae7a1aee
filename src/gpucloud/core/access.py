"""Wire types of getting into pods and keeping their files: SSH keys, the pod's network
and ports, volumes, network volumes, templates and registry credentials.

Shared by the server (api/, services/), the agent and the SDK. Request bodies forbid
unknown fields; new fields always get a default.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePosixPath

from pydantic import BaseModel, Field

#: Mount paths a volume may never take (nor anything below them).
FORBIDDEN_MOUNT_PATHS = ("/", "/proc", "/sys", "/dev", "/run/gpucloud")
DEFAULT_VOLUME_PATH = "/workspace"
MAX_MOUNT_PATH = 255


def check_mount_path(value: str) -> str:
    """A normalized absolute container path that a volume may be mounted at; ValueError
    (reported against the caller's field) otherwise."""
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    if len(value) > MAX_MOUNT_PATH or "\x00" in value:
        raise ValueError(f"must be at most {MAX_MOUNT_PATH} characters, without NUL")
    path = PurePosixPath(value)
    if ".." in path.parts:
        raise ValueError(f"{value!r} must not contain '..'")
    normalized = str(path)
    for forbidden in FORBIDDEN_MOUNT_PATHS:
        if normalized == forbidden or (forbidden != "/" and
                                       normalized.startswith(forbidden + "/")):
            raise ValueError(f"{normalized!r} cannot hold a volume")
    return normalized


class PortMapping(BaseModel):
    """One port of a pod, as RunPod's ``runtime.ports`` gives it (camelCase kept so tools
    that read RunPod's shape read ours). The private entry (``isIpPublic`` false) carries
    the pod's own address; a ``tcp`` port also has a public entry on the node's address."""

    ip: str
    isIpPublic: bool  # noqa: N815 - RunPod's field names
    privatePort: int  # noqa: N815
    publicPort: int | None = None  # noqa: N815
    type: str


class PodNetwork(BaseModel):
    """What the agent reports of a running pod's network."""

    #: The pod's own address (its network namespace), or the node's with host networking.
    ip: str | None = None
    host_network: bool = False
    ports: list[PortMapping] = Field(default_factory=list, max_length=512)


class NetworkVolumeMount(BaseModel):
    """A network volume as a pod mounts it: where the agent finds it and where it goes."""

    name: str
    volume_id: str
    path: str
    #: How the node reaches it: ``hostpath`` (a directory on this machine) or ``nfs``.
    mode: str = "hostpath"
    #: The directory (hostpath) or ``server:/export/path`` (nfs).
    source: str = ""
    size_bytes: int = 0


class SshKeyAddRequest(BaseModel):
    model_config = {"extra": "forbid"}
    #: One OpenSSH public key line: ``TYPE BASE64 [COMMENT]`` (ed25519, ecdsa, rsa >= 2048).
    public_key: str = Field(max_length=16384)
    name: str | None = Field(default=None, max_length=255)


class SshKeyOut(BaseModel):
    id: str
    name: str
    key_type: str
    fingerprint: str
    public_key: str
    created_at: datetime


class PodAccessOut(BaseModel):
    """How to reach a pod: the SSH command and the proxy URLs of its HTTP ports."""

    pod_id: str
    ssh_user: str
    ssh_host: str
    ssh_port: int
    ssh_command: str
    http: dict[str, str] = Field(default_factory=dict)
    proxy_token: str | None = None


class VolumeCreateRequest(BaseModel):
    """``gpucloud volume create NAME --size 100Gi [--zone Z]``: a network volume."""

    model_config = {"extra": "forbid"}
    name: str = Field(max_length=63)
    size: int | str
    #: Where pods that mount it should run (a node label ``zone``); informational for now.
    zone: str | None = Field(default=None, max_length=63)


class VolumeOut(BaseModel):
    id: str
    name: str
    project: str
    size_bytes: int
    size: str
    zone: str | None = None
    #: The live pods that mount it now (a volume is deleted only when there are none).
    mounted_by: list[str] = Field(default_factory=list)
    created_at: datetime
