"""A container's output holding a NUL byte, end to end on PostgreSQL (whose text type
cannot hold NUL): the chunk is stored with the NUL as a space (services/agent.append_log,
as the fuzzing decided), so every later byte offset is unchanged, and it reads back."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, select

from gpucloud.db.models import PodLogChunkModel
from gpucloud.db.session import Database
from tests.e2e.cluster import Cloud, running_cloud
from tests.e2e.conftest import PushedImages

#: "é" is two bytes: offsets count UTF-8 bytes, not characters.
FIRST = "é\x00x\n"
SECOND = "after\n"


@pytest.fixture
def pg_cloud(postgres_url: str, tmp_path: Path) -> Iterator[Cloud]:
    """A fresh cloud on a new database of the session's PostgreSQL."""
    base = make_url(postgres_url)
    name = f"e2e_nul_{secrets.token_hex(4)}"
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.exec_driver_sql(f"CREATE DATABASE {name}")
    engine.dispose()
    url = base.set(database=name).render_as_string(hide_password=False)
    with running_cloud(tmp_path, database_url=url) as cloud:
        yield cloud


def _chunks(cloud: Cloud, pod_id: str) -> list[tuple[int, str]]:
    db = Database(cloud.server.settings.database_url)
    try:
        with db.read() as session:
            return [(int(o), str(d)) for o, d in session.execute(
                select(PodLogChunkModel.offset, PodLogChunkModel.data)
                .where(PodLogChunkModel.pod_id == pod_id).order_by(PodLogChunkModel.offset))]
    finally:
        db.dispose()


def test_a_log_chunk_with_a_nul_byte_is_stored_and_read_back_with_offsets_intact(
    pg_cloud: Cloud, images: PushedImages
) -> None:
    cloud = pg_cloud
    cloud.agent("nul-a")
    pod = cloud.create_pod("nul", images.busybox,
                           ["sh", "-c", r"printf '\303\251\000x\n'; sleep 1; echo after; "
                                        "exec sleep 600"])
    cloud.wait_log("nul", SECOND, timeout=30)
    stored = FIRST.replace("\x00", " ")
    whole = cloud.client.pod_logs("nul")
    assert whole.text == stored + SECOND
    assert whole.next_offset == len((FIRST + SECOND).encode())  # the NUL byte still counts
    rest = cloud.client.pod_logs("nul", offset=len(FIRST.encode()))
    assert rest.text == SECOND and rest.offset == len(FIRST.encode())
    chunks = _chunks(cloud, pod.id)
    assert "".join(data for _, data in chunks) == stored + SECOND
    ends = [offset + len(data.encode()) for offset, data in chunks]
    assert [offset for offset, _ in chunks] == [0, *ends[:-1]]  # contiguous byte offsets
