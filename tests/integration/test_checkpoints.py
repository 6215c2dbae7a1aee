"""Checkpoints through the real agent code (agent/checkpoints) and the real server app
(in process, SQLite and PostgreSQL): chunked upload and dedup, resumable chunk uploads,
digest checks, fencing of old attempts, restore with verification and fallback,
retention and chunk collection, project isolation, the user routes."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from gpucloud.agent.checkpoints import PodCheckpoints, snapshot
from gpucloud.agent.connection import Connection
from gpucloud.agent.identity import IdentityFile
from gpucloud.client.sdk import AgentClient
from gpucloud.core.checkpoints import CHUNK_BYTES, CheckpointMissingRequest
from gpucloud.core.clock import ManualClock
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import AssignmentOut, NodeRegisterRequest
from gpucloud.db.models import ProjectModel
from gpucloud.services import checkpoints as service
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import ThroughTestClient, agent_headers, h100_gpus

MiB = 1024 * 1024


def _connect(api: TestClient, tmp_path: Path, name: str = "gpu-1") -> Connection:
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    registration = NodeRegisterRequest(join_token=token, name=name, cpu_cores=64,
                                       memory_bytes=512 * 1024**3, gpus=h100_gpus())
    conn = Connection("http://testserver", registration, IdentityFile(tmp_path / name),
                      threading.Event(), transport=ThroughTestClient(api))
    conn.connect()
    return conn


def _assignment(conn: Connection, pod_id: str) -> AssignmentOut:
    pods = conn.client.assignments().pods
    return next(a for a in pods if a.pod_id == pod_id)


def _pod(api: TestClient, schedule: Callable[[], Any], conn: Connection,
         name: str = "trainer", **extra: Any) -> AssignmentOut:
    pod = api.post("/v1/pods", json={"name": name, "image": "busybox", "command": ["true"],
                                     "checkpoint_dir": "/ckpt", **extra})
    assert pod.status_code == 201, pod.text
    schedule()
    return _assignment(conn, pod.json()["id"])


def _fill(directory: Path) -> None:
    (directory / "sub").mkdir(parents=True, exist_ok=True)
    (directory / "sub" / "weights.bin").write_bytes(os.urandom(2 * CHUNK_BYTES + 12345))
    (directory / "step").write_text("41\n")
    (directory / "empty").write_bytes(b"")
    (directory / "latest").symlink_to("sub/weights.bin")
    (directory / ".done").write_text("")  # a marker: never part of the checkpoint


def _tree(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(directory.rglob("*")):
        key = path.relative_to(directory).as_posix()
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


@pytest.fixture
def conn(api: TestClient, tmp_path: Path) -> Connection:
    return _connect(api, tmp_path)


def _store_chunks(app_ctx: ServiceContext, project_id: str) -> set[str]:
    return service.store_of(app_ctx).list_chunks(project_id)


def test_upload_dedups_chunks_and_restore_reproduces_the_tree(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
    app_ctx: ServiceContext,
) -> None:
    assignment = _pod(api, schedule, conn)
    assert (assignment.checkpoint_dir, assignment.checkpoint_key) == ("/ckpt",
                                                                      assignment.pod_id)
    assert assignment.restore_checkpoint is None
    source = tmp_path / "source"
    _fill(source)
    pod = PodCheckpoints(conn, assignment, source)
    first = pod.upload(marked_at=time.time())
    size = 2 * CHUNK_BYTES + 12345 + 3
    assert (first.attempt, first.seq, first.state, first.size_bytes) == (1, 1, "committed",
                                                                         size)
    assert first.bytes_sent == size and first.files == 5
    assert first.cost_seconds is not None and first.cost_seconds > 0

    again = pod.upload(marked_at=time.time())  # nothing changed: no chunk is sent twice
    assert (again.seq, again.bytes_sent) == (2, 0)
    with (source / "sub" / "weights.bin").open("r+b") as weights:
        weights.seek(CHUNK_BYTES + 10)
        weights.write(b"changed")
    third = pod.upload(marked_at=time.time())
    assert third.bytes_sent == CHUNK_BYTES  # only the one changed chunk

    listed = api.get("/v1/pods/trainer/checkpoints").json()
    assert [c["seq"] for c in listed] == [3, 2]  # retention: the last two
    project_id = _project_id(app_ctx)
    assert len(_store_chunks(app_ctx, project_id)) == 5  # seq 2 still has the old chunk
    third = pod.upload(marked_at=time.time())
    assert third.seq == 4
    assert len(_store_chunks(app_ctx, project_id)) == 4  # the replaced chunk was collected
    pod_out = api.get("/v1/pods/trainer").json()
    assert pod_out["checkpoint_dir"] == "/ckpt"
    assert pod_out["last_checkpoint"]["id"] == third.id

    target = tmp_path / "node-b" / "ckpt"
    target.mkdir(parents=True)
    (target / "stale").write_text("from an older run")
    restored = PodCheckpoints(conn, assignment, target).restore()
    assert restored is not None and restored.id == third.id
    expected = _tree(source)
    del expected[".done"]
    assert _tree(target) == expected
    events = [e["reason"] for e in api.get("/v1/pods/trainer/events").json()]
    assert events.count("Checkpointed") == 4 and "CheckpointRestored" in events


def _project_id(ctx: ServiceContext) -> str:
    with ctx.db.read() as session:
        return str(session.execute(select(ProjectModel.id).where(
            ProjectModel.name == "admin")).scalar_one())


def test_a_commit_moves_the_revision_so_the_next_poll_sees_the_new_plan(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
) -> None:
    """A commit re-plans the pod's interval on its measured cost and moves its restore
    target: the node's revision moves with it, so the next poll gets the new answer, not
    the one kept for the old revision (services/assignment_answers)."""
    assignment = _pod(api, schedule, conn)
    before = conn.client.assignments()
    assert next(a for a in before.pods if a.pod_id == assignment.pod_id).restore_checkpoint is None
    source = tmp_path / "source"
    _fill(source)
    committed = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    after = conn.client.assignments(revision=before.revision, wait=0.05)
    assert after.revision != before.revision
    planned = next(a for a in after.pods if a.pod_id == assignment.pod_id)
    assert planned.restore_checkpoint == committed.id
    assert planned.checkpoint_interval_seconds is not None


def test_an_interrupted_chunk_upload_resumes_where_it_stopped(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
) -> None:
    assignment = _pod(api, schedule, conn)
    source = tmp_path / "source"
    source.mkdir()
    data = os.urandom(3 * MiB + 7)
    (source / "state").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    client, token = conn.client, conn.fencing_token
    client.open_checkpoint_upload(assignment.pod_id, CheckpointMissingRequest(
        fencing_token=token, attempt=assignment.attempt, digests=[digest]))
    part = client.put_checkpoint_chunk(assignment.pod_id, digest, data[:MiB], 0, len(data),
                                       token, assignment.attempt)
    assert (part.received, part.complete) == (MiB, False)
    with pytest.raises(InvalidInput, match="resume from there"):  # a gap is refused
        client.put_checkpoint_chunk(assignment.pod_id, digest, data[2 * MiB:3 * MiB],
                                    2 * MiB, len(data), token, assignment.attempt)
    status = client.checkpoint_chunk_status(assignment.pod_id, digest, token,
                                            assignment.attempt)
    assert (status.received, status.complete) == (MiB, False)

    committed = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    assert committed.bytes_sent == len(data) - MiB  # the first MiB was not sent again


def test_a_chunk_with_the_wrong_digest_is_discarded(
    api: TestClient, schedule: Callable[[], Any], conn: Connection,
) -> None:
    assignment = _pod(api, schedule, conn)
    data = b"x" * 1000
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(InvalidInput) as refused:
        conn.client.put_checkpoint_chunk(assignment.pod_id, wrong, data, 0, len(data),
                                         conn.fencing_token, assignment.attempt)
    assert refused.value.field == "digest"
    status = conn.client.checkpoint_chunk_status(assignment.pod_id, wrong, conn.fencing_token,
                                                 assignment.attempt)
    assert (status.received, status.complete) == (0, False)
    response = api.put(f"/v1/agent/pods/{assignment.pod_id}/checkpoint-chunks/{wrong}",
                       content=data, headers={**_agent(conn), "Content-Range": "bytes 0-9/10",
                                              "X-Gpucloud-Fencing-Token": "1",
                                              "X-Gpucloud-Attempt": "1"})
    assert response.status_code == 422 and response.json()["field"] == "Content-Range"


def _agent(conn: Connection) -> dict[str, str]:
    return {"Authorization": conn.client._http.headers["Authorization"]}


def test_an_old_attempt_never_publishes_over_a_newer_one(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
    clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    old = _pod(api, schedule, conn, restart="always")
    source = tmp_path / "source"
    source.mkdir()
    (source / "step").write_text("1")
    PodCheckpoints(conn, old, source).upload(marked_at=time.time())
    # The attempt ends and the pod restarts (attempt 2) while the old attempt still works.
    reg = {"node_token": conn.client._http.headers["Authorization"].split()[1]}
    failed = api.post(f"/v1/agent/pods/{old.pod_id}/status", headers=agent_headers(reg),
                      json={"fencing_token": conn.fencing_token, "phase": "Failed",
                            "attempt": old.attempt, "exit_code": 1})
    assert failed.status_code == 200, failed.text
    clock.advance(60)
    schedule()
    new = _assignment(conn, old.pod_id)
    assert new.attempt == old.attempt + 1 and new.restore_checkpoint is not None
    (source / "step").write_text("2 (late)")
    with pytest.raises(Exception, match="refused"):
        PodCheckpoints(conn, old, source).upload(marked_at=time.time())
    listed = api.get("/v1/pods/trainer/checkpoints").json()
    assert [(c["attempt"], c["seq"]) for c in listed] == [(old.attempt, 1)]
    manifests = list((app_ctx.settings.home / "checkpoints" / "store").rglob("*.json"))
    assert len(manifests) == 1  # the late writer's manifest was withdrawn
    stale = AgentClient("http://testserver", reg["node_token"], transport=ThroughTestClient(api))
    with pytest.raises(Exception, match="fencing token"):
        stale.pod_checkpoints(new.pod_id, conn.fencing_token - 1, new.attempt)


def test_a_corrupted_chunk_is_refused_and_the_previous_checkpoint_restored(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
    app_ctx: ServiceContext,
) -> None:
    assignment = _pod(api, schedule, conn)
    source = tmp_path / "source"
    source.mkdir()
    (source / "step").write_text("older")
    older = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    (source / "step").write_text("newer")
    newer = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    digest = hashlib.sha256(b"newer").hexdigest()
    store = app_ctx.settings.home / "checkpoints" / "store"
    chunk = next(store.rglob(digest))
    chunk.write_bytes(b"newe")  # truncated on the server's disk

    target = tmp_path / "restore"
    restored = PodCheckpoints(conn, assignment, target).restore()
    assert restored is not None and restored.id == older.id
    assert (target / "step").read_text() == "older"
    states = {c["id"]: c["state"] for c in api.get("/v1/pods/trainer/checkpoints").json()}
    assert states == {newer.id: "corrupt", older.id: "committed"}
    events = api.get("/v1/pods/trainer/events").json()
    rejected = [e["message"] for e in events if e["reason"] == "CheckpointRejected"]
    assert len(rejected) == 1 and "damaged" in rejected[0]


def test_checkpoints_are_private_to_their_project_and_can_be_deleted(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
    app_client: TestClient, app_ctx: ServiceContext,
) -> None:
    assignment = _pod(api, schedule, conn)
    source = tmp_path / "source"
    source.mkdir()
    (source / "step").write_text("secret state")
    committed = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    other = api.post("/v1/projects", json={"name": "other"}).json()["key"]["key"]
    headers = {"Authorization": f"Bearer {other}"}
    for path in ("/v1/pods/trainer/checkpoints", f"/v1/pods/{assignment.pod_id}/checkpoints",
                 f"/v1/pods/trainer/checkpoints/{committed.id}"):
        assert api.get(path, headers=headers).status_code == 404
    assert api.delete("/v1/pods/trainer/checkpoints", headers=headers).status_code == 404

    detail = api.get("/v1/pods/trainer/checkpoints/latest").json()
    assert detail["id"] == committed.id
    assert [e["path"] for e in detail["manifest"]["entries"]] == ["step"]
    assert api.delete("/v1/pods/trainer/checkpoints").json() == {"deleted": 1}
    assert api.get("/v1/pods/trainer/checkpoints").json() == []
    assert _store_chunks(app_ctx, _project_id(app_ctx)) == set()


def test_collection_keeps_the_chunks_of_an_open_upload(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, tmp_path: Path,
    clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    assignment = _pod(api, schedule, conn)
    source = tmp_path / "source"
    source.mkdir()
    (source / "step").write_text("kept while uploading")
    PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    manifest, _ = snapshot(source)
    digests = sorted(manifest.digests())
    project_id = _project_id(app_ctx)
    conn.client.open_checkpoint_upload(assignment.pod_id, CheckpointMissingRequest(
        fencing_token=conn.fencing_token, attempt=assignment.attempt, digests=digests))
    assert api.delete("/v1/pods/trainer/checkpoints").json() == {"deleted": 1}
    assert _store_chunks(app_ctx, project_id) == set(digests)  # an open upload names them
    assert service.collect(app_ctx, project_id) == 0
    clock.advance(app_ctx.settings.checkpoint_upload_ttl_seconds + 1)
    assert service.collect(app_ctx, project_id) == 1  # the upload expired


def test_a_bad_checkpoint_dir_is_refused(api: TestClient) -> None:
    response = api.post("/v1/pods", json={"name": "p", "image": "busybox",
                                          "checkpoint_dir": "ckpt"})
    assert response.status_code == 422 and response.json()["field"] == "checkpoint_dir"



def test_concurrent_uploads_of_one_chunk_never_corrupt_it(
    api: TestClient, schedule: Callable[[], Any], conn: Connection, app_ctx: ServiceContext,
) -> None:
    """Several senders of the same chunk at once (a retry after a timeout while the first
    request is still served, or two ranks with the same bytes): pieces are appended under
    a lock, so none is refused and the stored chunk is whole."""
    assignment = _pod(api, schedule, conn)
    assert conn.node_id is not None
    node_id, token = conn.node_id, conn.fencing_token
    project = service._project_of(app_ctx, node_id, assignment.pod_id, token,
                                  assignment.attempt)

    def send(data: bytes, digest: str, errors: list[BaseException]) -> None:
        offset, piece = 0, MiB // 4
        try:
            while True:
                end = min(len(data), offset + piece)
                out = service.upload_chunk(
                    app_ctx, node_id, assignment.pod_id, digest, token, assignment.attempt,
                    f"bytes {offset}-{end - 1}/{len(data)}", data[offset:end])
                if out.complete:
                    return
                offset = out.received
        except BaseException as error:  # noqa: BLE001 (collected for the assertion)
            errors.append(error)

    for _ in range(3):
        data = os.urandom(4 * MiB)
        digest = hashlib.sha256(data).hexdigest()
        errors: list[BaseException] = []
        senders = [threading.Thread(target=send, args=(data, digest, errors))
                   for _ in range(4)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        assert errors == []
        assert not service.store_of(app_ctx).missing(project, [digest])
