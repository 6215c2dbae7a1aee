"""Usage end to end: real containers on a simulated GPU node, sampled from their cgroups
and the simulated GPU model, metered from their phase transitions; a killed agent (and a
server outage) loses no samples and counts none twice."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import httpx
from sqlalchemy import select

from gpucloud.core.usage import PodRun, UsageSample
from gpucloud.db.models import UsageSampleModel
from gpucloud.db.session import Database
from gpucloud.services import usage
from gpucloud.services.metrics import families
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages
from tests.fixtures.postgres import free_port

FAST_SAMPLES = ["--usage-interval", "0.5"]


def _runs(cloud: Cloud, pod_id: str) -> list[PodRun]:
    db = Database(cloud.server.settings.database_url)
    try:
        with db.read() as session:
            return [r for r in usage.pod_runs(session, None, None, None) if r.pod_id == pod_id]
    finally:
        db.dispose()


def _samples(cloud: Cloud, pod_id: str) -> list[tuple[int, float]]:
    """(seq, cpu_seconds) of the pod's stored samples, by seq."""
    db = Database(cloud.server.settings.database_url)
    try:
        with db.read() as session:
            rows = session.execute(select(UsageSampleModel.seq, UsageSampleModel.cpu_seconds)
                                   .where(UsageSampleModel.pod_id == pod_id)
                                   .order_by(UsageSampleModel.seq)).all()
        return [(int(seq), float(cpu)) for seq, cpu in rows]
    finally:
        db.dispose()


def _pod_gpu_util(port: int, pod_id: str) -> list[float] | None:
    """The pod's ``gpucloud_pod_gpu_utilization_ratio`` series on the agent's
    ``/metrics`` (one per GPU), once there are two."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return None  # not listening yet
    found = [value for name, labels, value in families(text)
             if name == "gpucloud_pod_gpu_utilization_ratio" and labels.get("pod") == pod_id]
    return found if len(found) == 2 else None


def _spooled(state_dir: Path) -> list[int]:
    """Sequence numbers the agent's spool holds unacknowledged."""
    seqs = []
    for path in (state_dir / "usage").glob("*.jsonl"):
        seqs += [UsageSample.model_validate_json(line).seq
                 for line in path.read_text().splitlines() if line.strip()]
    return sorted(seqs)


def test_a_ten_second_pod_on_two_gpus_is_metered_and_sampled(
    cloud: Cloud, images: PushedImages
) -> None:
    port = free_port()
    cloud.agent("gpu-a", extra=[*FAST_SAMPLES, "--metrics-port", str(port)])
    cloud.client.set_price({"model": "H100-80GB", "price_class": "on-demand",
                            "price": "3.60"})
    pod = cloud.create_pod("load", images.busybox,
                           ["sh", "-c", "end=$(($(date +%s)+10)); "
                                        "while [ $(date +%s) -lt $end ]; do :; done"],
                           gpus=2, env={"GPUCLOUD_SIM_GPU_UTIL": "50"})
    cloud.wait_pod("load", "Running", timeout=60)
    scraped = wait_for(lambda: _pod_gpu_util(port, pod.id), 8, "the pod's GPUs in /metrics")
    assert scraped == [0.5, 0.5]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    counts = {name: value for name, _, value in families(text) if name.endswith("_count")}
    assert counts["gpucloud_image_pull_duration_seconds_count"] >= 1
    assert counts["gpucloud_pod_start_duration_seconds_count"] >= 1
    cloud.wait_pod("load", "Succeeded", timeout=60)
    [run] = wait_for(lambda: [r for r in _runs(cloud, pod.id) if r.samples >= 10], 20,
                     "the pod's samples to reach the server")
    assert run.ended_at is not None and run.gpus == 2 and run.end_reason == "Completed"
    assert abs(run.seconds(run.ended_at) - 10) <= 1, run
    assert run.gpu_util_avg is not None and abs(run.gpu_util_avg - 50) < 0.5
    assert run.cpu_seconds is not None and run.cpu_seconds > 3  # it spun a CPU the whole time
    assert run.memory_peak_bytes is not None and run.memory_peak_bytes > 0
    assert run.net_rx_bytes is not None  # its own network namespace
    [row] = [r for r in cloud.client.usage(by="pod").rows if r.pod_id == pod.id]
    assert abs(row.gpu_seconds - 20) <= 2  # 10 s ± 1 s × 2 GPUs
    # the price set above (H100-80GB, the simulated DGX's model; its default is 2.99)
    priced = Decimal(str(row.gpu_seconds)) * Decimal("3.60") / 3600
    assert abs(row.cost - priced) <= Decimal("0.000001"), (row.cost, priced)
    assert row.gpu_util_avg is not None and abs(row.gpu_util_avg - 50) < 0.5


def test_a_killed_and_restarted_agent_loses_no_samples_and_counts_none_twice(
    patient_cloud: Cloud, images: PushedImages
) -> None:
    cloud = patient_cloud
    agent = cloud.agent("gpu-a", extra=FAST_SAMPLES)
    pod = cloud.create_pod("steady", images.busybox, ["sleep", "3600"], gpus=1,
                           env={"GPUCLOUD_SIM_GPU_UTIL": "25"})
    cloud.wait_pod("steady", "Running")
    wait_for(lambda: len(_samples(cloud, pod.id)) >= 3, 20, "the first samples")
    cloud.server.stop()  # samples pile up in the spool, unacknowledged
    wait_for(lambda: len(_spooled(agent.state_dir)) >= 3, 20, "samples in the spool")
    agent.kill()
    held = _spooled(agent.state_dir)
    cloud.server.start()
    agent.start()
    wait_for(lambda: len(_samples(cloud, pod.id)) >= max(held) + 5, 30,
             "the spooled samples and new ones to reach the server")
    samples = _samples(cloud, pod.id)
    seqs = [seq for seq, _ in samples]
    assert seqs == list(range(len(seqs)))  # none lost, none twice
    assert set(held) <= set(seqs)
    cpu = [value for _, value in samples]
    assert cpu == sorted(cpu)  # one cumulative counter across the agent restart
    [run] = _runs(cloud, pod.id)
    assert run.ended_at is None and run.samples == len(seqs)
    assert run.gpu_util_avg is not None and abs(run.gpu_util_avg - 25) < 0.5
