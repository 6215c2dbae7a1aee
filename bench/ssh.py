"""Benchmark: scp throughput through the SSH gateway vs scp straight to a local sshd.

Through the gateway: the real OpenSSH ``scp`` (SFTP, as in OpenSSH 9) → the server's
gateway (asyncssh) → the agent's access server (asyncssh) → an SFTP server chrooted in a
busybox runc pod, writing to the pod's volume. Straight: the same ``scp`` to Debian's
``/usr/sbin/sshd``, started here on a loopback port with its own config, host key and
authorized key, writing to a local directory. The server (SQLite) runs on a thread of
this process, one agent as a process; this process only waits for ``scp`` meanwhile.
Rounds alternate gateway / direct so that drift hits both alike; the median is reported.
Target: gateway >= 0.5x direct. Needs root, runc, busybox-static, docker-registry and
openssh-server.

    .venv/bin/python bench/ssh.py [--size-mb 200] [--rounds 3]

Writes JSON to bench/results/ssh.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import running_cloud, wait_for  # noqa: E402
from tests.fixtures.openssh import OpenSsh, keygen  # noqa: E402
from tests.fixtures.postgres import free_port  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

from gpucloud.images.testing import busybox_image  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SSHD = Path("/usr/sbin/sshd")
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def sshd_config(workdir: Path, port: int, host_key: Path, authorized: Path) -> Path:
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized}", f"PidFile {workdir / 'sshd.pid'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        f"Subsystem sftp {SFTP_SERVER}", "LogLevel ERROR", ""]))
    return config


@contextmanager
def local_sshd(workdir: Path, user_key: str) -> Iterator[tuple[int, str]]:
    """Debian's sshd on a free loopback port; yields the port and its host key line."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation dir
    host_line = keygen(workdir / "sshd_host_key")
    authorized = workdir / "authorized_keys"
    authorized.write_text(user_key + "\n")
    port = free_port()
    config = sshd_config(workdir, port, workdir / "sshd_host_key", authorized)
    process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _listening(port) or process.poll() is not None, 20, "sshd to listen")
        if process.poll() is not None:
            _, err = process.communicate()
            raise RuntimeError(f"sshd failed: {err.decode().strip()}")
        yield port, host_line
    finally:
        process.terminate()
        process.wait(10)


def _listening(port: int) -> bool:
    with open("/proc/net/tcp") as table:
        return any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
                   for line in table.readlines()[1:])


def timed_scp(client: OpenSsh, source: Path, dest: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(client.scp(str(source), dest), capture_output=True, timeout=600)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"scp to {dest} failed: {done.stderr.decode().strip()}")
    return elapsed


def run(size_mb: int, rounds: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="gpucloud-bench-ssh-"))
    try:
        return _measure(work, size_mb, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, size_mb: int, rounds: int) -> dict[str, object]:
    blob = work / "blob.bin"
    with blob.open("wb") as out:
        for _ in range(size_mb):
            out.write(os.urandom(1024 * 1024))
    ssh_port = free_port()
    with start_registry(work / "registry") as registry, \
            running_cloud(work / "cloud", ssh_port=ssh_port) as cloud:
        busybox_image().push(registry.host, "bench/busybox:1")
        cloud.agent("node-1")
        gateway = OpenSsh.for_gateway(work / "cloud" / "home", work, ssh_port)
        cloud.client.add_ssh_key(gateway.public_key)
        cloud.create_pod("bench", f"{registry.host}/bench/busybox:1", ["sleep", "3600"],
                         volume_size=f"{size_mb * 2 + 100}Mi", volume_path="/workspace")
        cloud.wait_pod("bench", "Running", timeout=60)
        with local_sshd(work, gateway.public_key) as (sshd_port, host_line):
            known = work / "direct.known_hosts"
            known.write_text(f"[127.0.0.1]:{sshd_port} {host_line}\n")
            direct = OpenSsh(gateway.identity, known, sshd_port)
            (work / "direct").mkdir()
            through, straight = [], []
            for _ in range(rounds):
                through.append(timed_scp(gateway, blob, gateway.remote("bench",
                                                                       "/workspace/blob")))
                straight.append(timed_scp(direct, blob, f"root@127.0.0.1:{work / 'direct'}"))
    gateway_mbs = size_mb / statistics.median(through)
    direct_mbs = size_mb / statistics.median(straight)
    return {"benchmark": "ssh-scp-throughput", "size_mb": size_mb, "rounds": rounds,
            "gateway_mb_per_s": round(gateway_mbs, 1), "direct_mb_per_s": round(direct_mbs, 1),
            "ratio": round(gateway_mbs / direct_mbs, 3), "target_ratio": 0.5,
            "gateway_seconds": [round(t, 3) for t in through],
            "direct_seconds": [round(t, 3) for t in straight], "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = run(args.size_mb, args.rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ssh.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
