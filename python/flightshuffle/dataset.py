"""Distributed datasets: Parquet or Arrow data split across the cluster, transformed by Polars
functions and DuckDB SQL on the workers, repartitioned and aggregated through flightshuffle
exchanges, and collected as Polars or Arrow.

A dataset is a lazy chain of operators. Executing it cuts the chain into stages at every
exchange (``repartition``, ``group_by().agg()``); each stage is one map task per input split
(or per partition of the stage before), run on the workers by ``flightshuffle._exec``.
"""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle
import polars as pl
import pyarrow as pa

from flightshuffle import footers, ops
from flightshuffle._exec import MapTask, Split, apply_ops

if TYPE_CHECKING:
    from flightshuffle import Cluster


def parquet_files(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Parquet files named by ``paths`` (files, directories searched recursively, globs)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[str] = []
    for item in items:
        p = os.fspath(item)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "**", "*.parquet"), recursive=True))
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p, recursive=True))
        elif os.path.exists(p):
            found = [p]
        else:
            raise FileNotFoundError(f"no such Parquet file or directory: {p}")
        if not found:
            raise FileNotFoundError(f"no Parquet files under {p}")
        files.extend(os.path.abspath(f) for f in found)
    return files


def make_splits(files: list[str], min_splits: int) -> tuple[list[Split], pa.Schema]:
    """One split per row group; row groups are cut into row ranges when there would be fewer
    than ``min_splits`` splits. Returns the splits and the common schema."""
    groups: list[tuple[str, int, int]] = []
    schema: pa.Schema | None = None
    for f in files:
        md = footers.metadata(f)
        s = md.schema.to_arrow_schema()
        if schema is None:
            schema = s
        elif not s.equals(schema):
            raise ValueError(f"{f} has schema {s}, unlike the first file's {schema}")
        groups.extend((f, i, md.row_group(i).num_rows) for i in range(md.num_row_groups))
    if schema is None:
        raise ValueError("no input files")
    pieces = max(1, -(-min_splits // max(1, len(groups))))
    splits: list[Split] = []
    for path, rg, rows in groups:
        k = max(1, min(pieces, rows))
        for i in range(k):
            start, end = i * rows // k, (i + 1) * rows // k
            splits.append(Split(path, rg, start, end - start))
    return splits, schema


def empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


@dataclass
class Source:
    splits: list[Split]
    schema: pa.Schema


@dataclass
class Node:
    """One step of a dataset's chain: a narrow operator, or an exchange into ``partitions``
    partitions (hash on ``keys``; round-robin without keys)."""

    op: Any = None
    partitions: int | None = None
    keys: list[str] = field(default_factory=list)


class Dataset:
    """A distributed dataset on a :class:`~flightshuffle.Cluster` (lazy until collected)."""

    def __init__(self, cluster: Cluster, source: Source, chain: list[Node] | None = None):
        self._cluster = cluster
        self._source = source
        self._chain = chain or []

    def _then(self, node: Node) -> Dataset:
        return Dataset(self._cluster, self._source, [*self._chain, node])

    @property
    def num_splits(self) -> int:
        return len(self._source.splits)

    @property
    def source(self) -> Source:
        """What the dataset reads: its schema and file splits."""
        return self._source

    @property
    def operators(self) -> list[Node]:
        """The operators applied to the source, in order (a repartition has ``op`` None)."""
        return list(self._chain)

    def repartition(self, n: int, by: str | Sequence[str] | None = None) -> Dataset:
        """Exchange rows into ``n`` partitions: hashed on ``by`` (equal keys meet), or dealt
        round-robin without ``by``."""
        if n < 1:
            raise ValueError("repartition needs at least one partition")
        keys = [by] if isinstance(by, str) else list(by or [])
        return self._then(Node(partitions=n, keys=keys))

    def map_partitions(self, fn: Callable[[pl.DataFrame], Any]) -> Dataset:
        """Apply ``fn(pl.DataFrame) -> pl.DataFrame`` to every partition, on the workers."""
        if not callable(fn):
            raise TypeError("map_partitions needs a function pl.DataFrame -> pl.DataFrame")
        return self._then(Node(op=ops.MapPartitions(fn)))

    def duckdb_sql(self, query: str) -> Dataset:
        """Run DuckDB SQL over every partition (the table ``partition``), on the workers."""
        return self._then(Node(op=ops.DuckDBSQL(query)))

    def group_by(self, *keys: str | Sequence[str]) -> GroupBy:
        names: list[str] = []
        for k in keys:
            names.extend([k] if isinstance(k, str) else list(k))
        if not names:
            raise ValueError("group_by needs at least one key column")
        return GroupBy(self, names)

    # -- execution ----------------------------------------------------------------------------

    def schema(self) -> pa.Schema:
        """The schema of the result (the operators run on an empty input, on the driver)."""
        table = empty(self._source.schema)
        for node in self._chain:
            if node.op is not None:
                table = node.op.apply(table)
        return table.schema

    def _stages(self) -> list[tuple[list[Any], int, list[str]]]:
        """The chain cut at exchanges: (narrow ops, output partitions, keys) per stage; the last
        stage gathers into one partition per worker."""
        stages: list[tuple[list[Any], int, list[str]]] = []
        pending: list[Any] = []
        for node in self._chain:
            if node.op is not None:
                pending.append(node.op)
            else:
                stages.append((pending, node.partitions or 1, node.keys))
                pending = []
        if pending or not stages:
            stages.append((pending, self._cluster.workers, []))
        return stages

    def _execute(self) -> list[pa.Table]:
        native = self._cluster.native
        schema = self._source.schema
        previous: tuple[int, int] | None = None  # (stage id, partitions)
        created: list[int] = []
        try:
            for stage_ops, partitions, keys in self._stages():
                out_schema = apply_ops(empty(schema), stage_ops).schema
                for k in keys:
                    if k not in out_schema.names:
                        raise ValueError(
                            f"exchange key {k!r} is not a column of {out_schema.names}"
                        )
                if previous is None:
                    body = cloudpickle.dumps(MapTask(stage_ops))
                    tasks = [(body, None, 0, s.native(None)) for s in self._source.splits]
                else:
                    body = cloudpickle.dumps(MapTask(stage_ops))
                    tasks = [(body, previous[0], p, None) for p in range(previous[1])]
                stage_id, _rows = native.run_stage(out_schema, partitions, keys, tasks)
                created.append(stage_id)
                # Earlier stages stay until the result is read (dropped below): a map output
                # of a later stage lost with its worker is recomputed from their partitions.
                previous = (stage_id, partitions)
                schema = out_schema
            assert previous is not None
            parts = native.read_stage(previous[0])
            return [p if p.schema.equals(schema) else p.cast(schema) for p in parts]
        finally:
            for s in created:
                native.drop_stage(s)

    def to_arrow(self) -> pa.Table:
        """Run the dataset and collect it as one pyarrow Table (row order is not defined)."""
        parts = self._execute()
        schema = self.schema() if not parts else parts[0].schema
        return pa.concat_tables(parts) if parts else empty(schema)

    def to_polars(self) -> pl.DataFrame:
        """Run the dataset and collect it as a Polars DataFrame (row order is not defined)."""
        return ops.to_polars(self.to_arrow())

    def iter_partitions(self) -> Iterator[pa.Table]:
        """Run the dataset and yield its partitions as pyarrow Tables."""
        yield from self._execute()

    def __arrow_c_stream__(self, requested_schema: object = None) -> object:
        """Arrow PyCapsule export: DuckDB, Polars and pyarrow can read a dataset directly (it is
        run when read)."""
        return self.to_arrow().__arrow_c_stream__(requested_schema)

    def __repr__(self) -> str:
        return f"Dataset({self.num_splits} splits, {len(self._chain)} operators)"


class GroupBy:
    """``dataset.group_by(keys)``: ``.agg(exprs)`` aggregates with Polars expressions."""

    def __init__(self, dataset: Dataset, keys: list[str]):
        self.dataset = dataset
        self.keys = keys

    def agg(self, *exprs: pl.Expr | Sequence[pl.Expr], partitions: int | None = None) -> Grouped:
        """Aggregate each group. ``sum``, ``mean``, ``count``, ``len``, ``min``, ``max`` of any
        row-wise expression are computed map-side as partials, shuffled by key and combined
        reduce-side; other expressions shuffle the rows by key and aggregate them there."""
        flat: list[pl.Expr] = []
        for e in exprs:
            flat.extend([e] if isinstance(e, pl.Expr) else list(e))
        if not flat:
            raise ValueError("agg needs at least one expression")
        return Grouped(self.dataset, self.keys, flat, partitions)


class Grouped(Dataset):
    """The result of ``group_by().agg()``: a dataset, and an input of ``Cluster.online``."""

    def __init__(
        self, base: Dataset, keys: list[str], exprs: list[pl.Expr], partitions: int | None
    ):
        self.base, self.keys, self.exprs = base, keys, exprs
        n = base._cluster.workers if partitions is None else int(partitions)
        if n < 1:
            raise ValueError(f"partitions must be at least 1, not {n}")
        in_schema = base.schema()
        missing = [k for k in keys if k not in in_schema.names]
        if missing:
            raise ValueError(f"group_by keys {missing} are not columns of {in_schema.names}")
        final_schema = ops.to_polars(empty(in_schema)).group_by(keys).agg(exprs).to_arrow().schema
        self.aggs = ops.parse_aggs(exprs)
        if self.aggs is not None:
            chain = [
                Node(op=ops.PartialAgg(keys, self.aggs)),
                Node(partitions=n, keys=keys),
                Node(op=ops.FinalAgg(keys, self.aggs, final_schema)),
            ]
        else:
            chain = [Node(partitions=n, keys=keys), Node(op=ops.FullAgg(keys, exprs))]
        super().__init__(base._cluster, base._source, [*base._chain, *chain])


def shuffled(splits: list[Split], seed: int | None) -> list[Split]:
    """The splits in a random order (online aggregation reads them so)."""
    out = list(splits)
    random.Random(seed).shuffle(out)
    return out
