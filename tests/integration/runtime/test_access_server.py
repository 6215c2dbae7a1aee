"""The agent's access server with a real runc container and the real OpenSSH client.

Each test reaches a busybox container (host networking, so the pod's address is
127.0.0.1) through ``AccessServer`` on 127.0.0.1:0, as the control plane's gateway does:
user name = pod id, the gateway's key.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from gpucloud.agent.access import pod_addresses
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from tests.fixtures.openssh import keygen
from tests.fixtures.postgres import free_port
from tests.integration.runtime.access_testing import AccessClient, access_server
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.root

POD_ID = "0123456789abcdef0123456789abcdef"
CID = f"{POD_ID}-1"


@dataclass
class Pod(AccessClient):
    http_port: int
    tmp: Path

    def ssh_argv(self, *args: str, user: str = POD_ID, key: Path | None = None) -> list[str]:
        return ["ssh", *self.ssh_options(key), "-p", str(self.port), f"{user}@127.0.0.1",
                *args]

    def ssh(self, *args: str, user: str = POD_ID, key: Path | None = None,
            stdin: bytes = b"", timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self.ssh_argv(*args, user=user, key=key), input=stdin,
                              capture_output=True, timeout=timeout, check=False)

    def ssh_in_background(self, command: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.ssh_argv("--", command), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def pod(driver: RuncDriver, busybox_rootfs: Path, tmp_path: Path) -> Iterator[Pod]:
    http_port = free_port()
    script = ("mkdir -p /www && echo hello-from-pod > /www/index.html && "
              f"httpd -p 127.0.0.1:{http_port} -h /www && "
              "while true; do sleep 1; done")
    driver.build(ContainerSpec(CID, "pod", command=("sh", "-c", script), host_network=True),
                 busybox_rootfs, ImageConfig(working_dir="/tmp"))
    driver.start(CID)
    with access_server(driver, CID, tmp_path) as (server, key):
        yield Pod(server, key, POD_ID, http_port, tmp_path)


def test_exec_returns_output_stderr_and_exit_code(pod: Pod) -> None:
    result = pod.ssh("--", "echo out; pwd; echo err >&2; exit 3")
    assert result.returncode == 3, result.stderr
    assert result.stdout == b"out\n/tmp\n"
    assert result.stderr == b"err\n"


def test_exec_streams_stdin_until_eof(pod: Pod) -> None:
    data = os.urandom(300_000)
    result = pod.ssh("--", "cat | sha256sum", stdin=data)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_tty_with_a_command_gets_a_pty(pod: Pod) -> None:
    result = pod.ssh("-tt", "--", "tty; echo TERM=$TERM; stty size")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().replace("\r", "").splitlines()
    assert lines[0].startswith("/dev/pts/")
    assert lines[1].startswith("TERM=") and lines[1] != "TERM="
    assert len(lines[2].split()) == 2


def test_pty_size_and_window_change_reach_the_container(pod: Pod) -> None:
    async def session() -> str:
        async with pod.connect() as conn:
            # A resize reaches the pod's terminal asynchronously (runc applies it on
            # SIGWINCH), as on any terminal: the script waits for it, boundedly.
            process = await conn.create_process(
                "stty size; read line; i=0; while [ \"$(stty size)\" != '50 132' ] && "
                "[ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done; stty size; exit 5",
                term_type="vt100", term_size=(100, 40), encoding=None)
            first = await process.stdout.readuntil(b"\n")
            process.change_terminal_size(132, 50)
            await asyncio.sleep(0)  # the window-change goes out before the line
            process.stdin.write(b"go\r")
            rest = await process.stdout.read()
            await process.wait()
            assert process.exit_status == 5
            return bytes(first + rest).decode()

    output = asyncio.run(session()).replace("\r", "")
    assert "40 100\n" in output
    assert output.rstrip().endswith("50 132")


def test_scp_and_sftp_move_files_into_and_out_of_the_container(pod: Pod) -> None:
    payload = pod.tmp / "payload.bin"
    payload.write_bytes(os.urandom(6 * 1024 * 1024 + 123))
    digest = hashlib.sha256(payload.read_bytes()).hexdigest()
    scp = subprocess.run(["scp", "-q", *pod.ssh_options(), "-P", str(pod.port), str(payload),
                          f"{POD_ID}@127.0.0.1:/root/payload.bin"],
                         capture_output=True, timeout=60, check=False)
    assert scp.returncode == 0, scp.stderr
    assert pod.ssh("--", "sha256sum /root/payload.bin").stdout.split()[0].decode() == digest

    back = pod.tmp / "back.bin"
    batch = pod.tmp / "batch"
    batch.write_text(f"mkdir /root/d\nrename /root/payload.bin /root/d/p.bin\n"
                     f"get /root/d/p.bin {back}\nls /root/d\n")
    sftp = subprocess.run(["sftp", *pod.ssh_options(), "-P", str(pod.port), "-b", str(batch),
                           f"{POD_ID}@127.0.0.1"], capture_output=True, timeout=60,
                          check=False)
    assert sftp.returncode == 0, sftp.stderr
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
    assert b"/root/d/p.bin" in sftp.stdout


def test_sftp_is_confined_to_the_container_root(pod: Pod) -> None:
    assert pod.ssh("--", "ln -s /etc/passwd /tmp/pw").returncode == 0
    copy = pod.tmp / "pw"
    scp = subprocess.run(["scp", "-q", *pod.ssh_options(), "-P", str(pod.port),
                          f"{POD_ID}@127.0.0.1:/tmp/pw", str(copy)],
                         capture_output=True, timeout=30, check=False)
    assert scp.returncode == 0, scp.stderr
    assert copy.read_text().startswith("root:x:0:0:root:/root:/bin/sh\napp:x:1000")


def test_local_forward_reaches_a_server_in_the_pod(pod: Pod) -> None:
    with pod.forward("localhost", pod.http_port) as local, \
            urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as response:
        assert response.read() == b"hello-from-pod\n"


def test_forward_to_another_host_is_refused(pod: Pod) -> None:
    async def attempt() -> str:
        async with pod.connect() as conn:
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.open_connection("192.0.2.1", pod.http_port)
            return refused.value.reason

    assert "own ports" in asyncio.run(attempt())


def test_other_keys_and_unknown_pods_are_denied(pod: Pod) -> None:
    stranger = pod.tmp / "stranger"
    keygen(stranger)
    denied = pod.ssh("--", "true", key=stranger)
    assert denied.returncode == 255 and b"Permission denied" in denied.stderr
    unknown = pod.ssh("--", "true", user="f" * 32)
    assert unknown.returncode == 255 and b"Permission denied" in unknown.stderr


def test_a_client_that_vanishes_takes_its_process_along(pod: Pod) -> None:
    client = pod.ssh_in_background("sleep 4321 & sleep 4322")
    wait_until(lambda: len(sleepers()) == 2, timeout=15, what="the remote sleeps")
    client.kill()
    client.wait()
    wait_until(lambda: not sleepers(), timeout=15, what="the remote sleeps to end")
    # and the server still serves
    assert pod.ssh("--", "echo still here").stdout == b"still here\n"


def sleepers() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if cmdline in (b"sleep\x004321\x00", b"sleep\x004322\x00") and state != "Z":
                found.append(int(entry.name))
    return found


def test_stopping_the_server_ends_sessions(pod: Pod) -> None:
    client = pod.ssh_in_background("sleep 4321")
    wait_until(lambda: len(sleepers()) == 1, timeout=15, what="the remote sleep")
    started = time.monotonic()
    pod.server.stop()
    assert client.wait(15) == 255
    assert time.monotonic() - started < 10
    wait_until(lambda: not sleepers(), timeout=15, what="the remote sleep to end")


def test_forward_destinations_follow_network_json(pod: Pod) -> None:
    driver = pod.server.driver
    document = driver.paths(CID).root / "network.json"
    assert pod_addresses(driver, CID) == ("127.0.0.1", {"localhost", "127.0.0.1", "::1"})
    document.write_text('{"ip": "10.77.0.5", "host_network": false}')
    assert pod_addresses(driver, CID) == (
        "10.77.0.5", {"localhost", "127.0.0.1", "::1", "10.77.0.5"})
    document.write_text('{"ip": "192.0.2.7", "host_network": true}')
    assert pod_addresses(driver, CID) == (
        "127.0.0.1", {"localhost", "127.0.0.1", "::1", "192.0.2.7"})


def test_a_shell_is_a_login_shell_with_the_exit_status(pod: Pod) -> None:
    async def session() -> tuple[str, int | None]:
        async with pod.connect() as conn:
            process = await conn.create_process(term_type="xterm", encoding=None)
            process.stdin.write(b"echo shell=$0; exit 7\r")
            output = await process.stdout.read()
            await process.wait()
            return bytes(output).decode(), process.exit_status

    output, status = asyncio.run(session())
    assert status == 7
    lines = output.replace("\r", "").splitlines()
    assert "shell=sh" in lines  # busybox has no bash: sh (-l)
    assert any(line.startswith("/tmp # ") for line in lines)  # interactive, in the cwd
