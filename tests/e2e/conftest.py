"""End-to-end fixtures: a registry with test images, a cloud, agents (see cluster.py)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from gpucloud.images.testing import busybox_image
from tests.e2e.cluster import (
    PATIENT_LEASE_TTL,
    SHORT_LEASE_TTL,
    Cloud,
    running_cloud,
    skip_reason,
)
from tests.fixtures.registry import (  # noqa: F401 - fixtures are found by name
    Registry,
    basic_auth_registry,
    corrupting_proxy,
    registry,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that run a cloud need root, runc and the registry; the rest run anywhere."""
    reason = skip_reason()
    for item in items:
        needs = set(getattr(item, "fixturenames", ())) & {
        "cloud", "images", "registry", "preempting_cloud", "patient_cloud",
        "short_lease_cloud", "db_cloud"}
        if "tests/e2e/" in str(item.fspath) and needs:
            item.add_marker(pytest.mark.root)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@dataclass(frozen=True)
class PushedImages:
    """References of the images pushed for the session."""

    busybox: str


@pytest.fixture(scope="session")
def images(registry: Registry) -> PushedImages:  # noqa: F811 - the fixture, by name
    busybox_image().push(registry.host, "e2e/busybox:1")
    return PushedImages(busybox=f"{registry.host}/e2e/busybox:1")


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    """A fresh server (``LEASE_TTL``: no node goes Lost by accident); agents are added by
    the test."""
    with running_cloud(tmp_path) as running:
        yield running


@pytest.fixture
def short_lease_cloud(tmp_path: Path) -> Iterator[Cloud]:
    """A fresh server whose leases lapse soon (``SHORT_LEASE_TTL``), for tests that kill an
    agent and wait for its node to go Lost."""
    with running_cloud(tmp_path, lease_ttl=SHORT_LEASE_TTL) as running:
        yield running


@pytest.fixture
def patient_cloud(tmp_path: Path) -> Iterator[Cloud]:
    """A fresh server whose leases outlast an agent restart on a loaded machine
    (``PATIENT_LEASE_TTL``), for tests where the node must stay Ready while its agent is
    briefly down."""
    with running_cloud(tmp_path, lease_ttl=PATIENT_LEASE_TTL) as running:
        yield running


@pytest.fixture
def preempting_cloud(tmp_path: Path) -> Iterator[Cloud]:
    """A fresh server whose preempted pods get a short grace period (0.5 s)."""
    with running_cloud(tmp_path, preemption_grace=0.5) as running:
        yield running


@pytest.fixture(params=["sqlite", "postgresql"])
def db_cloud(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cloud]:
    """A fresh cloud on SQLite, or on a new database of the session's PostgreSQL; its
    tests move pods by stop/start and preemption, never by a lapsed lease, so the lease is
    ``PATIENT_LEASE_TTL`` (a 2 s one lapsed at load 25 while the agent ran a pod)."""
    url = None
    if request.param == "postgresql":
        base = make_url(request.getfixturevalue("postgres_url"))
        name = f"e2e_{secrets.token_hex(4)}"
        engine = create_engine(base, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
        engine.dispose()
        url = base.set(database=name).render_as_string(hide_password=False)
    with running_cloud(tmp_path, database_url=url, lease_ttl=PATIENT_LEASE_TTL) as cloud:
        yield cloud
