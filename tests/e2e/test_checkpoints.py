"""Checkpoint directories end to end: real agents, runc and busybox sh.

A counter that commits each value to ``/ckpt`` (``gpucloud-ckpt commit``) is stopped on
one node and started on another: it continues from its last committed value, no value
skipped (SQLite and PostgreSQL). An agent killed with SIGKILL halfway through uploading a
large checkpoint leaves the previous checkpoint intact: the pod, restarted elsewhere after
the node is lost, restores that one.
"""

from __future__ import annotations

import re

from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

CKPT = "/run/gpucloud/bin/gpucloud-ckpt"
COUNTER = ["sh", "-c", f"""trap 'exit 0' TERM
n=0
if [ -f /ckpt/n ]; then n=$(cat /ckpt/n); echo "resumed $n"; fi
while true; do
  n=$((n + 1)); echo "count $n"; echo "$n" > /ckpt/n
  {CKPT} commit > /dev/null || echo "commit failed"
done"""]
BIG = 192 * 1024 * 1024
HALFWAY = ["sh", "-c", f"""trap 'exit 0' TERM
if [ -f /ckpt/state ]; then
  echo "restored $(cat /ckpt/state) big=$(ls /ckpt | grep -c big)"; exec sleep 600
fi
echo one > /ckpt/state; {CKPT} commit && echo committed-one
head -c {BIG} /dev/urandom > /ckpt/big; echo two > /ckpt/state
{CKPT} commit && echo committed-two
exec sleep 600"""]




def _counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^count (\d+)$", text, re.M)]


def test_a_counter_continues_from_its_last_checkpoint_on_another_node(
    db_cloud: Cloud, images: PushedImages
) -> None:
    cloud = db_cloud
    cloud.agent("ck-a")
    cloud.create_pod("counter", images.busybox, COUNTER, checkpoint_dir="/ckpt")
    first = cloud.wait_pod("counter", "Running")
    assert first.node == "ck-a"
    cloud.wait_log("counter", "count 8")
    cloud.agent("ck-b")
    cloud.client.stop_pod("counter")
    cloud.wait_pod("counter", "Stopped", timeout=20)
    before = _counts(cloud.client.pod_logs("counter").text)
    last = cloud.client.get_pod("counter").last_checkpoint
    assert last is not None

    cloud.client.cordon("ck-a")
    cloud.client.start_pod("counter")
    moved = cloud.wait_pod("counter", "Running")
    assert moved.node == "ck-b"
    def resumed_run() -> str | None:
        text = cloud.client.pod_logs("counter").text
        return text if len(_counts(text)) >= 5 else None

    text = wait_for(resumed_run, 30, "the counter to go on")
    match = re.search(r"^resumed (\d+)$", text, re.M)
    assert match is not None, text
    resumed = int(match.group(1))
    after = _counts(text)
    # It goes on from the committed value: nothing skipped, nothing before it repeated.
    assert after[0] == resumed + 1 and after == list(range(resumed + 1, resumed + 1 + len(after)))
    assert before == list(range(1, len(before) + 1))
    assert resumed >= 8 and before[-1] - 1 <= resumed <= before[-1]
    reasons = [e.reason for e in cloud.client.pod_events("counter")]
    assert "CheckpointRestored" in reasons and "CheckpointRejected" not in reasons
    listed = cloud.client.list_checkpoints("counter")
    assert len(listed) == 2 and all(c.state == "committed" for c in listed)


def test_killing_the_agent_mid_upload_leaves_the_previous_checkpoint(
    short_lease_cloud: Cloud, images: PushedImages
) -> None:
    cloud = short_lease_cloud  # the killed agent's node must go Lost
    node_a = cloud.agent("ck-a")
    cloud.create_pod("halfway", images.busybox, HALFWAY, checkpoint_dir="/ckpt",
                     restart="always")
    cloud.wait_log("halfway", "committed-one", timeout=30)
    cloud.agent("ck-b")
    store = cloud.workdir / "home" / "checkpoints"

    def uploading() -> bool:
        chunks = len(list(store.glob("store/*/chunks/*/*")))
        return chunks >= 6  # the first checkpoint's one chunk and several of the big file

    wait_for(uploading, 60, "the big checkpoint's upload to be under way")
    node_a.kill()
    listed = cloud.client.list_checkpoints("halfway")
    assert [(c.seq, c.state) for c in listed] == [(1, "committed")], listed
    assert "committed-two" not in cloud.client.pod_logs("halfway").text

    cloud.wait_node("ck-a", "Lost", timeout=30)
    moved = cloud.wait_pod("halfway", "Running", timeout=60)
    assert moved.node == "ck-b"
    text = cloud.wait_log("halfway", "restored one big=0", timeout=30)
    assert "restored two" not in text
    assert "CheckpointRestored" in [e.reason for e in cloud.client.pod_events("halfway")]
