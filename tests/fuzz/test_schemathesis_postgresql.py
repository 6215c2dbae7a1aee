"""The schemathesis run of ``test_schemathesis`` on PostgreSQL, in a file of its own:
pytest-xdist places whole files on a worker, so the two databases are fuzzed at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.test_schemathesis import check_every_route, fuzz_database

__all__ = ["fuzz_database"]  # the fixture, used here by name


@pytest.mark.postgres
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fuzz_database", ["postgresql"], indirect=True)
def test_every_route_holds_under_schemathesis_on_postgresql(fuzz_database: str,
                                                            tmp_path: Path) -> None:
    check_every_route(fuzz_database, tmp_path)
