"""The pod's entrypoint override (``--entrypoint``, a template's entrypoint) in the bundle:
it replaces the image's Entrypoint and, as ``docker run --entrypoint`` does, its Cmd."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.agent.podworker import container_spec, pull_credentials
from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from gpucloud.images.auth import Credentials
from gpucloud.runtime.bundle import ImageConfig
from gpucloud.runtime.errors import BundleError
from tests.unit.runtime.test_runtime_bundle import _build, rootfs  # noqa: F401 - fixture

IMAGE = ImageConfig(entrypoint=("/app/serve",), cmd=("--port", "80"))


@pytest.mark.parametrize(
    ("entrypoint", "command", "argv"),
    [
        (None, None, ["/app/serve", "--port", "80"]),  # no override: the image's
        (("python3", "-u"), None, ["python3", "-u"]),  # the image's Cmd goes too
        (("python3", "-u"), ("train.py",), ["python3", "-u", "train.py"]),
        ((), ("sh", "-c", "echo hi"), ["sh", "-c", "echo hi"]),  # [] : no entrypoint at all
    ],
)
def test_entrypoint_override(tmp_path: Path, rootfs: Path,  # noqa: F811
                             entrypoint: tuple[str, ...] | None,
                             command: tuple[str, ...] | None, argv: list[str]) -> None:
    config = _build(tmp_path, rootfs, IMAGE, entrypoint=entrypoint, command=command)
    assert config["process"]["args"] == argv


def test_empty_entrypoint_and_no_command_is_an_error(tmp_path: Path,
                                                     rootfs: Path) -> None:  # noqa: F811
    with pytest.raises(BundleError, match="no command"):
        _build(tmp_path, rootfs, IMAGE, entrypoint=())


def _assignment(**fields: object) -> AssignmentOut:
    base: dict[str, object] = dict(
        pod_id="ab" * 16, name="p", project="default", attempt=0, desired_state="running",
        phase=PodPhase.SCHEDULED, image="busybox", command=["train.py"], env={}, ports=[],
        cpu_milli=1000, memory_bytes=1024**3, gpu_uuids=[])
    return AssignmentOut.model_validate({**base, **fields})


def test_the_agent_passes_the_entrypoint_and_the_pods_login_on() -> None:
    spec = container_spec(_assignment(entrypoint=["python3"]), (), "node-1")
    assert spec.entrypoint == ("python3",) and spec.command == ("train.py",)
    assert container_spec(_assignment(), (), "node-1").entrypoint is None
    assert container_spec(_assignment(entrypoint=[]), (), "node-1").entrypoint == ()
    assert pull_credentials(_assignment()) is None
    login = _assignment(registry_username="alice", registry_password="pw")
    assert pull_credentials(login) == Credentials("alice", "pw")
    assert "pw" not in repr(login) and "pw" not in repr(pull_credentials(login))
