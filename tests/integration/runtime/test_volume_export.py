"""The volume export of the agent's access server and the destination's fetch, over real
SSH on 127.0.0.1: only the named destination key gets the disk, the copy is exact (owners,
modes, symlinks, empty dirs) and checked by sha256, failures say what went wrong."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from gpucloud.agent.access import AccessServer
from gpucloud.agent.migration import (
    EXPORT_COMMAND,
    MigrationFailed,
    VolumeExports,
    export_user,
    fetch,
    parse_digest,
)
from gpucloud.core.models import VolumeExport, VolumeSource
from gpucloud.runtime.driver import RuncDriver
from tests.fixtures.postgres import free_port

pytestmark = pytest.mark.root

POD_ID = "0123456789abcdef0123456789abcdef"


def public_line(key: asyncssh.SSHKey) -> str:
    return key.export_public_key("openssh").decode().strip()


@dataclass
class Source:
    server: AccessServer
    exports: VolumeExports
    disk: Path
    peer: asyncssh.SSHKey

    def source(self) -> VolumeSource:
        return VolumeSource(node="gpu-a", endpoint=self.server.endpoint,
                            host_key=self.server.host_public_key)


@pytest.fixture
def source(tmp_path: Path) -> Iterator[Source]:
    state = tmp_path / "a"
    disk = state / "volumes" / POD_ID
    (disk / "d" / "empty").mkdir(parents=True)
    (disk / "x").write_text("moved-data\n")
    (disk / "blob").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (disk / "d" / "link").symlink_to("../x")
    (disk / "d" / "app").write_text("owned\n")
    os.chown(disk / "d" / "app", 1000, 1000)
    os.chmod(disk / "d" / "app", 0o640)
    exports = VolumeExports(state / "volumes")
    driver = RuncDriver(state)
    server = AccessServer(driver, lambda pod_id: None, host_key_path=state / "access_host_key",
                          python=sys.executable, exports=exports)
    server.start()
    peer = asyncssh.generate_private_key("ssh-ed25519")
    exports.update([VolumeExport(pod_id=POD_ID, peer_node="gpu-b", peer_key=public_line(peer))])
    try:
        yield Source(server, exports, disk, peer)
    finally:
        server.stop()


def tree(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under root: mode, uid, gid and its content digest or link target."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            what = f"-> {os.readlink(path)}"
        elif path.is_file():
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = "dir"
        found[str(path.relative_to(root))] = (info.st_mode, info.st_uid, info.st_gid, what)
    return found


def test_the_named_destination_gets_an_exact_copy_checked_by_digest(
    source: Source, tmp_path: Path
) -> None:
    into = tmp_path / "b" / "incoming"
    fetched = asyncio.run(fetch(source.source(), POD_ID, source.peer, into, auth_wait=0))
    assert tree(into) == tree(source.disk)
    assert fetched.size_bytes > 3 * 1024 * 1024
    assert len(fetched.sha256) == 64


def test_other_keys_users_and_commands_get_nothing(source: Source, tmp_path: Path) -> None:
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(MigrationFailed, match="source node gpu-a refused the copy"):
        asyncio.run(fetch(source.source(), POD_ID, stranger, tmp_path / "s", auth_wait=0))
    other_pod = "f" * 32
    with pytest.raises(MigrationFailed, match="refused"):
        asyncio.run(fetch(source.source(), other_pod, source.peer, tmp_path / "o",
                          auth_wait=0))
    assert not (tmp_path / "s").exists() and not (tmp_path / "o").exists()

    async def other_command() -> tuple[int | None, str]:
        async with asyncssh.connect(
                "127.0.0.1", source.server.bound_port, username=export_user(POD_ID),
                client_keys=[source.peer], known_hosts=None, config=None) as conn:
            done = await conn.run("cat /etc/shadow", check=False)
            return done.exit_status, str(done.stderr)

    status, stderr = asyncio.run(other_command())
    assert status == 2 and EXPORT_COMMAND in stderr

    async def as_pod_user() -> None:
        async with asyncssh.connect(
                "127.0.0.1", source.server.bound_port, username=POD_ID,
                client_keys=[source.peer], known_hosts=None, config=None):
            pass

    with pytest.raises(asyncssh.PermissionDenied):
        asyncio.run(as_pod_user())


def test_an_export_withdrawn_by_the_server_is_refused(source: Source, tmp_path: Path) -> None:
    source.exports.update([])
    with pytest.raises(MigrationFailed, match="refused"):
        asyncio.run(fetch(source.source(), POD_ID, source.peer, tmp_path / "w", auth_wait=0))


def test_an_unreachable_source_and_a_wrong_host_key_fail_in_one_line(
    source: Source, tmp_path: Path
) -> None:
    gone = VolumeSource(node="gpu-a", endpoint=f"127.0.0.1:{free_port()}",
                        host_key=source.server.host_public_key)
    with pytest.raises(MigrationFailed) as failure:
        asyncio.run(fetch(gone, POD_ID, source.peer, tmp_path / "u", auth_wait=0))
    assert failure.value.message.startswith(
        f"VolumeMigrationFailed: source node gpu-a unreachable at {gone.endpoint}")
    impostor = VolumeSource(node="gpu-a", endpoint=source.server.endpoint,
                            host_key=public_line(asyncssh.generate_private_key("ssh-ed25519")))
    with pytest.raises(MigrationFailed, match="unreachable"):
        asyncio.run(fetch(impostor, POD_ID, source.peer, tmp_path / "i", auth_wait=0))


def test_the_digest_line_is_parsed_strictly() -> None:
    digest = "ab" * 32
    assert parse_digest(f"warning\nsha256 {digest} 10240\n".encode()) == (digest, 10240)
    assert parse_digest(b"sha256 xyz 1\n") is None
    assert parse_digest(b"") is None
