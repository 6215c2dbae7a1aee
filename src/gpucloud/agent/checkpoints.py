"""A pod's checkpoint directory on this node: restore before the start, upload on commit.

The directory is ``<state-dir>/checkpoints/<key>`` (key: the pod id, ``<job id>-<rank>``
for a job's members), bind-mounted at the pod's ``--checkpoint-dir``. It outlives the
container on this node; what outlives the node is the store.

Commit: the program touches ``.done`` in the directory (``gpucloud-ckpt commit`` does,
and waits). ``CheckpointWatcher`` sees it, snapshots the directory into SHA-256 chunks,
asks the server which chunks the store lacks, uploads those in pieces (resuming a chunk
where the server's copy ends, so a killed agent's next process continues), commits the
manifest, then writes ``.committed`` (the checkpoint id) and removes ``.done``; on a
failure it writes ``.failed`` (why) and removes ``.done``.

Restore: before the container starts, the newest committed checkpoint is fetched into a
fresh directory beside the kept one, every chunk's digest checked; a bad or missing chunk
makes the server mark that checkpoint corrupt (an event says why) and the previous one is
tried. The fetched tree then replaces the directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpucloud.agent.connection import Connection
from gpucloud.client.sdk import AgentClient
from gpucloud.core.checkpoints import (
    CHUNK_BYTES,
    COMMITTED_MARKER,
    DONE_MARKER,
    ENV_CHECKPOINT_DIR,
    FAILED_MARKER,
    MARKERS,
    AgentCheckpointRequest,
    CheckpointCommitRequest,
    CheckpointMissingRequest,
    CheckpointOut,
    CheckpointRejectRequest,
    ChunkUploadOut,
    Manifest,
    ManifestEntry,
)
from gpucloud.core.models import AssignmentOut
from gpucloud.runtime.bundle import BindMount

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Bytes per PUT of a chunk: the unit an interrupted upload loses at most.
PIECE_BYTES = 1024 * 1024
#: How far a marker's time may lag ``time.time()``: file times come from a coarse clock.
MARK_SLACK_SECONDS = 0.02

CKPT_TOOL = r"""#!/bin/sh
# gpucloud-ckpt: commit a checkpoint of $GPUCLOUD_CHECKPOINT_DIR (shipped by the gpucloud
# agent). Usage: gpucloud-ckpt commit [--no-wait] [--timeout SECONDS]
# Touches $GPUCLOUD_CHECKPOINT_DIR/.done; the agent uploads the directory, writes .committed
# (the checkpoint id) and removes .done. Prints the id; exit 1 if the upload failed.
dir="${GPUCLOUD_CHECKPOINT_DIR:-}"
usage="usage: gpucloud-ckpt commit [--no-wait] [--timeout SECONDS]"
[ -n "$dir" ] || { echo "gpucloud-ckpt: no --checkpoint-dir in this pod" >&2; exit 2; }
[ "${1:-}" = commit ] || { echo "$usage" >&2; exit 2; }
shift
wait=1; timeout=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-wait) wait=0 ;;
    --timeout) shift; timeout="${1:-0}" ;;
    *) echo "gpucloud-ckpt: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
rm -f "$dir/.committed" "$dir/.failed"
: > "$dir/.done"
[ "$wait" = 1 ] || exit 0
ticks=0
while [ -e "$dir/.done" ]; do
  sleep 0.1
  ticks=$((ticks + 1))
  if [ "$timeout" != 0 ] && [ "$ticks" -ge $((timeout * 10)) ]; then
    echo "gpucloud-ckpt: not committed after ${timeout}s" >&2; exit 1
  fi
done
if [ -e "$dir/.failed" ]; then
  echo "gpucloud-ckpt: checkpoint failed: $(cat "$dir/.failed")" >&2; exit 1
fi
cat "$dir/.committed"; echo
"""


class CheckpointFailed(Exception):
    """An upload or restore step could not be done (the message says why)."""


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk's bytes are in the snapshotted directory."""

    path: Path
    offset: int
    length: int


def host_dir(state_dir: Path, key: str) -> Path:
    return state_dir / "checkpoints" / key


def binds_and_env(state_dir: Path,
                  assignment: AssignmentOut) -> tuple[tuple[BindMount, ...], dict[str, str]]:
    """The kept directory's bind mount and the variable naming it (none without one)."""
    if assignment.checkpoint_dir is None or assignment.checkpoint_key is None:
        return (), {}
    directory = host_dir(state_dir, assignment.checkpoint_key)
    directory.mkdir(parents=True, exist_ok=True)
    return ((BindMount(directory, assignment.checkpoint_dir),),
            {ENV_CHECKPOINT_DIR: assignment.checkpoint_dir})


def install_tool(run_dir: Path, node_copy: Path | None = None) -> None:
    """``gpucloud-ckpt`` in ``run/bin`` (``/run/gpucloud/bin`` in the container).

    With ``node_copy`` (a path in the agent's state directory) it is a hard link to the
    node's one copy, written once per agent process (``_node_tool``), instead of a file
    written and made executable on every pod's start; ``run/`` is bound read-only, so no
    container can change the file the others share. A link that cannot be made (another
    filesystem, the copy gone) falls back to a copy of its own."""
    target = run_dir / "bin" / "gpucloud-ckpt"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unlinked first, never written through: it may be a link to the shared copy.
    target.unlink(missing_ok=True)
    if node_copy is not None:
        try:
            os.link(_node_tool(node_copy), target)
            return
        except OSError:
            with _NODE_TOOLS_LOCK:
                _NODE_TOOLS.discard(node_copy)  # written again by the next start
    _write_tool(target)


#: The node copies of ``gpucloud-ckpt`` this process wrote (``_node_tool``).
_NODE_TOOLS: set[Path] = set()
_NODE_TOOLS_LOCK = threading.Lock()


def _node_tool(node_copy: Path) -> Path:
    """``node_copy`` holding this agent's ``CKPT_TOOL``: written (to a new file, then
    renamed over the old one, so that containers linked to an older agent's copy keep
    theirs) the first time this process asks."""
    with _NODE_TOOLS_LOCK:
        if node_copy not in _NODE_TOOLS:
            node_copy.parent.mkdir(parents=True, exist_ok=True)
            fresh = node_copy.with_name(f".{node_copy.name}.{os.getpid()}")
            _write_tool(fresh)
            os.replace(fresh, node_copy)
            _NODE_TOOLS.add(node_copy)
    return node_copy


def _write_tool(target: Path) -> None:
    target.write_text(CKPT_TOOL)
    target.chmod(0o755)


# -- snapshots --------------------------------------------------------------------------


def _walk(root: Path) -> Iterator[Path]:
    """Every path under ``root`` in a stable order, top-level markers left out."""
    for current, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        base = Path(current)
        for name in sorted(dirs + files):
            path = base / name
            if base == root and name in MARKERS:
                continue
            yield path


def snapshot(root: Path,
             chunk_bytes: int = CHUNK_BYTES) -> tuple[Manifest, dict[str, ChunkRef]]:
    """The directory as a manifest, and where each distinct chunk's bytes are."""
    entries: list[ManifestEntry] = []
    refs: dict[str, ChunkRef] = {}
    for path in _walk(root):
        info = path.lstat()
        relative = path.relative_to(root).as_posix()
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISLNK(info.st_mode):
            entries.append(ManifestEntry(path=relative, kind="symlink", mode=0o777,
                                         target=os.readlink(path)))
        elif stat.S_ISDIR(info.st_mode):
            entries.append(ManifestEntry(path=relative, kind="dir", mode=mode))
        elif stat.S_ISREG(info.st_mode):
            chunks, size = _chunk_file(path, chunk_bytes, refs)
            entries.append(ManifestEntry(path=relative, kind="file", mode=mode, size=size,
                                         chunks=chunks))
    return Manifest(chunk_bytes=chunk_bytes, entries=entries), refs


def _chunk_file(path: Path, chunk_bytes: int,
                refs: dict[str, ChunkRef]) -> tuple[list[str], int]:
    chunks, offset = [], 0
    with path.open("rb") as source:
        while block := source.read(chunk_bytes):
            digest = hashlib.sha256(block).hexdigest()
            refs.setdefault(digest, ChunkRef(path, offset, len(block)))
            chunks.append(digest)
            offset += len(block)
    return chunks, offset


def read_chunk(ref: ChunkRef, digest: str) -> bytes:
    """The chunk's bytes, as long as the file still holds them."""
    with ref.path.open("rb") as source:
        source.seek(ref.offset)
        data = source.read(ref.length)
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointFailed(f"{ref.path.name} changed while it was being uploaded; "
                               "commit again once it is written")
    return data


# -- talking to the server --------------------------------------------------------------


class PodCheckpoints:
    """One pod attempt's checkpoint calls; every one fenced and retried by ``conn``."""

    def __init__(self, conn: Connection, assignment: AssignmentOut, directory: Path) -> None:
        self.conn = conn
        self.pod_id = assignment.pod_id
        self.name = assignment.name
        self.attempt = assignment.attempt
        self.directory = directory

    def _call(self, what: str, call: Callable[[AgentClient, int], T]) -> T:
        result = self.conn.write(f"{what} of pod {self.name}", call)
        if result is None:
            raise CheckpointFailed(f"the server refused the {what} (see the agent's log)")
        return result

    # upload

    def upload(self, marked_at: float) -> CheckpointOut:
        """Snapshot, send what the store lacks, commit; δ counts from ``marked_at``."""
        manifest, refs = snapshot(self.directory)
        opened = self._call("checkpoint upload", lambda client, token:
                            client.open_checkpoint_upload(self.pod_id, CheckpointMissingRequest(
                                fencing_token=token, attempt=self.attempt,
                                digests=sorted(refs))))
        sent = sum(self._send(digest, refs[digest]) for digest in opened.missing)
        return self._call("checkpoint commit", lambda client, token:
                          client.commit_checkpoint(self.pod_id, CheckpointCommitRequest(
                              fencing_token=token, attempt=self.attempt,
                              upload_id=opened.upload_id, manifest=manifest,
                              cost_seconds=max(0.0, time.time() - marked_at),
                              bytes_sent=sent)))

    def _send(self, digest: str, ref: ChunkRef) -> int:
        """Upload one chunk from where the server's copy ends; returns the bytes sent."""
        status = self._call("chunk status", lambda client, token: client.checkpoint_chunk_status(
            self.pod_id, digest, token, self.attempt))
        if status.complete:
            return 0
        data = read_chunk(ref, digest)
        offset, sent = status.received, 0
        while offset < len(data):
            piece = data[offset:offset + PIECE_BYTES]
            result = self._put(digest, piece, offset, len(data))
            sent += len(piece)
            offset = result.received
            if result.complete:
                break
        return sent

    def _put(self, digest: str, piece: bytes, start: int, total: int) -> ChunkUploadOut:
        def send(client: AgentClient, token: int) -> ChunkUploadOut:
            return client.put_checkpoint_chunk(self.pod_id, digest, piece, start, total, token,
                                               self.attempt)

        return self._call("chunk upload", send)

    # restore

    def restore(self) -> CheckpointOut | None:
        """The newest checkpoint whose chunks all verify, fetched into the directory."""
        listed = self._call("checkpoint list", lambda client, token: client.pod_checkpoints(
            self.pod_id, token, self.attempt))
        for checkpoint in listed:
            try:
                self._fetch(checkpoint)
            except CheckpointFailed as error:
                log.warning("pod %s: checkpoint %s refused: %s", self.name, checkpoint.id, error)
                self._reject(checkpoint.id, str(error))
                continue
            self._restored(checkpoint.id)
            return checkpoint
        return None

    def _reject(self, checkpoint_id: str, reason: str) -> None:
        def send(client: AgentClient, token: int) -> bool:
            client.reject_checkpoint(self.pod_id, checkpoint_id, CheckpointRejectRequest(
                fencing_token=token, attempt=self.attempt, reason=reason[:1000]))
            return True

        self._call("checkpoint rejection", send)

    def _restored(self, checkpoint_id: str) -> None:
        def send(client: AgentClient, token: int) -> bool:
            client.checkpoint_restored(self.pod_id, checkpoint_id, AgentCheckpointRequest(
                fencing_token=token, attempt=self.attempt))
            return True

        self._call("restore report", send)

    def _fetch(self, checkpoint: CheckpointOut) -> None:
        manifest = self._call("manifest", lambda client, token: client.checkpoint_manifest(
            self.pod_id, checkpoint.id, token, self.attempt))
        staging = self.directory.with_name(f".{self.directory.name}.restore")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            _materialize(staging, manifest, self._chunk)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _swap_in(staging, self.directory)

    def _chunk(self, digest: str) -> bytes:
        data = self._call("chunk download", lambda client, token: client.get_checkpoint_chunk(
            self.pod_id, digest, token, self.attempt))
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CheckpointFailed(f"chunk {digest[:16]}… is damaged: {len(data)} bytes with "
                                   f"SHA-256 {actual[:16]}…")
        return data


def _materialize(root: Path, manifest: Manifest, fetch: Callable[[str], bytes]) -> None:
    """Write the manifest's tree under ``root``; a chunk is fetched once, then copied from
    where it was first written."""
    seen: dict[str, ChunkRef] = {}
    for entry in manifest.entries:
        path = root / entry.path
        if entry.kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(entry.mode)
        elif entry.kind == "symlink":
            path.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(entry.target or "", path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_file(path, entry, fetch, seen)
    if manifest.size_bytes != sum(e.size for e in manifest.entries if e.kind == "file"):
        raise CheckpointFailed("the manifest's sizes do not add up")


def _write_file(path: Path, entry: ManifestEntry, fetch: Callable[[str], bytes],
                seen: dict[str, ChunkRef]) -> None:
    offset = 0
    with path.open("wb") as out:
        for digest in entry.chunks:
            ref = seen.get(digest)
            data = read_chunk(ref, digest) if ref is not None else fetch(digest)
            seen.setdefault(digest, ChunkRef(path, offset, len(data)))
            out.write(data)
            out.flush()
            offset += len(data)
    if offset != entry.size:
        raise CheckpointFailed(f"{entry.path} restored to {offset} bytes, not {entry.size}")
    path.chmod(entry.mode)


def _swap_in(staging: Path, directory: Path) -> None:
    """Replace the directory's content with the restored tree (two renames)."""
    old = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


# -- the watcher ------------------------------------------------------------------------


class CheckpointWatcher:
    """Uploads the directory each time the program commits (``.done`` appears)."""

    def __init__(self, checkpoints: PodCheckpoints, interval: float,
                 stop: threading.Event) -> None:
        self.checkpoints = checkpoints
        self.interval = interval
        self._agent_stop = stop
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one upload at a time (watch thread or final)
        #: When the marker of the last committed checkpoint was touched (epoch seconds).
        self._committed_mark: float | None = None
        self.last: CheckpointOut | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"ckpt-{checkpoints.pod_id[:12]}")

    @property
    def marker(self) -> Path:
        return self.checkpoints.directory / DONE_MARKER

    def start(self) -> CheckpointWatcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=60)

    def committed_since(self, t: float) -> bool:
        """Whether a checkpoint the program asked for at or after ``t`` (``time.time()``)
        is committed: it acknowledged a preemption notice by committing. What counts is
        when the marker was touched, not when the upload ended, so a commit already under
        way when the notice came is no acknowledgement. ``MARK_SLACK_SECONDS`` allows for
        the file system's coarse clock. No lock: an upload may hold it for minutes, and
        the pod worker asks from its watch loop."""
        mark = self._committed_mark
        return mark is not None and mark >= t - MARK_SLACK_SECONDS

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and not self._agent_stop.is_set():
            self.flush()

    def flush(self) -> CheckpointOut | None:
        """Upload once if a commit is pending (also the final upload after the exit)."""
        with self._lock:
            mark = _marker_identity(self.marker)
            if mark is None:
                return None
            return self._upload(mark)

    def _upload(self, mark: tuple[int, int]) -> CheckpointOut | None:
        directory = self.checkpoints.directory
        marked_at = mark[1] / 1e9
        try:
            checkpoint = self.checkpoints.upload(marked_at)
        except (CheckpointFailed, OSError) as error:
            log.warning("pod %s: checkpoint upload failed: %s", self.checkpoints.name, error)
            _write_marker(directory / FAILED_MARKER, str(error))
            self._clear_marker(mark)
            return None
        self._committed_mark = marked_at
        self.last = checkpoint
        _write_marker(directory / COMMITTED_MARKER, checkpoint.id)
        self._clear_marker(mark)
        log.info("pod %s: checkpoint %s committed (%d bytes, %d sent)", self.checkpoints.name,
                 checkpoint.id, checkpoint.size_bytes, checkpoint.bytes_sent)
        return checkpoint

    def _clear_marker(self, mark: tuple[int, int]) -> None:
        """Remove the marker this upload answered; one touched again meanwhile (a new
        commit, e.g. on a notice, asked for while this upload ran) stays for the next."""
        if _marker_identity(self.marker) == mark:
            self.marker.unlink(missing_ok=True)


def _marker_identity(marker: Path) -> tuple[int, int] | None:
    """The marker's inode and modification time (ns), None without one."""
    try:
        info = marker.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns


def _write_marker(path: Path, text: str) -> None:
    temporary = path.with_name(f"{path.name}.tmp")
    temporary.write_text(text + "\n")
    temporary.replace(path)
