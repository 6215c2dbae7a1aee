"""Pod networks end to end: server + agents + runc. A pod's ``N/tcp`` port is served on a
public port of its node, two pods listen on one private port, ``pod get`` shows the pod's
address and ports, and two members of a job on different agents talk over TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.cli.main import main
from gpucloud.core.jobs import JobOut
from gpucloud.core.models import PodOut
from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages
from tests.fixtures.http import http_get

SERVE = ("mkdir -p /srv && echo \"$HOSTNAME $GPUCLOUD_POD_IP $RUNPOD_PUBLIC_IP "
         "$RUNPOD_TCP_PORT_8000\" > /srv/index.html && exec httpd -f -p 8000 -h /srv")


def networked(cloud: Cloud, name: str) -> PodOut:
    """The pod once it runs and its agent has reported its network."""
    cloud.wait_pod(name, "Running")

    def reported() -> PodOut | None:
        pod = cloud.client.get_pod(name)
        return pod if pod.ports_runtime else None

    return wait_for(reported, 20, f"the network of pod {name}")


def served(port: int, what: str) -> str:
    """The body served at 127.0.0.1:``port``, once something serves it."""
    return wait_for(lambda: http_get("127.0.0.1", port), 20, what)


def test_tcp_ports_are_published_on_the_node_and_two_pods_share_a_private_port(
    cloud: Cloud, images: PushedImages, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent = cloud.agent("node-a")
    for name in ("web-1", "web-2"):
        cloud.create_pod(name, images.busybox, ["sh", "-c", SERVE], ports=["8000/tcp"])
    pods = [networked(cloud, name) for name in ("web-1", "web-2")]
    publics = []
    for pod in pods:
        private = [p for p in pod.ports_runtime if not p.isIpPublic]
        public = [p for p in pod.ports_runtime if p.isIpPublic]
        assert [(p.ip, p.privatePort, p.type) for p in private] == [(pod.ip, 8000, "tcp")]
        assert len(public) == 1 and public[0].ip == "127.0.0.1"
        assert public[0].privatePort == 8000 and public[0].publicPort is not None
        port = public[0].publicPort
        publics.append(port)
        expected = f"{pod.name} {pod.ip} 127.0.0.1 {port}"
        assert served(port, f"{pod.name} through its public port") == expected
        assert pod.ip is not None and http_get(pod.ip, 8000) == expected  # its own address
    assert pods[0].ip != pods[1].ip and publics[0] != publics[1]

    monkeypatch.setenv("GPUCLOUD_URL", cloud.url)
    monkeypatch.setenv("GPUCLOUD_API_KEY", ADMIN_KEY)
    capsys.readouterr()
    assert main(["pod", "get", "web-1"]) == 0
    shown = capsys.readouterr().out
    assert f"{pods[0].ip}:8000/tcp" in shown and f"127.0.0.1:{publics[0]}->8000/tcp" in shown

    record = agent.state_dir / "containers"
    assert any(p.name.startswith(pods[0].id) and (p / "network.json").exists()
               for p in record.iterdir())
    cloud.client.delete_pod("web-1")
    wait_for(lambda: http_get("127.0.0.1", publics[0]) is None, 20,
             "the deleted pod's public port to close")
    wait_for(lambda: not any(p.name.startswith(pods[0].id) for p in record.iterdir())
             and not any(pods[0].id in n.name for n in _netns()), 20,
             "the deleted pod's container and namespace to go")
    assert http_get("127.0.0.1", publics[1]) is not None


def _netns() -> list[Path]:
    directory = Path("/run/netns")
    return list(directory.iterdir()) if directory.is_dir() else []


def _job(cloud: Cloud, name: str, *phases: str) -> JobOut:
    def check() -> JobOut | None:
        job = cloud.client.get_job(name)
        return job if job.phase in phases else None

    return wait_for(check, 60, f"job {name} to be {' or '.join(phases)}")


#: Rank 0 listens on its node's address; rank 1 connects until it is up (the product
#: starts the members together, not a program's listener before the other's connect: a
#: real job's client retries too, as torchrun's does). Rank 0's stdin is a FIFO held open,
#: not the container's /dev/null: busybox ``nc`` at end of its stdin half-closes the
#: connection once accepted, and rank 1's ``nc`` then exits 0 on that end of stream
#: without sending when its ``echo`` has not written into the pipe yet (on a loaded
#: machine): rank 0 got an empty message.
RENDEZVOUS = (
    "if [ \"$GPUCLOUD_NODE_RANK\" = 0 ]; then "
    "  mkfifo /tmp/in && exec 3<>/tmp/in && "
    "  nc -l -p \"$MASTER_PORT\" <&3 > /tmp/got && echo \"rank0 got: $(cat /tmp/got)\"; "
    "else "
    "  i=0; until echo \"hello from rank $GPUCLOUD_NODE_RANK\" | nc \"$MASTER_ADDR\" "
    "\"$MASTER_PORT\"; do i=$((i+1)); [ $i -gt 100 ] && exit 3; sleep 0.1; done; "
    "  echo rank1 sent; "
    "fi")


def test_members_of_a_job_on_different_agents_talk_over_tcp(
    cloud: Cloud, images: PushedImages
) -> None:
    cloud.agent("dgx-a", address="127.0.0.2")
    cloud.agent("dgx-b", address="127.0.0.3")
    cloud.client.create_job({"name": "talk", "image": images.busybox, "nodes": 2,
                             "gpus_per_node": 8, "command": ["sh", "-c", RENDEZVOUS]})
    job = _job(cloud, "talk", "Succeeded", "Failed")
    assert job.phase == "Succeeded", job
    assert len({m.node for m in job.members}) == 2
    def output() -> str | None:
        text = cloud.client.job_logs("talk").text
        return text if "rank0 got" in text else None

    logs = wait_for(output, 20, "the members' output")
    assert "[0] rank0 got: hello from rank 1" in logs and "[1] rank1 sent" in logs


def test_a_restarted_agent_keeps_the_pods_address_and_public_port(
    patient_cloud: Cloud, images: PushedImages
) -> None:
    cloud = patient_cloud
    agent = cloud.agent("node-r")
    cloud.create_pod("kept", images.busybox, ["sh", "-c", SERVE], ports=["8000/tcp"])
    pod = networked(cloud, "kept")
    port = next(p.publicPort for p in pod.ports_runtime if p.isIpPublic)
    assert port is not None
    expected = f"kept {pod.ip} 127.0.0.1 {port}"
    assert served(port, "the pod's public port") == expected
    agent.kill()  # a crash: the container and its namespace stay, the listener goes
    assert http_get("127.0.0.1", port) is None
    agent.start()
    assert served(port, "the adopted pod's public port") == expected
    again = cloud.client.get_pod("kept")
    assert again.phase == "Running" and again.ip == pod.ip
