"""Copying a pod's volume disk from node to node (``pod start --migrate``), agent to agent.

Source: the access server accepts the SSH user ``volume-<pod id>`` only with the key the
server's assignments name for that pod (``AssignmentsOut.volume_exports``: the
destination's access host key), and only the command ``gpucloud-volume-export``: it
streams ``tar`` of ``<state-dir>/volumes/<pod id>`` on stdout, then writes
``sha256 <hex> <bytes>`` of that stream on stderr and exits 0.

Destination: before the container is built, the pod worker calls ``VolumeReceiver.receive``
when the assignment names a ``volume_source``. It logs in with its own access host key,
pinned to the source's registered host key, unpacks the stream into
``<state-dir>/volumes-incoming/<pod id>`` (outside ``volumes/``, which the collector
sweeps) while hashing it, and only when its own sha256 and size equal the source's does
it rename the directory into ``volumes/`` — the volume counts as present from then on.
It then reports ``VolumeMigrated`` (size and digest); the server moves the pod's pin and
the source deletes its copy. A failure is reported too (``VolumeMigrationFailed: …``) and
ends the attempt; the source keeps the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from gpucloud.agent.connection import Connection
from gpucloud.client.sdk import AgentClient
from gpucloud.core.models import (
    AgentPodStatusRequest,
    AssignmentOut,
    VolumeExport,
    VolumeMigrationReport,
    VolumeSource,
)
from gpucloud.core.phases import PodPhase
from gpucloud.runtime.errors import RuntimeFailure

log = logging.getLogger(__name__)
EXPORT_COMMAND = "gpucloud-volume-export"
USER_PREFIX = "volume-"
CHUNK_BYTES = 256 * 1024
CONNECT_TIMEOUT_SECONDS = 10.0
#: How long a destination keeps asking while the source has not yet been told it may
#: fetch (its next assignments poll): permission denied is retried until then.
AUTH_WAIT_SECONDS = 30.0
AUTH_RETRY_SECONDS = 0.5
_USER = re.compile(rf"^{USER_PREFIX}([0-9a-f]{{32}})$")
_DIGEST_LINE = re.compile(rb"^sha256 ([0-9a-f]{64}) (\d+)$")


def export_user(pod_id: str) -> str:
    return f"{USER_PREFIX}{pod_id}"


def exported_pod(username: str) -> str | None:
    """The pod id of a ``volume-<pod id>`` login, else None."""
    match = _USER.match(username)
    return match.group(1) if match else None


class MigrationFailed(RuntimeFailure):
    """The copy did not arrive whole; the message is the pod's reason."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"VolumeMigrationFailed: {detail}")
        self.detail = detail


# -- the source ----------------------------------------------------------------------------

class VolumeExports:
    """The volume disks this node may hand out now, and to whom (from the assignments)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}

    def update(self, exports: list[VolumeExport]) -> None:
        keys = {}
        for export in exports:
            try:
                keys[export.pod_id] = asyncssh.import_public_key(export.peer_key).public_data
            except (asyncssh.KeyImportError, ValueError):
                log.warning("volume export of pod %s: the peer key does not parse",
                            export.pod_id)
        with self._lock:
            self._keys = keys

    def allows(self, pod_id: str, key: bytes) -> bool:
        with self._lock:
            return self._keys.get(pod_id) == key and self.disk(pod_id).is_dir()

    def disk(self, pod_id: str) -> Path:
        return self.root / pod_id


async def serve_export(exports: VolumeExports, pod_id: str,
                       stdin: asyncssh.SSHReader[bytes], stdout: asyncssh.SSHWriter[bytes],
                       stderr: asyncssh.SSHWriter[bytes]) -> None:
    """One ``volume-<pod id>`` session: the tar stream, then its digest (see module doc)."""
    del stdin
    channel = stdout.channel
    assert isinstance(channel, asyncssh.SSHServerChannel)
    if channel.get_command() != EXPORT_COMMAND:
        stderr.write(f"only {EXPORT_COMMAND} runs here\n".encode())
        channel.exit(2)
        return
    disk = exports.disk(pod_id)
    tar = await asyncio.create_subprocess_exec(
        "tar", "--numeric-owner", "--xattrs", "-C", str(disk), "-cf", "-", ".",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        digest, size = await _relay(tar, stdout)
        errors = (await _read_all(tar.stderr)).decode(errors="replace").strip()
        code = await tar.wait()
    finally:
        if tar.returncode is None:
            tar.kill()
            await tar.wait()
    if code != 0:
        log.warning("volume export of pod %s: tar exited %d", pod_id, code)
        stderr.write(f"tar failed ({code}): {errors[-300:]}\n".encode())
        channel.exit(1)
        return
    log.info("volume of pod %s sent: %d bytes", pod_id, size)
    stderr.write(f"sha256 {digest} {size}\n".encode())
    channel.exit(0)


async def _relay(tar: asyncio.subprocess.Process,
                 out: asyncssh.SSHWriter[bytes]) -> tuple[str, int]:
    assert tar.stdout is not None
    digest, size = hashlib.sha256(), 0
    while chunk := await tar.stdout.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
        out.write(chunk)
        await out.drain()
    return digest.hexdigest(), size


async def _read_all(stream: asyncio.StreamReader | None) -> bytes:
    return await stream.read() if stream is not None else b""


# -- the destination -----------------------------------------------------------------------

@dataclass(frozen=True)
class Fetched:
    size_bytes: int
    sha256: str


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise MigrationFailed(f"the source's access endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_digest(text: bytes) -> tuple[str, int] | None:
    """The source's ``sha256 <hex> <bytes>`` line (its last stderr line), if any."""
    lines = text.strip().splitlines()
    match = _DIGEST_LINE.match(lines[-1].strip()) if lines else None
    return (match.group(1).decode(), int(match.group(2))) if match else None


async def _connect(source: VolumeSource, pod_id: str, key: asyncssh.SSHKey,
                   auth_wait: float) -> asyncssh.SSHClientConnection:
    """Log in to the source; permission denied is retried for a while (the source learns
    from its next assignments that this node may fetch)."""
    host, port = split_endpoint(source.endpoint)
    pinned = asyncssh.import_public_key(source.host_key)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + auth_wait
    while True:
        try:
            return await asyncssh.connect(
                host, port, username=export_user(pod_id), client_keys=[key],
                known_hosts=([pinned], [], []), agent_path=None, config=[],
                password_auth=False, kbdint_auth=False, preferred_auth="publickey",
                connect_timeout=CONNECT_TIMEOUT_SECONDS)
        except asyncssh.PermissionDenied:
            if loop.time() >= deadline:
                raise MigrationFailed(f"source node {source.node} refused the copy (it does "
                                      "not hold the volume, or was not told of this node)"
                                      ) from None
            await asyncio.sleep(AUTH_RETRY_SECONDS)
        except (OSError, asyncssh.Error) as error:
            raise MigrationFailed(f"source node {source.node} unreachable at "
                                  f"{source.endpoint}: {_describe(error)}") from None


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncssh.Error):
        return error.reason
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


async def fetch(source: VolumeSource, pod_id: str, key: asyncssh.SSHKey, into: Path,
                auth_wait: float = AUTH_WAIT_SECONDS) -> Fetched:
    """Unpack the source's stream into ``into`` (a new directory), checked by digest."""
    conn = await _connect(source, pod_id, key, auth_wait)
    async with conn:
        try:
            process = await conn.create_process(EXPORT_COMMAND, encoding=None)
        except (OSError, asyncssh.Error) as error:
            raise MigrationFailed(f"source node {source.node}: {_describe(error)}") from None
        into.mkdir(parents=True)
        tar = await asyncio.create_subprocess_exec(
            "tar", "--numeric-owner", "--xattrs", "-xpf", "-", "-C", str(into),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        try:
            digest, size = await _unpack(process, tar)
        finally:
            if tar.returncode is None:
                tar.kill()
                await tar.wait()
        said = await process.stderr.read()
        await process.wait()
    return _checked(source, digest, size, said, process.exit_status)


async def _unpack(process: asyncssh.SSHClientProcess[bytes],
                  tar: asyncio.subprocess.Process) -> tuple[str, int]:
    assert tar.stdin is not None
    digest, size = hashlib.sha256(), 0
    try:
        while chunk := await process.stdout.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            tar.stdin.write(chunk)
            await tar.stdin.drain()
        tar.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # tar gave up: its exit status says why
    except (OSError, asyncssh.Error) as error:
        raise MigrationFailed(f"the copy broke off after {size} bytes: "
                              f"{_describe(error)}") from None
    errors = (await _read_all(tar.stderr)).decode(errors="replace").strip()
    if await tar.wait() != 0:
        raise MigrationFailed(f"unpacking the volume failed: {errors[-300:] or 'tar failed'}")
    return digest.hexdigest(), size


def _checked(source: VolumeSource, digest: str, size: int, said: bytes,
             status: int | None) -> Fetched:
    claimed = parse_digest(said)
    if status != 0 or claimed is None:
        reason = said.decode(errors="replace").strip()[-300:] or f"exit status {status}"
        raise MigrationFailed(f"source node {source.node} could not send the volume: {reason}")
    if claimed != (digest, size):
        raise MigrationFailed(f"digest mismatch: node {source.node} sent sha256 {claimed[0]} "
                              f"({claimed[1]} bytes), this node received {digest} ({size} bytes)")
    return Fetched(size, digest)


class VolumeReceiver:
    """The destination's side, for pod workers: fetch, check, move in place, report."""

    def __init__(self, conn: Connection, key: asyncssh.SSHKey, state_dir: Path) -> None:
        self.conn = conn
        self.key = key
        self.root = state_dir / "volumes"
        self.incoming = state_dir / "volumes-incoming"

    def receive(self, assignment: AssignmentOut) -> Fetched | None:
        """Copy the pod's volume disk here if its assignment says it is elsewhere; raises
        MigrationFailed (after reporting it) when the copy fails."""
        source = assignment.volume_source
        if source is None:
            return None
        pod_id = assignment.pod_id
        staging = self.incoming / pod_id
        shutil.rmtree(staging, ignore_errors=True)
        try:
            fetched = asyncio.run(fetch(source, pod_id, self.key, staging))
        except MigrationFailed as failure:
            shutil.rmtree(staging, ignore_errors=True)
            self._report(assignment, VolumeMigrationReport(source_node=source.node,
                                                           error=failure.detail))
            raise
        self._install(pod_id, staging)
        log.info("volume of pod %s copied from node %s: %d bytes, sha256 %s", assignment.name,
                 source.node, fetched.size_bytes, fetched.sha256)
        self._report(assignment, VolumeMigrationReport(
            source_node=source.node, size_bytes=fetched.size_bytes, sha256=fetched.sha256))
        return fetched

    def _install(self, pod_id: str, staging: Path) -> None:
        """The checked copy becomes the pod's disk (any older directory here is stale: the
        source was authoritative until now)."""
        target = self.root / pod_id
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)

    def _report(self, assignment: AssignmentOut, report: VolumeMigrationReport) -> None:
        def send(client: AgentClient, token: int) -> str:
            return client.report_status(assignment.pod_id, AgentPodStatusRequest(
                fencing_token=token, phase=PodPhase.PULLING, attempt=assignment.attempt,
                volume_migration=report))

        self.conn.write(f"volume migration of pod {assignment.name}", send)
