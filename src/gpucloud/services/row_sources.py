"""Many rows' values as one statement parameter per column (PostgreSQL arrays).

A bind writes a thousand rows a statement. As bound parameters per row (an ``IN`` list
of a thousand ``(id, version)`` pairs, an executemany of a thousand UPDATEs) PostgreSQL
plans and runs each row apart, and the driver rewrites a statement of thousands of
placeholders, never cached, in Python, every time. On PostgreSQL the rows travel as one
array per column instead, read back as a table by ``unnest``: a statement of a few
placeholders, joined in one plan. SQLite, one writer in one process, keeps the plain
forms (it has no arrays); the guards are the same on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    ColumnElement,
    Connection,
    Integer,
    String,
    Text,
    Update,
    bindparam,
    cast,
    column,
    func,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.expression import TableValuedAlias


def arrays(connection: Connection) -> bool:
    """Whether rows may travel as arrays (PostgreSQL)."""
    return connection.dialect.name == "postgresql"


def unnest(name: str, columns: Sequence[tuple[str, Any]]) -> TableValuedAlias:
    """``unnest(:name_col, …) AS name(col, …)``: one array parameter per column."""
    params = [bindparam(f"{name}_{col}", type_=ARRAY(kind)) for col, kind in columns]
    return func.unnest(*params).table_valued(
        *(column(col, kind) for col, kind in columns)).render_derived(name=name)


def id_version_in(connection: Connection, id_column: ColumnElement[Any],
                  version_column: ColumnElement[Any], pairs: Sequence[tuple[str, int]],
                  ) -> tuple[ColumnElement[bool], dict[str, list[Any]]]:
    """The guard ``(id, version) IN pairs`` and the parameters it needs (arrays on
    PostgreSQL, none beside the statement on SQLite)."""
    if not arrays(connection):
        return tuple_(id_column, version_column).in_(list(pairs)), {}
    source = unnest("pairs", [("id", String), ("version", Integer)])
    clause = tuple_(id_column, version_column).in_(select(source.c.id, source.c.version))
    return clause, {"pairs_id": [p[0] for p in pairs], "pairs_version": [p[1] for p in pairs]}


#: The bindings' columns as arrays: the JSON ones as text, cast back in the statement.
BINDING_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("id", String), ("node_id", String), ("gpu_uuids", Text), ("mig_slot", Integer),
    ("gpu_milli", Text), ("volume_node_id", String), ("message", Text))


def bindings_update(statement: Update, table_id: ColumnElement[Any]) -> Update:
    """``statement`` (the constant part of a binding) with each row's values taken from
    ``unnest`` of the binding arrays, matched on id."""
    rows = unnest("b", BINDING_COLUMNS)
    return statement.where(table_id == rows.c.id).values(
        node_id=rows.c.node_id, gpu_uuids=cast(rows.c.gpu_uuids, JSON),
        mig_slot=rows.c.mig_slot, gpu_milli=cast(rows.c.gpu_milli, JSON),
        volume_node_id=rows.c.volume_node_id, message=rows.c.message)
