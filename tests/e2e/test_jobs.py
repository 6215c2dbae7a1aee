"""Jobs through server + three agents + runc: gang placement, rendezvous env, barrier."""

from __future__ import annotations

from gpucloud.core.jobs import JobOut
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

PRINT_ENV = ("echo rank=$GPUCLOUD_NODE_RANK nodes=$GPUCLOUD_NUM_NODES "
             "gpus=$GPUCLOUD_GPUS_PER_NODE master=$MASTER_ADDR:$MASTER_PORT "
             "pet=$PET_NODE_RANK/$PET_NNODES/$PET_NPROC_PER_NODE"
             "@$PET_MASTER_ADDR:$PET_MASTER_PORT; "
             "echo \"$GPUCLOUD_NODE_IPS\" | tr '\\n' ' '; echo; "
             "echo cuda=$CUDA_VISIBLE_DEVICES")
ADDRESSES = {"dgx-a": "127.0.0.2", "dgx-b": "127.0.0.3", "dgx-c": "127.0.0.4"}


def _job(cloud: Cloud, name: str, *phases: str) -> JobOut:
    def check() -> JobOut | None:
        job = cloud.client.get_job(name)
        return job if job.phase in phases else None

    return wait_for(check, 60, f"job {name} to be {' or '.join(phases)}")


def test_a_two_node_job_runs_with_the_rendezvous_env_and_a_four_node_job_waits(
    cloud: Cloud, images: PushedImages
) -> None:
    for name, address in ADDRESSES.items():
        cloud.agent(name, address=address)
    cloud.client.create_job({"name": "train", "image": images.busybox, "nodes": 2,
                             "gpus_per_node": 8, "command": ["sh", "-c", PRINT_ENV]})
    job = _job(cloud, "train", "Succeeded", "Failed")
    assert job.phase == "Succeeded", job
    addresses = [m.address for m in job.members]
    assert len(set(addresses)) == 2 and all(a in ADDRESSES.values() for a in addresses)
    master, port = addresses[0], job.master_port
    logs = wait_for(lambda: (text := cloud.client.job_logs("train").text).count("cuda=") == 2
                    and text, 20, "both members' output")
    for member in job.members:
        rank = member.rank
        lines = [line.removeprefix(f"[{rank}] ") for line in logs.splitlines()
                 if line.startswith(f"[{rank}] ")]
        uuids = ",".join(cloud.client.get_pod(member.pod).gpu_uuids)
        assert lines == [
            f"rank={rank} nodes=2 gpus=8 master={master}:{port} "
            f"pet={rank}/2/8@{master}:{port}",
            " ".join(addresses) + " ",
            f"cuda={uuids}",
        ]
        reasons = [e.reason for e in cloud.client.pod_events(member.pod)]
        assert reasons.index("Ready") < reasons.index("Started")

    cloud.client.create_job({"name": "huge", "image": images.busybox, "nodes": 4,
                             "gpus_per_node": 8, "command": ["true"]})
    why = wait_for(lambda: (answer := cloud.client.job_why("huge")).reasons and answer, 20,
                   "the scheduler to look at the 4-node job")
    assert why.summary == "needs 4 nodes with 8 free GPUs each, 3 have them"
    huge = cloud.client.get_job("huge")
    assert huge.phase == "Pending" and all(m.node is None for m in huge.members)
    assert all(n.gpus_allocated == 0 for n in cloud.client.list_nodes())
