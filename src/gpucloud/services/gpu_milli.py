"""Reading a pod's ``gpu_milli`` (GPU index -> milli-GPU) column by the thousand.

A scheduling pass reads the GPUs of every active pod (the snapshot's usage, the quota
ledger): at fleet scale tens of thousands of rows, but of few distinct values
(``{"3": 1000}``, ``{"0": 500}``…). Selecting the column as its JSON text
(``as_text``) and parsing each distinct text once (``pairs``) took decoding out of
the larger part of those reads.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from sqlalchemy import Text, cast
from sqlalchemy.sql.elements import Cast


def as_text(column: Any) -> Cast[str]:
    """A JSON column selected as its text (portable: SQLite and PostgreSQL)."""
    return cast(column, Text)


@lru_cache(maxsize=4096)
def pairs(text: str | None) -> tuple[tuple[str, int], ...]:
    """The (index, milli) pairs of a ``gpu_milli`` JSON text; () for SQL or JSON null."""
    value = json.loads(text) if text else None
    return tuple((str(k), int(v)) for k, v in value.items()) if value else ()
