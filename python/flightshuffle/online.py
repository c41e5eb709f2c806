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

import functools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import polars as pl
import pyarrow as pa

from flightshuffle import footers, ops
from flightshuffle._exec import MapTask, Split, apply_ops
from flightshuffle.estimates import NEEDS, AggRef, Shape, combine, shaped
from flightshuffle.joblog import JobLog


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
    keys: list[str]
    stat_of: dict[str, str]

    def apply(self, data: pa.Table) -> pa.Table:
        if self.engine == "duckdb":
            import duckdb

            con = duckdb.connect()
            try:
                con.execute("SET threads TO 1")
                con.register(self.table, data)
                out = con.sql(self.query).to_arrow_table()
            finally:
                con.close()
        else:
            from flightshuffle._native import datafusion_query

            out = datafusion_query(self.query, {self.table: data})
        cols = [pl.col(k) for k in self.keys]
        cols += [pl.col(c).alias(s) for s, c in self.stat_of.items()]
        return ops.to_polars(out).select(cols).to_arrow()


@dataclass
class SqlPlan:
    table: str
    """The first table of FROM (the only one for the DuckDB map side)."""
    tables: list[str]
    """Every table the query reads."""
    keys: list[str]
    aggs: list[AggRef]
    stats: str
    """The statistics query: per group, one column per distinct statistic (``stat_columns``)."""
    stat_columns: list[str]
    stat_of: dict[str, str]
    """Each aggregate's statistic ``__{stat}{j}`` -> the statistics query's column."""
    columns: list[str]
    order: list[tuple[str, bool]]
    limit: int | None
    having: str | None = None
    """A filter over the estimates (aggregates replaced by their output names)."""
    hidden: list[str] | None = None
    """Aggregates only HAVING uses: estimated, then dropped from the output."""
    selected: list[str] | None = None
    """Output columns in SELECT order (each aggregate followed by its interval)."""
    query: str = ""
    """The query's text (for its event log)."""


_SQL_KINDS = {"Sum": "sum", "Avg": "mean", "Count": "count", "Min": "min", "Max": "max"}


# DataFusion's CAST to DOUBLE with the same results, faster for decimals (registered by
# flightshuffle in every session, engines/datafusion/src/double.rs). Plans are cached: a
# change here reaches queries asked before only after ``_plan_sql.cache_clear()``.
TO_DOUBLE: str | None = "fs_to_double"


def as_double(e: Any, nested: bool = False, cast: str | None = None) -> Any:
    """``CAST(e AS DOUBLE)`` with the cast pushed down through ``+``, ``-``, ``*``, unary minus
    and parentheses to the operands: decimal arithmetic is done in DOUBLE instead of being
    cast row by row afterwards. TPC-H Q1's statistics query, single-process DataFusion at SF1:
    0.53 s with the casts outside, 0.35 s with them on the columns (Q1 itself 0.34 s). Not
    through ``/`` (integer division would become float division), functions or CASE: those
    are cast whole. Numeric literals inside the arithmetic stay as they are. With ``cast``,
    an operand that is not a literal is cast by that function instead (``fs_to_double``,
    DataFusion's ``CAST`` to DOUBLE, faster for decimals)."""
    from sqlglot import exp

    def double(x: Any) -> Any:
        if cast is None or not list(x.find_all(exp.Column)):
            return exp.Cast(this=x.copy(), to=exp.DataType.build("DOUBLE"))
        return exp.Anonymous(this=cast, expressions=[x.copy()])

    if not nested and not list(e.find_all(exp.Column)):
        # Literals only (SUM(1 + 1)): nothing to push the cast to.
        return double(e)
    if isinstance(e, exp.Paren):
        return exp.Paren(this=as_double(e.this, nested, cast))
    if isinstance(e, exp.Neg):
        return exp.Neg(this=as_double(e.this, nested, cast))
    if isinstance(e, (exp.Add, exp.Sub, exp.Mul)):
        return type(e)(
            this=as_double(e.this, True, cast), expression=as_double(e.expression, True, cast)
        )
    if nested and isinstance(e, exp.Literal) and e.is_number:
        return e.copy()
    return double(e)


def _never_null(e: Any, required: frozenset[str], tables: frozenset[str]) -> bool:
    """True when ``e`` is arithmetic (``+ - *``, casts, parentheses) over literals and
    columns in ``required`` only: it is never null. A column qualified by anything but one of
    the query's ``tables`` (or their aliases) may be a struct field: not known."""
    from sqlglot import exp

    if isinstance(e, exp.Column):
        if e.table and e.table not in tables:
            return False
        # DataFusion folds unquoted identifiers to lower case.
        return (e.name if e.this.quoted else e.name.lower()) in required
    if isinstance(e, exp.Literal):
        return True
    if isinstance(e, (exp.Paren, exp.Neg)) or (
        isinstance(e, exp.Cast) and not isinstance(e, exp.TryCast)
    ):
        return _never_null(e.this, required, tables)
    if isinstance(e, (exp.Add, exp.Sub, exp.Mul)):
        return _never_null(e.left, required, tables) and _never_null(e.right, required, tables)
    return False


def plan_sql(
    query: str, engine: str, never_null: Callable[[list[str]], set[str]] | None = None
) -> SqlPlan:
    """Rewrite ``SELECT keys, AGG(x) ... FROM tables [JOIN ...] [WHERE ...] GROUP BY keys
    [HAVING ...] [ORDER BY] [LIMIT]`` into the per-split statistics query. ``never_null``
    names the columns of the query's tables that hold no null: the count of an argument
    computed from those alone is ``COUNT(*)``, shared by all such aggregates (TPC-H Q1
    counts once instead of six times). Plans are kept: a query asked again is not rewritten
    again (15 ms for TPC-H Q10, on the way to its first split)."""
    from sqlglot import exp

    tables = [t.name for t in _parse(query, engine).find_all(exp.Table)]
    required = frozenset(never_null(tables) if never_null else ())
    return _plan_sql(query, engine, required)


@functools.lru_cache(maxsize=256)
def _parse(query: str, engine: str) -> Any:
    """The query's syntax tree (shared: callers copy what they change)."""
    import sqlglot

    try:
        return sqlglot.parse_one(query, read="duckdb" if engine == "duckdb" else None)
    except sqlglot.errors.ParseError as e:
        raise ValueError(f"cannot parse the online query: {e}") from e


@functools.lru_cache(maxsize=256)
def _plan_sql(query: str, engine: str, required: frozenset[str]) -> SqlPlan:
    import sqlglot
    from sqlglot import exp

    dialect = "duckdb" if engine == "duckdb" else None
    tree = _parse(query, engine)

    def unsupported(what: str) -> ValueError:
        return ValueError(
            "online aggregation supports SELECT <group keys>, SUM/COUNT/AVG/MIN/MAX(<expr>) "
            "FROM <tables> [JOIN ...] [WHERE ...] GROUP BY <keys> [HAVING ...] [ORDER BY ...] "
            f"[LIMIT n]; {what}"
        )

    def sql(e: exp.Expression) -> str:
        return e.sql(dialect=dialect)

    if not isinstance(tree, exp.Select):
        raise unsupported(f"got a {type(tree).__name__}")
    for arg in ("qualify", "windows", "distinct", "with_"):
        if tree.args.get(arg):
            raise unsupported(f"{arg.rstrip('_').upper()} is not supported")
    if any(s is not tree for s in tree.find_all(exp.Select)):
        raise unsupported("subqueries are not supported")
    for j in tree.args.get("joins") or []:
        kind = (j.args.get("kind") or "").upper()
        if j.args.get("side") or kind not in ("", "INNER", "CROSS"):
            raise unsupported(
                f"{sql(j).split(' ON ')[0].strip()}: only inner joins keep every result row "
                "tied to one row of the fact table, which the estimates scale"
            )
    if engine == "duckdb" and tree.args.get("joins"):
        raise unsupported("joins need engine='datafusion' (DuckDB reads one table per split)")
    source = tree.args.get("from_") or tree.args.get("from")
    if source is None:
        raise unsupported("there is no FROM clause")
    tables = [t.name for t in tree.find_all(exp.Table)]
    if not isinstance(source.this, exp.Table) or any(
        not isinstance(j.this, exp.Table) for j in tree.args.get("joins") or []
    ):
        raise unsupported("FROM and JOIN must name tables (no subqueries)")
    if len(tables) != len(set(tables)):
        raise unsupported("a table is read twice (self-joins are not supported)")
    table = source.this.name
    named = frozenset(n for t in tree.find_all(exp.Table) for n in (t.name, t.alias_or_name))
    to_double = TO_DOUBLE if engine == "datafusion" else None
    group = list(tree.args["group"].expressions) if tree.args.get("group") else []
    # GROUP BY may name a selected column by its alias or its position.
    items = [(i.alias_or_name, i.this if isinstance(i, exp.Alias) else i) for i in tree.expressions]
    aliases = {alias: sql(e) for alias, e in items if alias}

    def group_key(g: exp.Expression) -> str:
        if isinstance(g, exp.Literal) and g.is_int and 1 <= int(g.name) <= len(items):
            return sql(items[int(g.name) - 1][1])
        if isinstance(g, exp.Column) and not g.table and g.name in aliases:
            return aliases[g.name]
        return sql(g)

    group_sql = [group_key(g) for g in group]
    keys: list[str] = []
    key_exprs: list[str] = []
    aggs: list[AggRef] = []
    # Each distinct statistic is computed once (DataFusion would merge duplicates anyway, and
    # the folded columns are matched by position).
    stat_items: dict[str, str] = {}
    stat_of: dict[str, str] = {}
    # Inner projection: each distinct argument evaluated once per row (cast to DOUBLE for the
    # sums; as is for MIN/MAX), then aggregated by the outer query.
    evaluated: dict[str, str] = {}

    def column(text: str) -> str:
        return f'"{evaluated.setdefault(text, f"__x{len(evaluated)}")}"'

    def add_agg(node: exp.Expression, name: str) -> None:
        kind = _SQL_KINDS.get(type(node).__name__)
        if kind is None or isinstance(node.this, exp.Distinct) or node.args.get("distinct"):
            raise unsupported(f"{sql(node)} is not a plain SUM/COUNT/AVG/MIN/MAX")
        star = isinstance(node.this, exp.Star)
        if kind == "count" and star:
            kind = "len"
        j = len(aggs)
        aggs.append(AggRef(name, kind))
        arg = "" if star else sql(node.this)
        if arg and list(node.this.find_all(exp.AggFunc)):
            raise unsupported(f"{sql(node)} nests aggregates")
        for stat in NEEDS[kind]:
            if stat == "m":
                expr = f"{kind.upper()}({column(f'({arg})')})"
            elif kind == "len" or (stat == "c" and _never_null(node.this, required, named)):
                expr = "COUNT(*)"
            else:
                x = column(sql(as_double(node.this, cast=to_double)))
                expr = {"c": f"COUNT({x})", "s": f"SUM({x})", "q": f"SUM({x} * {x})"}[stat]
            col = stat_items.setdefault(expr, f"__u{len(stat_items)}")
            stat_of[f"__{stat}{j}"] = col

    outputs: dict[str, str] = {}
    selected: list[str] = []
    for item in tree.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        name = item.alias_or_name or sql(inner)
        if not list(inner.find_all(exp.AggFunc)):
            if sql(inner) not in group_sql:
                raise unsupported(f"{sql(inner)} is neither an aggregate nor a GROUP BY key")
            keys.append(name)
            key_exprs.append(sql(inner))
            selected.append(name)
            continue
        selected += [name, f"{name}_low", f"{name}_high"]
        if not isinstance(inner, exp.AggFunc):
            raise unsupported(
                f"{sql(inner)} computes over aggregates, which has no interval here; select "
                "the aggregates and compute it from the estimates"
            )
        add_agg(inner, name)
        outputs[sql(inner)] = name
    if not aggs:
        raise unsupported("there is no aggregate")
    for g in group_sql:
        if g not in key_exprs:
            raise unsupported(f"GROUP BY key {g} must be selected")
    # HAVING: a filter over the estimates; aggregates it names that are not selected are
    # estimated too, under hidden names.
    having = None
    hidden: list[str] = []
    if tree.args.get("having") is not None:
        cond = tree.args["having"].this.copy()
        for node in list(cond.find_all(exp.AggFunc)):
            text = sql(node)
            if text not in outputs:
                outputs[text] = f"__having{len(hidden)}"
                hidden.append(outputs[text])
                add_agg(node, outputs[text])
            node.replace(exp.column(outputs[text], quoted=True))
        having = cond.sql(dialect="duckdb")
    projected = [f'{e} AS "{k}"' for e, k in zip(key_exprs, keys, strict=True)]
    projected += [f'{text} AS "{c}"' for text, c in evaluated.items()]
    inner_tree = tree.copy()
    for arg in ("group", "order", "limit", "having", "offset"):
        inner_tree.set(arg, None)
    inner_tree.set(
        "expressions", [sqlglot.parse_one(p, read=dialect) for p in projected or ["1 AS __one"]]
    )
    inner_sql = sql(inner_tree)
    outer_keys = [f'"{k}"' for k in keys]
    items = [f'{e} AS "{c}"' for e, c in stat_items.items()]
    stats = f"SELECT {', '.join(outer_keys + items)} FROM ({inner_sql}) AS __split"
    if keys:
        stats += f" GROUP BY {', '.join(outer_keys)}"
    order: list[tuple[str, bool]] = []
    if tree.args.get("order"):
        names = keys + [a.name for a in aggs]
        for o in tree.args["order"].expressions:
            target = o.this.alias_or_name
            if isinstance(o.this, exp.AggFunc) and sql(o.this) in outputs:
                target = outputs[sql(o.this)]
            if target not in names:
                raise unsupported(f"ORDER BY {sql(o.this)} must name a selected column")
            order.append((target, bool(o.args.get("desc"))))
    limit = None
    if tree.args.get("limit") is not None:
        limit = int(tree.args["limit"].expression.name)
    columns = sorted({c.name for c in tree.find_all(exp.Column)})
    return SqlPlan(
        table,
        tables,
        keys,
        aggs,
        stats,
        list(stat_items.values()),
        stat_of,
        columns,
        order,
        limit,
        having,
        hidden,
        selected,
        query,
    )


def expand_stats(table: pa.Table, plan: SqlPlan) -> pa.Table:
    """Folded statistics (keys, then the statistics query's columns, by position) as the
    per-aggregate columns ``__{stat}{j}`` that :func:`combine` and :func:`estimate` read."""
    want = len(plan.keys) + len(plan.stat_columns)
    if table.num_columns != want:
        raise RuntimeError(
            f"online aggregation: the folded statistics have {table.num_columns} columns, "
            f"expected {want}"
        )
    table = table.rename_columns(plan.keys + plan.stat_columns)
    cols = {k: table.column(k) for k in plan.keys}
    return pa.table(cols | {s: table.column(c) for s, c in plan.stat_of.items()})


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
    plan: SqlPlan | None = None,
    started: float | None = None,
) -> Iterator[OnlineResult]:
    """Run the streaming job with Python map tasks and yield estimates after every round
    (their ``elapsed`` counts from ``started``, default now)."""
    from flightshuffle.dataset import empty

    if rounds < 1:
        raise ValueError("online aggregation needs at least one round")
    if not splits:
        raise ValueError("online aggregation needs input splits")
    started = time.perf_counter() if started is None else started
    stage_ops = [*pre_ops, stats_op]
    schema = apply_ops(empty(splits[0].schema(columns)), stage_ops).schema
    body = cloudpickle.dumps(MapTask(stage_ops))
    tasks = [(body, None, 0, s.native(columns)) for s in splits]
    weights = [s.rows for s in splits]
    reducer = cloudpickle.dumps(StatsReducer(keys, aggs))
    partitions = cluster.workers if keys else 1
    log = JobLog(cluster.native, plan.query if plan else "group_by().agg()", cluster.workers)
    try:
        native = cluster.native.stream(schema, partitions, keys, tasks, weights, rounds, reducer)
    except BaseException as e:
        log.end(False, str(e))
        raise
    shape = Shape(keys, aggs, order, limit)
    if plan is not None:
        shape = Shape(keys, aggs, order, limit, plan.having, plan.hidden, plan.selected)
    out = results(native, ops.to_polars, shape, sum(weights), confidence, progress, started)
    return log.rounds(out)


def run_sql(
    cluster: Any,
    plan: SqlPlan,
    tables: dict[str, str],
    rounds: int,
    want: int,
    seed: int | None,
    confidence: float,
    progress: bool | None,
    started: float | None = None,
) -> Iterator[OnlineResult]:
    """Online SQL with the native map side: the statistics query is planned once by
    DataFusion on the driver; the largest table (the fact table) is read in random splits,
    one per map task, joined with the other tables (broadcast to every worker before the
    first split), and folded as they commit: an early first round of one split per worker,
    then the others in ``rounds`` rounds."""
    from flightshuffle.dataset import parquet_files

    if rounds < 1:
        raise ValueError("online aggregation needs at least one round")
    started = time.perf_counter() if started is None else started
    for t in plan.tables:
        if t not in tables:
            raise ValueError(f"unknown table {t!r}: pass it in tables= or register_parquet() it")
    files = {t: parquet_files(tables[t]) for t in plan.tables}
    rows = {t: sum(footers.file_rows(f) for f in fs) for t, fs in files.items()}
    fact = max(plan.tables, key=lambda t: rows[t])
    # With joins the first estimate waits for the build sides: a first wave cut below a row
    # group brings it little earlier and its extra splits cost more (see FIRST_WAVE_ROWS).
    head = FIRST_WAVE_ROWS if len(plan.tables) == 1 else None
    splits = fact_splits(files[fact], want, seed, cluster.workers, rounds, head)
    if not splits:
        raise ValueError(f"the fact table {fact!r} has no rows")
    shape = Shape(
        plan.keys, plan.aggs, plan.order, plan.limit, plan.having, plan.hidden, plan.selected
    )
    total = sum(s[4] for s in splits)
    expand = lambda t: expand_stats(t, plan)
    log = JobLog(cluster.native, plan.query, cluster.workers)
    try:
        native, cluster.last_online_plan = cluster.native.online_sql(
            plan.stats,
            [(t, tables[t], footers.version(files[t])) for t in plan.tables],
            splits,
            rounds,
            emit_top(plan),
        )
    except ValueError as e:
        if "small enough to run whole" not in str(e):
            log.end(False, str(e))
            raise
        # Nothing to stream: the statistics query runs whole, its one result is exact.
        native = _Whole(cluster.sql(plan.stats), started)
        cluster.last_online_plan = cluster.explain(plan.stats)
    except BaseException as e:
        log.end(False, str(e))
        raise
    return log.rounds(results(native, expand, shape, total, confidence, progress, started))


def emit_top(plan: SqlPlan) -> tuple[int, int | None, bool, bool, int] | None:
    """For ``ORDER BY x ... LIMIT k`` without HAVING: which folded column orders the
    estimates by ``x`` (column, divisor for an AVG, a null SUM counted as 0), descending, and
    k; the workers then send only the groups that can be among the first k of every round.
    None when every group is needed (no LIMIT, a HAVING filter over the estimates)."""
    if plan.limit is None or plan.having or not plan.order:
        return None
    name, desc = plan.order[0]
    width = len(plan.keys)
    if name in plan.keys:
        return (plan.keys.index(name), None, False, desc, plan.limit)
    j = next((i for i, a in enumerate(plan.aggs) if a.name == name), None)
    if j is None:
        return None

    def at(stat: str) -> int:
        return width + plan.stat_columns.index(plan.stat_of[f"__{stat}{j}"])

    kind = plan.aggs[j].kind
    if kind == "sum":
        return (at("s"), None, True, desc, plan.limit)
    if kind == "mean":
        return (at("s"), at("c"), True, desc, plan.limit)
    if kind in ("count", "len"):
        return (at("c"), None, False, desc, plan.limit)
    if kind in ("min", "max"):
        return (at("m"), None, False, desc, plan.limit)
    return None


class _Whole:
    """The stream of a statistics query run whole: one final result."""

    def __init__(self, table: pa.Table, started: float) -> None:
        self.table: pa.Table | None = table
        self.started = started

    def next_partial(self) -> tuple[dict[str, Any], pa.Table] | None:
        if self.table is None:
            return None
        table, self.table = self.table, None
        info = {"progress": 1.0, "final": True, "round": 0, "rounds": 1}
        info |= {"maps_done": 0, "maps_total": 0}
        return info, table

    def close(self) -> None:
        self.table = None


# Rows a split of the first wave reads at most (a quarter of the 262,144-row row groups
# DataFusion and tpchgen write), for a query over one table: its first estimate comes after
# that many rows per worker, not a whole row group each. A/B in one cluster, 10 seeds x 3
# runs, TPC-H SF1: Q1's first estimate 74 -> 49 ms (median), time-to-5% / SQL 0.146 ->
# 0.106. Its W extra splits (the tails) cost the joins more than they bring: Q3's first
# estimate 110 -> 105 ms, its whole run / SQL 1.258 -> 1.279; Q10 182 -> 165 ms and
# 1.167 -> 1.208; so queries with joins read whole row groups from the start.
FIRST_WAVE_ROWS = 65_536


def fact_splits(
    files: list[str],
    want: int,
    seed: int | None,
    first: int = 0,
    rounds: int = 0,
    head_rows: int | None = None,
) -> list[tuple[str, int, int, int, int]]:
    """The fact table's splits in a random order: (path, file bytes, file rows, first row,
    rows). One per row group, row groups cut into row ranges when there would be fewer than
    ``want``; then consecutive whole row groups of a file read as one split of at most
    :data:`SPLIT_ROWS` rows, as long as ``first + rounds`` splits remain. The first ``first``
    splits (the first wave: one per worker) read one row group (at most ``head_rows`` rows);
    the rest of each is one more split, at a random place among the others."""
    import os
    import random

    from flightshuffle.dataset import make_splits, shuffled

    splits, _ = make_splits(files, want)
    meta: dict[str, tuple[int, int, list[int]]] = {}
    sizes: dict[str, list[int]] = {}
    for f in files:
        md = footers.metadata(f)
        sizes[f] = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        offsets = [0]
        for n in sizes[f]:
            offsets.append(offsets[-1] + n)
        meta[f] = (os.path.getsize(f), md.num_rows, offsets)
    # (path, first row, rows, rows of its first row group or piece) in file order.
    units = [
        (s.path, meta[s.path][2][s.row_group] + s.start, s.rows, s.rows)
        for s in splits
        if s.rows > 0
    ]
    if len(units) == sum(len(g) for g in sizes.values()):
        k = runs_per_split(list(sizes.values()), first + rounds)
        units = [
            (f, meta[f][2][i], sum(g[i : i + k]), g[i])
            for f, g in sizes.items()
            for i in range(0, len(g), k)
            if sum(g[i : i + k]) > 0
        ]
    order = shuffled(units, seed)  # type: ignore[arg-type]
    rng = random.Random(None if seed is None else f"{seed}/first wave")
    out = [(os.path.abspath(f), *meta[f][:2], start, rows) for f, start, rows, _ in order]
    rest = out[first:]
    for i, (f, start, rows, head) in enumerate(order[:first]):
        cut = min(head, head_rows or head)
        if rows > cut:
            path, size, file_rows = out[i][:3]
            out[i] = (path, size, file_rows, start, cut)
            rest.insert(
                rng.randrange(len(rest) + 1), (path, size, file_rows, start + cut, rows - cut)
            )
    return out[:first] + rest


# Rows a split after the first wave reads at most when whole row groups are merged into it
# (four of the 262,144-row row groups DataFusion and tpchgen write). Every split is a map
# task: a call, a commit, blocks every fold reads, a Parquet open. With 24 single row groups
# TPC-H Q3 at SF1 took 1.22 x distributed SQL, with 12 splits of two 1.06 (A/B in one
# cluster, fastest of 10).
SPLIT_ROWS = 1 << 20


def runs_per_split(groups: list[list[int]], at_least: int) -> int:
    """How many consecutive row groups of a file one split reads: the most that keeps every
    split within :data:`SPLIT_ROWS` rows and at least ``at_least`` splits (``groups``: each
    file's row group sizes)."""
    k = 1
    while True:
        nxt = k + 1
        count = sum(-(-len(g) // nxt) for g in groups)
        widest = max(
            (sum(g[i : i + nxt]) for g in groups for i in range(0, len(g), nxt)), default=0
        )
        if (
            nxt > max((len(g) for g in groups), default=0)
            or count < at_least
            or widest > SPLIT_ROWS
        ):
            return k
        k = nxt


def results(
    native: Any,
    to_stats: Any,
    shape: Shape,
    total: int,
    confidence: float,
    progress: bool | None,
    started: float,
) -> Iterator[OnlineResult]:
    """Turn each round's folded statistics from ``native`` into an :class:`OnlineResult`."""
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
            state = to_stats(table)
            n = round(info["progress"] * total)
            est = shaped(state, shape, n, total, confidence)
            if bar is not None:
                bar.update(100 * info["progress"] - bar.n)
            yield OnlineResult(
                progress=info["progress"],
                final=info["final"],
                estimates=est,
                round=info["round"],
                rounds=info["rounds"],
                elapsed=time.perf_counter() - started,
                maps_done=info["maps_done"],
                maps_total=info["maps_total"],
            )
    finally:
        native.close()
        if bar is not None:
            bar.close()


def plot_history(history: list, keys: list[str], names: list[str], path: str, top: int) -> None:
    """Estimate and interval versus time for the ``top`` largest groups, one panel per
    aggregate (at most four), each relative to the group's final answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    final = history[-1].estimates
    first = names[0]
    groups = final.sort(first, descending=True).head(top).select(keys).rows()
    shown = names[:4]
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.6 * len(shown)), squeeze=False)
    for ax, name in zip(axes[:, 0], shown, strict=True):
        for g in groups:
            cond = pl.all_horizontal([pl.col(k) == v for k, v in zip(keys, g, strict=True)])
            t, est, lo, hi = [], [], [], []
            exact = final.filter(cond)[name][0] or 1.0
            for r in history:
                row = r.estimates.filter(cond)
                if row.height:
                    t.append(r.elapsed)
                    est.append(row[name][0] / exact)
                    low, high = row[f"{name}_low"][0], row[f"{name}_high"][0]
                    lo.append(None if low is None else low / exact)
                    hi.append(None if high is None else high / exact)
            label = "/".join(str(v) for v in g)
            (line,) = ax.plot(t, est, marker="o", label=label)
            if all(v is not None for v in lo + hi):
                ax.fill_between(t, lo, hi, alpha=0.2, color=line.get_color())
        ax.set_ylabel(f"{name} / final")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(title="/".join(keys), fontsize="small")
    axes[-1, 0].set_xlabel("seconds since start")
    fig.suptitle("online aggregation: estimate and 95% interval per round, relative to final")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def flight_sql_rounds(cluster: Any, sql: str) -> Iterator[tuple[float, pa.Table]] | None:
    """``sql`` online on ``cluster`` for the Flight SQL endpoint's ``PollFlightInfo``: each
    round as (fraction read, its estimates with ``__round`` and ``__fraction`` columns), or
    None when online aggregation does not run this query (the endpoint then runs it whole,
    and reports any error in it)."""
    try:
        rounds = cluster.online(sql, progress=False)
    except ValueError:
        return None

    def tagged() -> Iterator[tuple[float, pa.Table]]:
        for i, r in enumerate(rounds):
            estimates = r.estimates.with_columns(
                pl.lit(i, pl.Int32).alias("__round"),
                pl.lit(float(r.progress), pl.Float64).alias("__fraction"),
            )
            yield float(r.progress), estimates.to_arrow()

    return tagged()
