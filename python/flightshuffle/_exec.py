"""Python work executed inside worker processes (called from Rust, see ``python/src/script.rs``).

``run_map`` runs one map task of a dataset stage: it applies the stage's operators to its input
(a Parquet split or the partition of an earlier stage, both read by Rust).
``fold`` / ``emit`` run a streaming reducer. Task descriptions arrive pickled (cloudpickle, so
user functions travel with them); Arrow data arrives and leaves through the PyCapsule interface.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass(frozen=True)
class Split:
    """Rows ``[start, start + rows)`` of one row group of one Parquet file (read by the worker
    in Rust, decoding only the pages that hold those rows)."""

    path: str
    row_group: int
    start: int
    rows: int

    def native(self, columns: list[str] | None) -> tuple[str, int, int, int, list[str]]:
        return (self.path, self.row_group, self.start, self.rows, list(columns or []))

    def schema(self, columns: list[str] | None) -> pa.Schema:
        schema = pq.read_schema(self.path)
        return pa.schema([schema.field(c) for c in columns]) if columns else schema


@dataclass
class MapTask:
    """One map task: the operators to apply, in order, to its input."""

    ops: list[Any] = field(default_factory=list)


class TaskCancelled(Exception):
    """The map task was cancelled (its attempt aborted, its shuffle dropped) while its body ran:
    raised between operators, so the body stops and its worker takes back its memory."""


def apply_ops(
    table: pa.Table, ops: list[Any], cancelled: Callable[[], bool] | None = None
) -> pa.Table:
    for i, op in enumerate(ops):
        if cancelled is not None and cancelled():
            raise TaskCancelled(f"cancelled before operator {i + 1} of {len(ops)}")
        table = op.apply(table)
    return table


def conform(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """Give the task's output the stage's schema (inferred on the driver from an empty input)."""
    if table.schema.equals(expected):
        return table
    if table.column_names != expected.names:
        raise ValueError(
            f"the stage's operators returned columns {table.column_names} here but "
            f"{expected.names} on an empty input; a map function must return the same "
            "columns for every partition"
        )
    try:
        return table.cast(expected)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(
            f"the stage's operators returned types {table.schema} here but {expected} on an "
            f"empty input: {e}"
        ) from e


def run_map(
    body: bytes,
    input_table: pa.Table,
    expected: pa.Schema,
    cancelled: Callable[[], bool] | None = None,
) -> pa.Table:
    task: MapTask = pickle.loads(body)
    return conform(apply_ops(input_table, task.ops, cancelled), expected)


def fold(body: bytes, state: Any, table: pa.Table) -> Any:
    reducer = pickle.loads(body)
    return reducer.fold(state, table)


def emit(body: bytes, state: Any) -> pa.Table:
    reducer = pickle.loads(body)
    return reducer.emit(state)
