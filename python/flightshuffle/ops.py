"""Operators a dataset stage applies to each partition on the workers, and the decomposition of
``group_by().agg()`` into a map-side partial and a reduce-side final aggregation.

Every operator has ``apply(table: pyarrow.Table) -> pyarrow.Table`` and is pickled (with
cloudpickle) into map tasks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa


def to_arrow(obj: Any) -> pa.Table:
    """A pyarrow Table from what a user function returned."""
    if isinstance(obj, pl.LazyFrame):
        obj = obj.collect()
    if isinstance(obj, pl.DataFrame):
        return obj.to_arrow()
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    if hasattr(obj, "__arrow_c_stream__"):
        return pa.table(obj)
    raise TypeError(
        f"a map function must return a Polars DataFrame/LazyFrame or Arrow data, not "
        f"{type(obj).__name__}"
    )


def to_polars(table: pa.Table) -> pl.DataFrame:
    out = pl.from_arrow(table)
    assert isinstance(out, pl.DataFrame)
    return out


@dataclass
class MapPartitions:
    """A Polars function ``pl.DataFrame -> pl.DataFrame`` applied to every partition."""

    fn: Callable[[pl.DataFrame], Any]

    def apply(self, table: pa.Table) -> pa.Table:
        return to_arrow(self.fn(to_polars(table)))


@dataclass
class DuckDBSQL:
    """DuckDB SQL over each partition, visible as the table ``partition``."""

    query: str

    def apply(self, table: pa.Table) -> pa.Table:
        import duckdb

        con = duckdb.connect()
        try:
            con.execute("SET threads TO 1")
            con.register("partition", table)
            return con.sql(self.query).to_arrow_table()
        finally:
            con.close()


# ---------------------------------------------------------------------------------------------
# Aggregates


SUPPORTED = "sum, mean, count, len, min, max"


@dataclass
class Agg:
    """One aggregate of ``group_by().agg()``: output ``name``, ``kind`` (sum, mean, count,
    len, min, max) and the row-wise ``inner`` expression it aggregates (None for len)."""

    name: str
    kind: str
    inner: pl.Expr | None


_KINDS = {"Sum": "sum", "Mean": "mean", "Count": "count", "Min": "min", "Max": "max"}


def parse_agg(expr: pl.Expr) -> Agg | None:
    """Recognise ``<expr>.sum()/.mean()/.count()/.min()/.max()`` and ``pl.len()``; None for
    anything else (which is then aggregated exactly on the reduce side)."""
    name = expr.meta.output_name(raise_if_undetermined=False)
    base = expr.meta.undo_aliases()
    try:
        tree = json.loads(base.meta.serialize(format="json"))
    except Exception:  # noqa: BLE001 - an expression Polars cannot serialise is "unsupported"
        return None
    if tree == "Len":
        return Agg(name or "len", "len", None)
    if not (isinstance(tree, dict) and set(tree) == {"Agg"} and isinstance(tree["Agg"], dict)):
        return None
    (kind,) = tree["Agg"].keys()
    if kind not in _KINDS or name is None:
        return None
    inputs = base.meta.pop()
    if len(inputs) != 1:
        return None
    return Agg(name, _KINDS[kind], inputs[0])


def parse_aggs(exprs: Sequence[pl.Expr]) -> list[Agg] | None:
    aggs = [parse_agg(e) for e in exprs]
    if any(a is None for a in aggs):
        return None
    return [a for a in aggs if a is not None]


def _partial_exprs(aggs: list[Agg]) -> list[pl.Expr]:
    out: list[pl.Expr] = []
    for j, a in enumerate(aggs):
        if a.kind == "len":
            out.append(pl.len().cast(pl.Int64).alias(f"__c{j}"))
            continue
        assert a.inner is not None
        if a.kind in ("count", "mean"):
            out.append(a.inner.count().cast(pl.Int64).alias(f"__c{j}"))
        if a.kind in ("sum", "mean"):
            out.append(a.inner.sum().alias(f"__s{j}"))
        if a.kind in ("min", "max"):
            out.append(getattr(a.inner, a.kind)().alias(f"__m{j}"))
    return out


def _combine_exprs(aggs: list[Agg]) -> list[pl.Expr]:
    out: list[pl.Expr] = []
    for j, a in enumerate(aggs):
        if a.kind in ("len", "count", "mean"):
            out.append(pl.col(f"__c{j}").sum())
        if a.kind in ("sum", "mean"):
            out.append(pl.col(f"__s{j}").sum())
        if a.kind in ("min", "max"):
            out.append(getattr(pl.col(f"__m{j}"), a.kind)())
    return out


def _final_exprs(aggs: list[Agg]) -> list[pl.Expr]:
    out: list[pl.Expr] = []
    for j, a in enumerate(aggs):
        if a.kind in ("len", "count"):
            out.append(pl.col(f"__c{j}").alias(a.name))
        elif a.kind == "sum":
            out.append(pl.col(f"__s{j}").alias(a.name))
        elif a.kind == "mean":
            c, s = pl.col(f"__c{j}"), pl.col(f"__s{j}")
            out.append(pl.when(c > 0).then(s.cast(pl.Float64) / c).otherwise(None).alias(a.name))
        else:
            out.append(pl.col(f"__m{j}").alias(a.name))
    return out


@dataclass
class PartialAgg:
    """Map side: per-partition partial aggregates (counts, sums, minima, maxima)."""

    keys: list[str]
    aggs: list[Agg]

    def apply(self, table: pa.Table) -> pa.Table:
        df = to_polars(table)
        return df.group_by(self.keys).agg(_partial_exprs(self.aggs)).to_arrow()


@dataclass
class FinalAgg:
    """Reduce side: combine the partials of each group and compute the aggregates; the result
    is cast to ``schema``, what the same ``agg`` gives on one process."""

    keys: list[str]
    aggs: list[Agg]
    schema: pa.Schema | None = None

    def apply(self, table: pa.Table) -> pa.Table:
        df = to_polars(table).group_by(self.keys).agg(_combine_exprs(self.aggs))
        out = df.select([pl.col(k) for k in self.keys] + _final_exprs(self.aggs)).to_arrow()
        return out.cast(self.schema) if self.schema is not None else out


@dataclass
class FullAgg:
    """Reduce side for aggregates without a partial form: ``group_by(keys).agg(exprs)`` on all
    rows of each key (the rows were shuffled by key)."""

    keys: list[str]
    exprs: list[pl.Expr]

    def apply(self, table: pa.Table) -> pa.Table:
        return to_polars(table).group_by(self.keys).agg(self.exprs).to_arrow()
