"""Online aggregation (Hellerstein, Haas, Wang 1997; Exoshuffle §3.3.1) over the streaming
strategy.

Input splits are read in a random order, in rounds. Every map task computes, per group and per
aggregate, the sufficient statistics of what it read (count, sum, sum of squares, min, max);
they are shuffled by group key and every reducer folds each round's blocks into its running
state. After each round the driver turns the states into estimates: with a fraction ``f`` of
the input rows read (``n`` of ``N``), SUM and COUNT are scaled by ``1/f``, AVG is the ratio of
the sums, and the CLT gives a ``z``-interval with the finite-population correction ``1 - f``
(so the final round, ``f = 1``, is exact with a zero-width interval). MIN and MAX are the
extremes seen so far, without interval.

Frontends: SQL (run by DataFusion or DuckDB on each split, after rewriting the aggregates into
statistics) and ``Dataset.group_by().agg()`` with Polars expressions.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import polars as pl
import pyarrow as pa

from flightshuffle import ops
from flightshuffle._exec import MapTask, Split, apply_ops

# Statistics each aggregate kind needs: c = count, s = sum, q = sum of squares, m = min/max.
NEEDS = {
    "sum": "csq",
    "mean": "csq",
    "count": "c",
    "len": "c",
    "min": "m",
    "max": "m",
}


@dataclass(frozen=True)
class AggRef:
    """An aggregate of an online query: output ``name`` and ``kind``."""

    name: str
    kind: str


def combine(df: pl.DataFrame, keys: list[str], aggs: list[AggRef]) -> pl.DataFrame:
    """Merge rows of statistics of the same group."""
    exprs: list[pl.Expr] = []
    for j, a in enumerate(aggs):
        for stat in NEEDS[a.kind]:
            col = pl.col(f"__{stat}{j}")
            exprs.append(getattr(col, a.kind)() if stat == "m" else col.sum())
    if not keys:
        return df.select(exprs)
    return df.group_by(keys).agg(exprs)


@dataclass
class StatsReducer:
    """The streaming reducer: the state is the combined statistics of one partition."""

    keys: list[str]
    aggs: list[AggRef]

    def fold(self, state: pl.DataFrame | None, table: pa.Table) -> pl.DataFrame:
        df = ops.to_polars(table)
        if state is not None:
            df = pl.concat([state, df], how="vertical_relaxed")
        return combine(df, self.keys, self.aggs)

    def emit(self, state: pl.DataFrame) -> pa.Table:
        return state.to_arrow()


@dataclass
class PolarsStats:
    """Map side of ``group_by().agg()`` online: statistics per group with Polars."""

    keys: list[str]
    aggs: list[ops.Agg]

    def apply(self, table: pa.Table) -> pa.Table:
        exprs: list[pl.Expr] = []
        for j, a in enumerate(self.aggs):
            x = a.inner.cast(pl.Float64) if a.inner is not None else None
            for stat in NEEDS[a.kind]:
                name = f"__{stat}{j}"
                if stat == "c":
                    e = pl.len() if a.kind == "len" or a.inner is None else a.inner.count()
                    exprs.append(e.cast(pl.Int64).alias(name))
                elif stat == "s" and x is not None:
                    exprs.append(x.sum().alias(name))
                elif stat == "q" and x is not None:
                    exprs.append((x * x).sum().alias(name))
                elif stat == "m" and a.inner is not None:
                    exprs.append(getattr(a.inner, a.kind)().alias(name))
        df = ops.to_polars(table)
        out = df.group_by(self.keys).agg(exprs) if self.keys else df.select(exprs)
        return out.to_arrow()


@dataclass
class SqlStats:
    """Map side of SQL online: the rewritten statistics query over the split, registered as
    ``table``, run by DataFusion or DuckDB."""

    engine: str
    table: str
    query: str

    def apply(self, data: pa.Table) -> pa.Table:
        if self.engine == "duckdb":
            import duckdb

            con = duckdb.connect()
            try:
                con.execute("SET threads TO 1")
                con.register(self.table, data)
                return con.sql(self.query).to_arrow_table()
            finally:
                con.close()
        from flightshuffle._native import datafusion_query

        return datafusion_query(self.query, {self.table: data})


@dataclass
class SqlPlan:
    table: str
    keys: list[str]
    aggs: list[AggRef]
    stats: str
    columns: list[str]
    order: list[tuple[str, bool]]
    limit: int | None


_SQL_KINDS = {"Sum": "sum", "Avg": "mean", "Count": "count", "Min": "min", "Max": "max"}


def plan_sql(query: str, engine: str) -> SqlPlan:
    """Rewrite ``SELECT keys, AGG(x) ... FROM t [WHERE ...] GROUP BY keys [ORDER BY] [LIMIT]``
    into the per-split statistics query."""
    import sqlglot
    from sqlglot import exp

    dialect = "duckdb" if engine == "duckdb" else None
    try:
        tree = sqlglot.parse_one(query, read=dialect)
    except sqlglot.errors.ParseError as e:
        raise ValueError(f"cannot parse the online query: {e}") from e

    def unsupported(what: str) -> ValueError:
        return ValueError(
            f"online aggregation supports SELECT <group keys>, SUM/COUNT/AVG/MIN/MAX(<expr>) "
            f"FROM <one table> [WHERE ...] GROUP BY <keys> [ORDER BY ...] [LIMIT n]; {what}"
        )

    if not isinstance(tree, exp.Select):
        raise unsupported(f"got a {type(tree).__name__}")
    for arg in ("joins", "having", "qualify", "windows", "distinct", "with_"):
        if tree.args.get(arg):
            raise unsupported(f"{arg.rstrip('_').upper()} is not supported")
    source = tree.args.get("from_") or tree.args.get("from")
    if source is None or not isinstance(source.this, exp.Table):
        raise unsupported("the FROM clause must name one table")
    table = source.this.name
    sql = lambda e: e.sql(dialect=dialect)
    group = list(tree.args["group"].expressions) if tree.args.get("group") else []
    group_sql = [sql(g) for g in group]
    keys: list[str] = []
    key_exprs: list[str] = []
    aggs: list[AggRef] = []
    stat_items: list[str] = []
    # Inner projection: each distinct argument evaluated once per row (cast to DOUBLE for the
    # sums; as is for MIN/MAX), then aggregated by the outer query.
    evaluated: dict[str, str] = {}

    def column(text: str) -> str:
        return f'"{evaluated.setdefault(text, f"__x{len(evaluated)}")}"'

    for item in tree.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        name = item.alias_or_name or sql(inner)
        if not list(inner.find_all(exp.AggFunc)):
            if sql(inner) not in group_sql:
                raise unsupported(f"{sql(inner)} is neither an aggregate nor a GROUP BY key")
            keys.append(name)
            key_exprs.append(sql(inner))
            continue
        kind = _SQL_KINDS.get(type(inner).__name__)
        if kind is None or isinstance(inner.this, exp.Distinct) or inner.args.get("distinct"):
            raise unsupported(f"{sql(inner)} is not a plain SUM/COUNT/AVG/MIN/MAX")
        star = isinstance(inner.this, exp.Star)
        if kind == "count" and star:
            kind = "len"
        j = len(aggs)
        aggs.append(AggRef(name, kind))
        arg = "" if star else sql(inner.this)
        for stat in NEEDS[kind]:
            if stat == "m":
                expr = f"{kind.upper()}({column(f'({arg})')})"
            elif kind == "len":
                expr = "COUNT(*)"
            else:
                x = column(f"CAST(({arg}) AS DOUBLE)")
                expr = {"c": f"COUNT({x})", "s": f"SUM({x})", "q": f"SUM({x} * {x})"}[stat]
            stat_items.append(f'{expr} AS "__{stat}{j}"')
    if not aggs:
        raise unsupported("there is no aggregate")
    for g in group_sql:
        if g not in key_exprs:
            raise unsupported(f"GROUP BY key {g} must be selected")
    projected = [f'{e} AS "{k}"' for e, k in zip(key_exprs, keys, strict=True)]
    projected += [f'{text} AS "{c}"' for text, c in evaluated.items()]
    inner_sql = f"SELECT {', '.join(projected) or '1 AS __one'} FROM {sql(source.this)}"
    where = tree.args.get("where")
    if where is not None:
        inner_sql += f" WHERE {sql(where.this)}"
    outer_keys = [f'"{k}"' for k in keys]
    stats = f"SELECT {', '.join(outer_keys + stat_items)} FROM ({inner_sql}) AS __split"
    if keys:
        stats += f" GROUP BY {', '.join(outer_keys)}"
    order: list[tuple[str, bool]] = []
    if tree.args.get("order"):
        for o in tree.args["order"].expressions:
            names = [k for k in keys + [a.name for a in aggs] if k == o.this.alias_or_name]
            if names:
                order.append((names[0], bool(o.args.get("desc"))))
    limit = None
    if tree.args.get("limit") is not None:
        limit = int(tree.args["limit"].expression.name)
    columns = sorted({c.name for c in tree.find_all(exp.Column)})
    return SqlPlan(table, keys, aggs, stats, columns, order, limit)


@dataclass
class OnlineResult:
    """One partial result of an online aggregation."""

    progress: float
    """Fraction of the input rows read (0..1)."""
    final: bool
    """True for the last result, which is exact."""
    estimates: pl.DataFrame
    """Group keys, then per aggregate ``name``: ``name``, ``name_low``, ``name_high``."""
    round: int
    rounds: int
    elapsed: float
    """Seconds since the query started."""
    maps_done: int
    maps_total: int


def estimate(
    state: pl.DataFrame,
    keys: list[str],
    aggs: list[AggRef],
    n: int,
    total: int,
    confidence: float = 0.95,
) -> pl.DataFrame:
    """Estimates and CLT intervals from combined statistics after reading ``n`` of ``total``
    input rows."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    f = n / total if total else 1.0
    fpc = max(0.0, 1.0 - f)
    nn = max(n, 1)
    cols: list[pl.Expr] = [pl.col(k) for k in keys]
    for j, a in enumerate(aggs):
        c = pl.col(f"__c{j}").cast(pl.Float64) if "c" in NEEDS[a.kind] else None
        if a.kind in ("min", "max"):
            m = pl.col(f"__m{j}")
            cols += [m.alias(a.name), m.alias(f"{a.name}_low"), m.alias(f"{a.name}_high")]
            continue
        assert c is not None
        if a.kind in ("count", "len"):
            est = c / f if f > 0 else c
            p = c / nn
            se = total * (p * (1 - p) / nn * fpc).clip(0).sqrt()
        else:
            s, q = pl.col(f"__s{j}").fill_null(0.0), pl.col(f"__q{j}").fill_null(0.0)
            if a.kind == "sum":
                est = s / f if f > 0 else s
                var = (q / nn - (s / nn) ** 2).clip(0)
                se = total * (var / nn * fpc).sqrt()
            else:
                est = pl.when(c > 0).then(s / c)
                var = (q / c - (s / c) ** 2).clip(0)
                se = pl.when(c > 1).then((var / c * fpc).sqrt()).otherwise(None)
        cols += [
            est.alias(a.name),
            (est - z * se).alias(f"{a.name}_low"),
            (est + z * se).alias(f"{a.name}_high"),
        ]
    minmax = [
        f"{a.name}{sfx}" for a in aggs if a.kind in ("min", "max") for sfx in ("_low", "_high")
    ]
    out = state.select(cols)
    if minmax:
        out = out.with_columns([pl.lit(None).cast(out.schema[c]).alias(c) for c in minmax])
    return out


def run(
    cluster: Any,
    splits: list[Split],
    pre_ops: list[Any],
    stats_op: Any,
    columns: list[str] | None,
    keys: list[str],
    aggs: list[AggRef],
    rounds: int,
    confidence: float,
    progress: bool | None,
    order: list[tuple[str, bool]] | None = None,
    limit: int | None = None,
) -> Iterator[OnlineResult]:
    """Run the streaming job and yield estimates after every round."""
    from flightshuffle.dataset import empty

    if rounds < 1:
        raise ValueError("online aggregation needs at least one round")
    if not splits:
        raise ValueError("online aggregation needs input splits")
    stage_ops = [*pre_ops, stats_op]
    schema = apply_ops(empty(splits[0].schema(columns)), stage_ops).schema
    body = cloudpickle.dumps(MapTask(stage_ops))
    tasks = [(body, None, 0, s.native(columns)) for s in splits]
    weights = [s.rows for s in splits]
    total = sum(weights)
    reducer = cloudpickle.dumps(StatsReducer(keys, aggs))
    partitions = cluster.workers if keys else 1
    native = cluster._native.stream(schema, partitions, keys, tasks, weights, rounds, reducer)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=100, unit="%", desc="online", bar_format="{l_bar}{bar}| {n:.0f}%")
    try:
        while True:
            item = native.next_partial()
            if item is None:
                return
            info, table = item
            state = combine(ops.to_polars(table), keys, aggs)
            n = round(info["progress"] * total)
            est = estimate(state, keys, aggs, n, total, confidence)
            by = [c for c, _ in order or []] or keys
            if by:
                est = est.sort(by, descending=[d for _, d in order] if order else False)
            if limit is not None:
                est = est.head(limit)
            if bar is not None:
                bar.update(100 * info["progress"] - bar.n)
            yield OnlineResult(
                progress=info["progress"],
                final=info["final"],
                estimates=est,
                round=info["round"],
                rounds=info["rounds"],
                elapsed=info["elapsed"],
                maps_done=info["maps_done"],
                maps_total=info["maps_total"],
            )
    finally:
        native.close()
        if bar is not None:
            bar.close()
