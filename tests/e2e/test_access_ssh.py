"""Getting into a real pod (runc, real agent) with the real OpenSSH client through the
server's SSH gateway, and with `gpucloud pod exec` through the exec WebSocket."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpucloud.core.models import PodOut
from tests.e2e.cluster import ADMIN_KEY, Cloud, running_cloud, wait_for
from tests.e2e.conftest import PushedImages
from tests.fixtures.openssh import OpenSsh
from tests.fixtures.postgres import free_port

HTTPD = ("mkdir -p /www && echo hello-from-pod > /www/index.html && "
         "exec httpd -f -p 8080 -h /www")
BIG = 50 * 1024 * 1024


@dataclass
class SshCloud:
    cloud: Cloud
    ssh: OpenSsh
    pod: PodOut


@pytest.fixture
def ssh_cloud(tmp_path: Path, images: PushedImages) -> Iterator[SshCloud]:
    """A cloud with a gateway, one agent, the admin's SSH key and a running pod ``dev``
    (an HTTP server on 8080, a volume at /workspace)."""
    port = free_port()
    with running_cloud(tmp_path, ssh_port=port) as cloud:
        cloud.agent("node-1")
        user = OpenSsh.for_gateway(tmp_path / "home", tmp_path, port)
        cloud.client.add_ssh_key(user.public_key)
        cloud.create_pod("dev", images.busybox, ["sh", "-c", HTTPD],
                         volume_size="1Gi", volume_path="/workspace")
        pod = cloud.wait_pod("dev", "Running", timeout=60)
        yield SshCloud(cloud, user, pod)


def _ok(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_ssh_scp_and_port_forwards_reach_the_pod(ssh_cloud: SshCloud, tmp_path: Path) -> None:
    ssh, pod = ssh_cloud.ssh, ssh_cloud.pod
    # A command with a PTY: the terminal, TERM, the exit status, and PUBLIC_KEY in the env.
    done = ssh.run(["env", "TERM=xterm-gpucloud", *ssh.ssh(
        pod.id, "-tt", 'tty; echo "term=$TERM"; echo "$PUBLIC_KEY"; exit 3')])
    assert done.returncode == 3, done.stderr
    out = done.stdout.decode()
    assert "/dev/pts/" in out and "term=xterm-gpucloud" in out
    assert ssh.public_key.split()[1] in out
    # Without a PTY, stdout and stderr stay apart; RunPod's user name form works too.
    done = ssh.run(ssh.ssh(f"{pod.id}-abcdef", "echo out; echo err >&2; exit 0"))
    assert (done.returncode, done.stdout, done.stderr) == (0, b"out\n", b"err\n")
    # scp (SFTP in OpenSSH 9) of 50 MB into the volume, read back by sha256sum.
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(BIG))
    _ok(ssh.run(ssh.scp(str(blob), ssh.remote("dev", "/workspace/blob.bin")), timeout=120))
    remote = _ok(ssh.run(ssh.ssh("dev", "sha256sum /workspace/blob.bin")))
    assert remote.split()[0] == hashlib.sha256(blob.read_bytes()).hexdigest()
    # ssh -L to the pod's HTTP server.
    local = free_port()
    with _background(ssh.ssh("dev", "-N", "-L", f"127.0.0.1:{local}:localhost:8080")):
        wait_for(lambda: _get(local), 20, "the forward to answer")
        assert _get(local) == "hello-from-pod\n"


def test_window_changes_reach_the_pods_terminal(ssh_cloud: SshCloud) -> None:
    """An interactive ssh on a real terminal: its size, then a resize (SIGWINCH). Each
    line typed prints the size again: runc applies a resize asynchronously, so the test
    types until the new size shows."""
    ssh = ssh_cloud.ssh
    master, slave = pty.openpty()
    _set_size(slave, 30, 100)
    process = subprocess.Popen(
        ssh.ssh("dev", "-tt", "stty size; while read line; do stty size; done; exit 5"),
        stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = bytearray()
    try:
        _read_until(master, seen, b"30 100")
        _set_size(master, 40, 120)
        process.send_signal(signal.SIGWINCH)
        _read_until(master, seen, b"40 120", type_each_poll=b"\r")
        os.write(master, b"\x04")  # ^D: end of input, the loop ends, the shell exits 5
        assert process.wait(20) == 5
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def test_pod_exec_streams_and_returns_the_exit_code(ssh_cloud: SshCloud) -> None:
    env = {**os.environ, "GPUCLOUD_URL": ssh_cloud.cloud.url, "GPUCLOUD_API_KEY": ADMIN_KEY}
    cli = [sys.executable, "-m", "gpucloud.cli.main", "pod", "exec"]
    done = subprocess.run([*cli, "dev", "--", "sh", "-c", "echo out; echo err >&2; exit 7"],
                          env=env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    piped = subprocess.run([*cli, "dev", "-i", "--", "sha256sum"], env=env, input=b"x" * 100000,
                           capture_output=True, timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.split()[0].decode() == hashlib.sha256(b"x" * 100000).hexdigest()
    missing = subprocess.run([*cli, "nope", "--", "true"], env=env, capture_output=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    assert missing.returncode == 1 and missing.stderr == b"error: pod 'nope' not found\n"


def test_another_projects_key_a_dropped_client_and_a_stopped_pod(ssh_cloud: SshCloud,
                                                                tmp_path: Path) -> None:
    cloud, ssh, pod = ssh_cloud.cloud, ssh_cloud.ssh, ssh_cloud.pod
    team = cloud.client.create_project("team-b").key.key
    other = OpenSsh.for_gateway(tmp_path / "home", tmp_path, ssh.port, "other")
    with httpx.Client(base_url=cloud.url, headers={"Authorization": f"Bearer {team}"}) as b:
        b.post("/v1/ssh-keys", json={"public_key": other.public_key}).raise_for_status()
    denied = other.run(other.ssh(pod.id, "true"))
    assert denied.returncode == 255 and b"Permission denied" in denied.stderr
    # A client killed in the middle of an upload does not hurt the gateway.
    upload = subprocess.Popen(ssh.ssh("dev", "cat > /tmp/partial"), stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert upload.stdin is not None
    upload.stdin.write(os.urandom(4 * 1024 * 1024))
    upload.kill()
    upload.wait(10)
    assert _ok(ssh.run(ssh.ssh("dev", "echo still-here"))) == "still-here\n"
    cloud.client.stop_pod("dev")
    cloud.wait_pod("dev", "Stopped")
    stopped = ssh.run(ssh.ssh("dev", "true"))
    assert stopped.returncode == 1
    assert stopped.stderr.decode().splitlines() == [
        "pod dev is Stopped; start it with `gpucloud pod start dev`"]


class _background:
    """A process for the duration of a ``with`` block."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def __enter__(self) -> subprocess.Popen[bytes]:
        return self.process

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.wait(10)


def _get(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text
    except httpx.HTTPError:
        return None


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _read_until(fd: int, seen: bytearray, needle: bytes, type_each_poll: bytes = b"") -> None:
    def check() -> bool:
        if type_each_poll:
            os.write(fd, type_each_poll)
        readable, _, _ = select.select([fd], [], [], 0.2)
        if readable:
            with contextlib.suppress(OSError):
                seen.extend(os.read(fd, 4096))
        return needle in seen

    wait_for(check, 20, f"{needle!r} on the terminal (saw {bytes(seen)!r})")
