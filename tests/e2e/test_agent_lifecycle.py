"""The agent's own life: restarts adopt running pods, a killed agent's node goes Lost and
its pods move, deleted and moved pods are killed, images imported for offline use."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.image import app as image_app
from gpucloud.cli.up import build_demo_archive
from gpucloud.runtime.driver import ContainerState
from gpucloud.runtime.logs import read_from
from tests.e2e.cluster import AgentProcess, Cloud, running_cloud, wait_for
from tests.e2e.conftest import PushedImages

COUNTER = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done"]


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^line (\d+)$", text, re.MULTILINE)]


def _container_log(agent: AgentProcess) -> Path:
    [status] = agent.driver().containers()
    assert status.state is ContainerState.RUNNING and status.log_path is not None
    return status.log_path


def test_a_restarted_agent_adopts_its_running_pod_and_logs_continue(
    patient_cloud: Cloud, images: PushedImages
) -> None:
    agent = patient_cloud.agent("gpu-a")
    patient_cloud.create_pod("counter", images.busybox, COUNTER, gpus=1)
    patient_cloud.wait_log("counter", "line 5\n")
    token_before = patient_cloud.client.get_node("gpu-a").fencing_token
    events_before = patient_cloud.client.pod_events("counter")
    assert agent.terminate() == 0
    log = _container_log(agent)
    size = read_from(log, 0).next_offset
    wait_for(lambda: read_from(log, size).data.count(b"\n") >= 5, 10,
             "the container to keep writing while its agent is down")
    agent.start()
    shipped_while_down = max(_numbers(read_from(log, 0).text))
    patient_cloud.wait_log("counter", f"line {shipped_while_down + 10}\n")
    pod = patient_cloud.client.get_pod("counter")
    assert pod.phase == "Running" and pod.node == "gpu-a"
    assert patient_cloud.client.pod_events("counter") == events_before
    assert patient_cloud.client.get_node("gpu-a").fencing_token > token_before
    numbers = _numbers(patient_cloud.client.pod_logs("counter").text)
    assert numbers == list(range(1, len(numbers) + 1))  # no line lost or sent twice
    patient_cloud.client.delete_pod("counter")
    wait_for(lambda: agent.driver().containers() == [], 15,
             "the deleted pod's container to be killed and removed")


def test_a_killed_agents_node_goes_lost_and_a_restart_always_pod_moves(
    short_lease_cloud: Cloud, images: PushedImages
) -> None:
    cloud = short_lease_cloud  # the killed agent's node must go Lost
    agents = {name: cloud.agent(name) for name in ("gpu-a", "gpu-b")}
    cloud.create_pod("keeper", images.busybox, COUNTER, gpus=8, restart="always")
    first = cloud.wait_pod("keeper", "Running")
    cloud.wait_log("keeper", "line 3\n")
    lost = agents[first.node or ""]
    survivor = next(name for name in agents if name != first.node)
    lost.kill()
    cloud.wait_node(lost.name, "Lost", timeout=15)

    def moved() -> bool:
        pod = cloud.client.get_pod("keeper")
        return pod.node == survivor and pod.phase == "Running"

    wait_for(moved, 20, f"pod keeper to run on {survivor}")
    reasons = [e.reason for e in cloud.client.pod_events("keeper")]
    assert "NodeLost" in reasons and cloud.client.get_pod("keeper").restart_count == 1
    cloud.wait_log("keeper", "line 3\n")  # the new attempt's log
    assert lost.driver().containers()[0].state is ContainerState.RUNNING  # orphaned
    lost.start()
    cloud.wait_started(lost)
    wait_for(lambda: lost.driver().containers() == [], 15,
             "the restarted agent to kill the pod that moved away")
    assert cloud.client.get_pod("keeper").node == survivor


def test_an_imported_image_runs_without_a_registry(cloud: Cloud, tmp_path: Path) -> None:
    agent = cloud.agent("gpu-a")
    archive = build_demo_archive(tmp_path / "demo.tar")
    runner = CliRunner()
    state = ["--state-dir", str(agent.state_dir)]
    imported = runner.invoke(image_app, ["import", str(archive), *state, "--output", "json"])
    assert imported.exit_code == 0, imported.output
    assert [i["reference"] for i in json.loads(imported.output)] == [
        "docker.io/gpucloud/demo:latest"]
    (tmp_path / "not-an-image").write_text("hello\n")
    bad = runner.invoke(image_app, ["import", str(tmp_path / "not-an-image"), *state])
    assert bad.exit_code == 1 and "is not an image archive" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    listed = runner.invoke(image_app, ["list", *state, "--output", "json"])
    assert "docker.io/gpucloud/demo:latest" in [i["reference"] for i in json.loads(listed.output)]
    cloud.create_pod("hello", "gpucloud/demo", ["gpucloud-demo"], gpus=2)
    pod = cloud.wait_pod("hello", "Succeeded", "Failed")
    text = cloud.client.pod_logs("hello").text
    assert pod.phase == "Succeeded", text
    assert "2 GPU(s) assigned:" in text and "agree" in text
    for uuid in pod.gpu_uuids:
        assert uuid in text


def test_the_agent_rides_out_a_server_restart(tmp_path: Path, images: PushedImages) -> None:
    """With the server down for 3 s (lease TTL 10 s) the agent retries; nothing is lost."""
    with running_cloud(tmp_path, lease_ttl=10) as cloud:
        agent = cloud.agent("gpu-a")
        cloud.create_pod("counter", images.busybox, COUNTER)
        cloud.create_pod("short", images.busybox,
                         ["sh", "-c", "echo started; sleep 2; echo finished; exit 4"])
        cloud.wait_log("short", "started")
        cloud.wait_log("counter", "line 3\n")
        cloud.server.stop()
        time.sleep(3)  # the outage itself: there is no condition to wait for
        cloud.server.start()
        short = cloud.wait_pod("short", "Failed", timeout=20)  # it ended during the outage
        assert short.exit_code == 4 and "finished" in cloud.client.pod_logs("short").text
        cloud.wait_log("counter", "line 80\n")
        numbers = _numbers(cloud.client.pod_logs("counter").text)
        assert numbers == list(range(1, len(numbers) + 1))
        assert cloud.client.get_node("gpu-a").status == "Ready"
        assert agent.running() and cloud.client.get_pod("counter").phase == "Running"


def test_a_pod_that_ended_while_its_agent_was_down_is_reported(
    patient_cloud: Cloud, images: PushedImages
) -> None:
    agent = patient_cloud.agent("gpu-a")
    patient_cloud.create_pod("brief", images.busybox, ["sh", "-c", "echo one; sleep 1; echo two"])
    patient_cloud.wait_log("brief", "one")
    agent.kill()
    wait_for(lambda: agent.driver().containers()[0].state is ContainerState.EXITED, 10,
             "the container to end while the agent is down")
    agent.start()
    pod = patient_cloud.wait_pod("brief", "Succeeded", "Failed")
    assert (pod.phase, pod.exit_code) == ("Succeeded", 0)
    assert patient_cloud.client.pod_logs("brief").text == "one\ntwo\n"
    wait_for(lambda: agent.driver().containers() == [], 10, "the ended container's removal")


def test_the_first_output_ships_while_runc_is_still_starting_the_container(
        cloud: Cloud, images: PushedImages, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's ``runc`` (found on ``PATH``) is a shim whose ``run`` does not return
    until a file appears: the pod's first line is in its log, served by the API, while
    the start is still under way (not ``Running`` yet); then the pod runs to its end."""
    release = tmp_path / "release"
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "runc"
    shim.write_text(
        "#!/bin/sh\n/usr/bin/runc \"$@\"\ncode=$?\n"
        'case " $* " in *" run "*) while [ ! -e ' + str(release) + ' ]; do sleep 0.01; '
        "done;; esac\nexit $code\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ.get('PATH', '')}")
    cloud.agent("gpu-a")
    try:
        cloud.create_pod("early", images.busybox, ["sh", "-c", "echo first; sleep 1"],
                         gpus=1)
        cloud.wait_log("early", "first\n")
        assert cloud.client.get_pod("early").phase in ("Scheduled", "Pulling")
    finally:
        release.touch()
    cloud.wait_pod("early", "Succeeded")
    assert cloud.client.pod_logs("early").text == "first\n"
