"""The S3 backend against a real S3-protocol server (moto's standalone server on
127.0.0.1, started here): conditional manifest writes, chunk listing per project, aborting
incomplete multipart uploads, and a whole upload/restore through the app with
``GPUCLOUD_CHECKPOINT_STORE=s3://…``."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from fastapi.testclient import TestClient

from gpucloud.agent.checkpoints import PodCheckpoints
from gpucloud.agent.connection import Connection
from gpucloud.checkpoints import ManifestExists, S3Store
from gpucloud.core.errors import NotFound
from gpucloud.core.settings import Settings
from tests.conftest import ADMIN_KEY
from tests.fixtures.postgres import free_port
from tests.integration.test_checkpoints import _connect, _pod

BUCKET = "gpucloud-ckpt"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("moto's S3 server did not start")
            time.sleep(0.1)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def s3(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "test",
                        "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"
                        }.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])


@pytest.fixture
def settings(tmp_path: Path, database_url: str, s3: Any) -> Settings:
    """The app's settings with the S3 store (overrides tests/conftest.py's)."""
    return Settings(home=tmp_path / "home", database_url=database_url, admin_key=ADMIN_KEY,
                    checkpoint_store=f"s3://{BUCKET}/prefix/{tmp_path.name}")


def test_manifests_are_published_once_and_chunks_listed_per_project(
    s3: Any, tmp_path: Path
) -> None:
    store = S3Store(BUCKET, "unit")
    chunk = tmp_path / "part"
    chunk.write_bytes(b"hello")
    digest = hashlib.sha256(b"hello").hexdigest()
    assert store.missing("p1", [digest]) == [digest]
    store.put_chunk("p1", digest, chunk)
    assert not chunk.exists()
    assert store.missing("p1", [digest]) == [] and store.missing("p2", [digest]) == [digest]
    assert store.get_chunk("p1", digest) == b"hello"
    with pytest.raises(NotFound):
        store.get_chunk("p2", digest)
    store.put_manifest("p1", "key/000001-000001", b"{}")
    with pytest.raises(ManifestExists):
        store.put_manifest("p1", "key/000001-000001", b'{"other": 1}')
    assert store.get_manifest("p1", "key/000001-000001") == b"{}"

    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="unit/p1/chunks/big")
    # moto reports every upload as initiated in 2010: a cut-off before that keeps it.
    assert store.abort_incomplete(datetime(2000, 1, 1, tzinfo=UTC)) == 0
    assert store.abort_incomplete(datetime.now(UTC) + timedelta(seconds=5)) == 1
    left = s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    assert upload["UploadId"] not in {u["UploadId"] for u in left}


def test_upload_and_restore_through_the_s3_store(
    api: TestClient, schedule: Callable[[], Any], tmp_path: Path, s3: Any,
) -> None:
    conn: Connection = _connect(api, tmp_path)
    assignment = _pod(api, schedule, conn)
    source = tmp_path / "source"
    source.mkdir()
    (source / "step").write_text("older")
    older = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    (source / "step").write_text("newer")
    (source / "big").write_bytes(bytes(range(256)) * 40_000)
    newer = PodCheckpoints(conn, assignment, source).upload(marked_at=time.time())
    keys = [item["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for item in page.get("Contents", [])]
    assert sum("/manifests/" in key for key in keys) == 2
    assert sum("/chunks/" in key for key in keys) == 4  # older, newer, big (3 chunks: 2 alike)

    target = tmp_path / "restored"
    assert PodCheckpoints(conn, assignment, target).restore().id == newer.id  # type: ignore[union-attr]
    assert (target / "big").read_bytes() == (source / "big").read_bytes()

    digest = hashlib.sha256(b"newer").hexdigest()
    key = next(k for k in keys if k.endswith(digest))
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"tampered")
    again = tmp_path / "again"
    assert PodCheckpoints(conn, assignment, again).restore().id == older.id  # type: ignore[union-attr]
    assert (again / "step").read_text() == "older"
