"""Every route fuzzed by schemathesis, from the server's own OpenAPI document, on SQLite and
on PostgreSQL, as the admin and as a project: all checks, all phases (examples, coverage,
fuzzing, stateful), fixed seeds and bounded examples (``bench/fuzz.py`` runs longer and at
random).

The invariants: no 5xx, every response documented and matching its schema, every invalid
request refused. Two checks are not yet clean everywhere: ``positive_data_acceptance`` (a request
the schema allows, refused with 422: the operations whose schemas do not yet say all that
their validation checks are listed in ``SCHEMA_LOOSER_THAN_VALIDATION``) and
``negative_data_rejection`` for ``false`` sent as an integer (``BOOL_AS_INTEGER``). Any
other failure, or one of these on another operation, fails the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.fuzz import harness

SEED = 20240616
MAX_EXAMPLES = 5
#: Operations whose request schema is still looser than their validation (a JSON schema
#: cannot say "a GPU share below 1 is at least 0.001" or "an image reference that parses").
SCHEMA_LOOSER_THAN_VALIDATION = {
    "POST /v1/pods", "POST /v1/jobs", "POST /v1/templates", "POST /v1/pods/{ref}/start",
    "POST /v1/ssh-keys", "POST /v1/agent/register", "PUT /v1/quotas/{project}",
    "GET /v1/jobs/{ref}/logs", "POST /v1/nodes/{ref}/drain",
    "POST /v1/agent/pods/{pod_id}/checkpoints", "POST /v1/agent/pods/{pod_id}/checkpoints/uploads",
    "PUT /v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}",
    "GET /v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}",
    "GET /v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}/upload",
    "POST /v1/volumes", "POST /v1/registry-auths", "POST /v1/priority-classes",
    "POST /v1/agent/pods/{pod_id}/status", "Stateful tests",
    # a GPU model in the catalog, a month that exists, a time range in order
    "POST /v1/prices", "GET /v1/invoices/{project}", "GET /v1/usage",
    "PUT /v1/projects/{project}/spend-limit",
    # a sample's time at most 120 s ahead of the server's clock
    "POST /v1/agent/usage",
    # RunPod's REST: an image that parses, a GPU id of the fleet, a DNS-label name, a cursor
    # this server gave, an OpenSSH key line
    "POST /runpod/v2/pods", "POST /runpod/v1/pods", "POST /runpod/v2/templates",
    "POST /runpod/v2/registries", "PUT /runpod/v2/account/ssh-keys", "GET /runpod/v2/pods",
    # serverless endpoints: an image that parses, a template of the project, min <= max
    "POST /v1/endpoints", "PATCH /v1/endpoints/{ref}",
}
#: Pydantic's lax mode takes ``false`` for an integer; the schema says integer.
BOOL_AS_INTEGER = {"POST /v1/priority-classes", "PUT /v1/quotas/{project}"}


@pytest.fixture
def fuzz_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of its own: SQLite in the test's directory, or a fresh PostgreSQL
    database (the other tests' database is emptied under them between tests)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fuzz.db'}"
        return
    base = make_url(request.getfixturevalue("postgres_url"))
    name = f"fuzz_{uuid.uuid4().hex[:12]}"
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    yield base.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


KNOWN = {"positive_data_acceptance": SCHEMA_LOOSER_THAN_VALIDATION,
         "negative_data_rejection": BOOL_AS_INTEGER}


def _unexpected(report: harness.Report) -> list[str]:
    """Failures outside the known, listed ones (``KNOWN``: check → operations)."""
    unexpected = []
    for line in report.details:
        check, _, rest = line.partition(" ")
        if rest.split(":")[0] not in KNOWN.get(check, set()):
            unexpected.append(line)
    return unexpected


@pytest.mark.timeout(900)  # ~140 operations × 2 keys; minutes when the machine is busy
@pytest.mark.parametrize("fuzz_database", ["sqlite"], indirect=True)
def test_every_route_holds_under_schemathesis(fuzz_database: str, tmp_path: Path) -> None:
    """On SQLite; tests/fuzz/test_schemathesis_postgresql.py runs it on PostgreSQL (a file
    of its own, so that `make test`'s two workers fuzz both databases at once)."""
    check_every_route(fuzz_database, tmp_path)


def check_every_route(fuzz_database: str, tmp_path: Path) -> None:
    with harness.live_target(tmp_path / "home", fuzz_database) as target:
        for who, key in (("admin", target.admin_key), ("project", target.project_key)):
            settings = harness.config(target, key, seed=SEED, max_examples=MAX_EXAMPLES)
            report = harness.run(target, settings)
            print(f"{fuzz_database.split(':')[0]} {who}: {report.summary()}")
            assert report.operations >= 50, report.summary()
            assert report.cases > 20 * report.operations, report.summary()
            # An operation the engine could not test (a generator error) is printed.
            print("\n".join(report.errors))
            assert not any(line.startswith("fatal") for line in report.errors), report.errors
            unexpected = _unexpected(report)
            assert not unexpected, f"{who}: {report.summary()}\n" + "\n".join(unexpected)
