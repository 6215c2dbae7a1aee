"""A user cannot ask for what would let a container out: none of Docker's escape hatches
(privileged, host paths, devices, added capabilities, host namespaces, security options)
is a field of a pod, a template or a job, and the paths a user may name inside the
container never cover the kernel's interfaces. Each is refused with 422 naming the field,
and nothing is written. (What a pod does get is checked from inside one:
tests/integration/runtime/test_container_security.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

POD = {"name": "a1", "image": "busybox:1"}

#: Docker's and Kubernetes' names for the ways out, as a user might send them.
ESCAPES: list[tuple[str, Any]] = [
    ("privileged", True),
    ("host_path", "/"),
    ("mounts", [{"source": "/", "target": "/host", "type": "bind"}]),
    ("binds", ["/:/host"]),
    ("volumes", ["/var/run/docker.sock:/var/run/docker.sock"]),
    ("devices", ["/dev/sda"]),
    ("cap_add", ["SYS_ADMIN"]),
    ("capabilities", {"add": ["ALL"]}),
    ("security_opt", ["seccomp=unconfined"]),
    ("seccomp", "unconfined"),
    ("apparmor", "unconfined"),
    ("network_mode", "host"),
    ("host_network", True),
    ("pid", "host"),
    ("host_pid", True),
    ("ipc", "host"),
    ("user", "0"),
    ("userns_mode", "host"),
    ("cgroup_parent", "/"),
    ("no_new_privileges", False),
]


def _refused(response: Any, field: str) -> None:
    assert response.status_code == 422, (field, response.text)
    assert response.json()["field"] == field


@pytest.mark.parametrize("route", ["/v1/pods", "/v1/templates", "/v1/jobs"])
def test_no_escape_is_a_field_of_a_pod_a_template_or_a_job(api: TestClient,
                                                            route: str) -> None:
    body = {**POD, "nodes": 1} if route == "/v1/jobs" else dict(POD)
    for field, value in ESCAPES:
        _refused(api.post(route, json={**body, field: value}), field)
    assert api.get(route).json() == []


def test_no_path_a_user_names_covers_the_kernels_interfaces(api: TestClient) -> None:
    for field in ("volume_path", "checkpoint_dir"):
        for path in ("/", "/proc", "/proc/sys", "/sys", "/sys/fs/cgroup", "/dev", "/dev/mem",
                     "/run/gpucloud", "/../proc", "/tmp/../proc"):
            _refused(api.post("/v1/pods", json={**POD, field: path}), field)
    assert api.get("/v1/pods").json() == []
