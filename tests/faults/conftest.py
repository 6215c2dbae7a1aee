"""Fault-suite fixtures: one PostgreSQL for the folder (a test may stop it), a fresh
database per test, the test image as an archive the agents import, and a cloud."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.images.testing import busybox_image
from tests.e2e.cluster import skip_reason
from tests.faults.cluster import IMAGE, FaultCloud, Postgres, fault_cloud


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every fault scenario runs real containers on real PostgreSQL: root, runc, postgres."""
    reason = skip_reason()
    for item in items:
        if "tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.root)
            item.add_marker(pytest.mark.postgres)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def pg() -> Iterator[Postgres]:
    server = Postgres()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI archive of the busybox test image, imported into each agent's state dir."""
    path = tmp_path_factory.mktemp("image") / "faults.oci.tar"
    return busybox_image().write_oci_layout(path, IMAGE, as_tar=True)


@pytest.fixture
def database_url(pg: Postgres) -> str:
    return pg.fresh_database()


@pytest.fixture
def cloud(tmp_path: Path, archive: Path, database_url: str) -> Iterator[FaultCloud]:
    """A server on a fresh PostgreSQL database, lease TTL 2 s."""
    with fault_cloud(tmp_path, archive, database_url) as running:
        yield running
