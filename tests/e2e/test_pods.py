"""Pods through server + agent + runc + registry: GPUs, PID 1, limits, stop, bad input."""

from __future__ import annotations

import json
import platform

from gpucloud.images.testing import busybox_image
from tests.e2e.cluster import Cloud
from tests.e2e.conftest import PushedImages
from tests.fixtures.registry import USER, CorruptingProxy, Registry

PROBE = ("echo pid=$$; tr '\\0' ' ' < /proc/1/cmdline; echo; "
         "echo cuda=$CUDA_VISIBLE_DEVICES; echo nvidia=$NVIDIA_VISIBLE_DEVICES; "
         "echo ---; cat /run/gpucloud/gpus.json")


def test_gpu_env_matches_the_assignment_and_pid_1_is_the_command(
    cloud: Cloud, images: PushedImages
) -> None:
    cloud.agent("gpu-a")
    cloud.create_pod("probe", images.busybox, ["sh", "-c", PROBE], gpus=3)
    pod = cloud.wait_pod("probe", "Succeeded", "Failed")
    assert (pod.phase, pod.exit_code, pod.node) == ("Succeeded", 0, "gpu-a")
    head, _, document = cloud.wait_log("probe", "}").partition("---\n")
    lines = head.splitlines()
    uuids = ",".join(pod.gpu_uuids)
    assert len(pod.gpu_uuids) == 3
    assert lines[0] == "pid=1"
    assert lines[1].strip() == f"sh -c {PROBE}"
    assert lines[2:] == [f"cuda={uuids}", f"nvidia={uuids}"]
    gpus = json.loads(document)
    assert gpus["visible_devices"] == uuids and gpus["node"] == "gpu-a"
    assert [g["uuid"] for g in gpus["gpus"]] == pod.gpu_uuids
    phases = [e.to_phase for e in cloud.client.pod_events("probe")]
    assert phases == ["Pending", "Scheduled", "Pulling", "Running", "Succeeded"]


def test_a_pod_of_a_cached_image_goes_from_scheduled_to_running(
    cloud: Cloud, images: PushedImages
) -> None:
    cloud.agent("gpu-a")
    cloud.create_pod("pulls", images.busybox, ["echo", "one"])
    pod = cloud.wait_pod("pulls", "Succeeded", "Failed")
    assert pod.phase == "Succeeded", (pod.reason, pod.message)
    cloud.create_pod("cached", images.busybox, ["echo", "two"])  # in the node's store now
    assert cloud.wait_pod("cached", "Succeeded", "Failed").phase == "Succeeded"
    assert cloud.wait_log("cached", "two") == "two\n"
    pulled = [e.to_phase for e in cloud.client.pod_events("pulls")]
    assert pulled == ["Pending", "Scheduled", "Pulling", "Running", "Succeeded"]
    cached = [e.to_phase for e in cloud.client.pod_events("cached")]
    assert cached == ["Pending", "Scheduled", "Running", "Succeeded"]  # nothing pulled


def test_exit_code_memory_limit_and_stop_with_grace(cloud: Cloud, images: PushedImages) -> None:
    cloud.agent("gpu-a")
    cloud.create_pod("fails", images.busybox, ["sh", "-c", "echo bad >&2; exit 3"])
    cloud.create_pod("hog", images.busybox,
                     ["sh", "-c", "echo start; a=x; while true; do a=$a$a; done"],
                     memory="16Mi")
    cloud.create_pod("stubborn", images.busybox,
                     ["sh", "-c", "echo up; while true; do sleep 0.05; done"])
    cloud.create_pod("polite", images.busybox,
                     ["sh", "-c", "trap 'echo bye; exit 0' TERM; echo up; "
                                  "while true; do sleep 0.05; done"])
    failed = cloud.wait_pod("fails", "Failed")
    assert failed.exit_code == 3 and failed.reason == "Error (exit code 3)"
    assert cloud.wait_log("fails", "bad") == "bad\n"
    hog = cloud.wait_pod("hog", "Failed")
    assert (hog.reason, hog.exit_code) == ("OOMKilled", 137)
    assert "16Mi" in (hog.message or "")
    for name in ("stubborn", "polite"):
        cloud.wait_log(name, "up")
        cloud.client.stop_pod(name)
    polite = cloud.wait_pod("polite", "Stopped")
    assert polite.exit_code == 0 and "bye" in cloud.client.pod_logs("polite").text
    stubborn = cloud.wait_pod("stubborn", "Stopped")  # PID 1 ignores SIGTERM: killed at 1 s
    assert stubborn.exit_code == 137 and "grace" in (stubborn.message or "")
    assert cloud.client.get_node("gpu-a").status == "Ready"


def _other_architecture() -> str:
    return "arm64" if platform.machine() in ("x86_64", "amd64") else "amd64"


def test_bad_input_fails_the_pod_with_a_readable_reason_and_the_node_stays_ready(
    cloud: Cloud, images: PushedImages, registry: Registry, basic_auth_registry: Registry
) -> None:
    busybox_image(architecture=_other_architecture()).push(registry.host, "e2e/foreign:1")
    busybox_image().push(basic_auth_registry.host, "e2e/private:1",
                         credentials=basic_auth_registry.credentials)
    wrong = {basic_auth_registry.host: {"username": USER.username, "password": "wrong"}}
    cloud.agent("gpu-a", registries=wrong)
    cases = {
        "missing": (f"{registry.host}/e2e/does-not-exist:1", ["true"], "ImageNotFound"),
        "refused": (f"{basic_auth_registry.host}/e2e/private:1", ["true"],
                    "RegistryUnauthorized"),
        "no-command": (images.busybox, ["no-such-tool", "--help"],
                       "command not found: no-such-tool"),
        "foreign": (f"{registry.host}/e2e/foreign:1", ["true"], "NoMatchingPlatform"),
    }
    for name, (image, command, _) in cases.items():
        cloud.create_pod(name, image, command, gpus=1)
    for name, (_, _, reason) in cases.items():
        pod = cloud.wait_pod(name, "Failed", "Succeeded")
        assert (pod.phase, pod.reason) == ("Failed", reason), pod
        assert pod.message and "\n" not in pod.message
        events = cloud.client.pod_events(name)
        assert events[-1].to_phase == "Failed" and events[-1].reason == reason
    assert "e2e/does-not-exist" in (cloud.client.get_pod("missing").message or "")
    assert _other_architecture() in (cloud.client.get_pod("foreign").message or "")
    node = cloud.client.get_node("gpu-a")
    assert node.status == "Ready" and node.gpus_allocated == 0
    cloud.create_pod("after", images.busybox, ["echo", "fine"], gpus=8)
    assert cloud.wait_pod("after", "Succeeded", "Failed").phase == "Succeeded"


def test_a_corrupted_layer_is_refused(cloud: Cloud, registry: Registry,
                                      corrupting_proxy: CorruptingProxy) -> None:
    image = busybox_image(extra_files={"etc/motd": "corrupt me\n"})
    image.push(registry.host, "e2e/corrupted:1")
    corrupting_proxy.corrupt.add(image.layers[-1].digest)
    cloud.agent("gpu-a")
    cloud.create_pod("corrupt", f"{corrupting_proxy.host}/e2e/corrupted:1", ["true"])
    pod = cloud.wait_pod("corrupt", "Failed", "Succeeded")
    assert pod.phase == "Failed" and pod.reason == "DigestMismatch"
    assert image.layers[-1].digest in (pod.message or "")
    assert "corrupted" in (pod.message or "")
