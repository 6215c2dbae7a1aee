"""Pure domain code: quantities, names, image references, the transition table."""

from __future__ import annotations

import pytest

from gpucloud.core.errors import InvalidInput, InvalidTransition
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.image_ref import parse_reference
from gpucloud.core.names import check_dns_label
from gpucloud.core.phases import (
    POD_TRANSITIONS,
    PodPhase,
    RestartPolicy,
    check_transition,
    should_restart,
)
from gpucloud.core.quantities import format_cpu, format_memory, parse_cpu_milli, parse_memory


@pytest.mark.parametrize(("text", "expected"), [
    ("16Gi", 16 * 1024**3), ("512Mi", 512 * 1024**2), ("1G", 10**9), ("100", 100),
    ("1.5Gi", 1536 * 1024**2), (2048, 2048), ("1Ti", 1024**4),
])
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory("memory", text) == expected


@pytest.mark.parametrize("text", ["", "16Qi", "-1Gi", "Gi", "1 2", -5])
def test_parse_memory_rejects(text: str | int) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_memory("memory", text)
    assert info.value.field == "memory"


@pytest.mark.parametrize(("text", "milli"), [("2", 2000), ("0.5", 500), ("250m", 250),
                                              (4, 4000), (1.5, 1500)])
def test_parse_cpu(text: str | float, milli: int) -> None:
    assert parse_cpu_milli("cpu", text) == milli


@pytest.mark.parametrize("text", ["two", "-1", "1.5.2", True])
def test_parse_cpu_rejects(text: str | bool) -> None:
    with pytest.raises(InvalidInput):
        parse_cpu_milli("cpu", text)


def test_formatting_round_trips() -> None:
    assert format_memory(16 * 1024**3) == "16Gi" and format_memory(1000) == "1000"
    assert format_cpu(2000) == "2" and format_cpu(500) == "0.5" and format_cpu(250) == "250m"


@pytest.mark.parametrize("name", ["a", "pod-1", "x" * 63, "9lives"])
def test_dns_labels_accepted(name: str) -> None:
    assert check_dns_label("name", name) == name


@pytest.mark.parametrize("name", ["", "A", "a_b", "-a", "a-", "x" * 64, "a.b", "ü"])
def test_dns_labels_rejected(name: str) -> None:
    with pytest.raises(InvalidInput, match="name"):
        check_dns_label("name", name)


@pytest.mark.parametrize(("text", "registry", "repository", "tag", "digest"), [
    ("busybox", "docker.io", "library/busybox", "latest", None),
    ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
    ("ghcr.io/acme/trainer:1.2", "ghcr.io", "acme/trainer", "1.2", None),
    ("127.0.0.1:5000/a/b@sha256:" + "a" * 64, "127.0.0.1:5000", "a/b", None, "sha256:" + "a" * 64),
    ("localhost/x", "localhost", "x", "latest", None),
    ("gpucloud/demo", "docker.io", "gpucloud/demo", "latest", None),
])
def test_image_references(text: str, registry: str, repository: str, tag: str | None,
                          digest: str | None) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag,
                                                                    digest)


@pytest.mark.parametrize("text", ["", " x", "UPPER", "a:b:c", "a@sha256:zz", "a:", "a//b",
                                  "ex ample", "a:" + "t" * 129])
def test_malformed_image_references(text: str) -> None:
    with pytest.raises(InvalidInput, match="image"):
        parse_reference(text)


def test_transition_table_is_closed_and_enforced() -> None:
    assert set(POD_TRANSITIONS) == set(PodPhase)
    check_transition(PodPhase.PENDING, PodPhase.SCHEDULED)
    with pytest.raises(InvalidTransition):
        check_transition(PodPhase.PENDING, PodPhase.RUNNING)
    with pytest.raises(InvalidTransition):
        check_transition(PodPhase.SUCCEEDED, PodPhase.RUNNING)


@pytest.mark.parametrize(("policy", "phase", "expected"), [
    (RestartPolicy.NEVER, PodPhase.FAILED, False),
    (RestartPolicy.ON_FAILURE, PodPhase.FAILED, True),
    (RestartPolicy.ON_FAILURE, PodPhase.SUCCEEDED, False),
    (RestartPolicy.ON_FAILURE, PodPhase.LOST, True),
    (RestartPolicy.ALWAYS, PodPhase.SUCCEEDED, True),
    (RestartPolicy.ALWAYS, PodPhase.STOPPED, False),
])
def test_restart_policy(policy: RestartPolicy, phase: PodPhase, expected: bool) -> None:
    assert should_restart(policy, phase) is expected


def test_gpu_model_aliases() -> None:
    assert canonical_name("NVIDIA H100 80GB HBM3") == "H100-80GB"
    assert canonical_name("l40s") == "L40S"
    assert canonical_name("V100M32") == "V100-32GB"
    assert canonical_name("MysteryGPU") == "MysteryGPU"
