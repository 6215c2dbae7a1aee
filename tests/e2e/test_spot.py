"""Spot pods and node drain through server + agents + runc: a preempted spot pod reads its
notice file in its SIGTERM trap (sent to its whole process group: the trap runs while a
child sleeps), is requeued and runs on another node; a drained node ends empty with its
pods running elsewhere, and can be undrained."""

from __future__ import annotations

import json

from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

#: Prints where it runs; on SIGTERM prints the notice it was given and exits 75 ("requeue
#: me"). ``sleep`` runs as a child: only a signal to the whole group wakes the shell.
NOTICED = ["sh", "-c", "trap 'echo \"TERM notice=$(tr -d \"\\n \" < $GPUCLOUD_PREEMPT_FILE)\"; "
           "exit 75' TERM; echo up attempt; while true; do sleep 600; done"]
SLEEPER = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]
#: Says which signals it got: a drain sends the checkpoint request (SIGUSR1) before the
#: notice's SIGTERM.
CHECKPOINTER = ["sh", "-c", "trap 'echo got USR1' USR1; trap 'echo got TERM; exit 0' TERM; "
                "echo up attempt; while true; do sleep 0.2; done"]


def test_a_spot_pod_gets_notice_and_sigterm_then_runs_on_another_node(
        cloud: Cloud, images: PushedImages) -> None:
    cloud.agent("spot-a", address="127.0.0.2")
    cloud.agent("spot-b", address="127.0.0.3")
    cloud.create_pod("cheap", images.busybox, NOTICED, gpus=8, spot=True, grace=20)
    cloud.create_pod("filler", images.busybox, SLEEPER, gpus=8)
    first = cloud.wait_pod("cheap", "Running")
    cloud.wait_pod("filler", "Running")
    cloud.wait_log("cheap", "up attempt")
    attempt = cloud.client.pod_logs("cheap").attempt

    cloud.create_pod("urgent", images.busybox, SLEEPER, gpus=8, priority_class="on-demand")
    urgent = cloud.wait_pod("urgent", "Running", timeout=15)  # well inside the 20 s grace
    assert urgent.node == first.node
    text = _attempt_log(cloud, first.id, attempt)
    line = next(x for x in text.splitlines() if x.startswith("TERM notice="))
    notice = json.loads(line.removeprefix("TERM notice="))
    assert notice["reason"] == "spot" and notice["grace_seconds"] == 20
    assert {"deadline", "attempt"} <= notice.keys()

    cloud.agent("spot-c", address="127.0.0.4")
    moved = cloud.wait_pod("cheap", "Running", timeout=30)
    assert moved.node == "spot-c" and moved.node != first.node
    assert (moved.preemptions, moved.last_preemption_reason) == (1, "spot")
    assert moved.time_lost_seconds > 0


def _attempt_log(cloud: Cloud, pod_id: str, attempt: int) -> str:
    """The log of the attempt that was preempted."""
    def check() -> str | None:
        text = cloud.client.pod_logs(pod_id, attempt=attempt).text
        return text if "TERM notice=" in text else None

    return wait_for(check, 15, "the trap's output in the first attempt's log")


def test_a_drained_node_ends_empty_with_its_pods_elsewhere_then_undrain(
        cloud: Cloud, images: PushedImages) -> None:
    cloud.agent("drain-a", address="127.0.0.2")
    cloud.agent("drain-b", address="127.0.0.3")
    cloud.create_pod("w1", images.busybox, CHECKPOINTER, gpus=4, checkpoint_dir="/ckpt")
    cloud.create_pod("w2", images.busybox, SLEEPER, gpus=4)
    pods = [cloud.wait_pod(name, "Running") for name in ("w1", "w2")]
    victim = pods[0].node
    assert victim is not None
    cloud.wait_log("w1", "up attempt")
    attempt = cloud.client.pod_logs("w1").attempt
    node = cloud.client.drain(victim, "60s")
    assert node.status in ("Draining", "Drained") and node.cordoned

    def drained() -> bool:
        return cloud.client.get_node(victim).status == "Drained"

    wait_for(drained, 30, f"node {victim} to be Drained")
    for name in ("w1", "w2"):
        pod = cloud.wait_pod(name, "Running", timeout=30)
        assert pod.node != victim, pod
    drain = cloud.client.get_node(victim).drain
    assert drain is not None and drain.pods_left == 0
    assert drain.pods_total == sum(p.node == victim for p in pods)
    undrained = cloud.client.undrain(victim)
    assert (undrained.status, undrained.cordoned) == ("Ready", False)

    def drained_log() -> str | None:
        text = cloud.client.pod_logs(pods[0].id, attempt=attempt).text
        return text if "got TERM" in text else None

    log = wait_for(drained_log, 15, "the drained attempt's log")
    assert "got USR1" in log, log
