"""Online aggregation (Hellerstein, Haas, Wang 1997; Exoshuffle §3.3.1) over the streaming
strategy.

Input units (row ranges of the input's files) are read in a random order, in rounds. Every
map task computes, per group and per aggregate, the totals of each unit it read (count, sum,
min, max) and the products of a unit's totals the intervals need; they are shuffled by group
key and every reducer folds each round's blocks into its running state. After each round the
driver turns the states into estimates (:mod:`flightshuffle.estimates`): SUM and COUNT scaled
by the share of rows read, AVG as the ratio of the sums, and intervals from the spread
between units (cluster sampling), with the finite-population correction over units, so the
final round is exact with zero-width intervals. MIN and MAX are the extremes seen so far,
without interval.

Frontends: SQL (run by DataFusion or DuckDB on each split, after rewriting the aggregates into
statistics) and ``Dataset.group_by().agg()`` with Polars expressions.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import polars as pl
import pyarrow as pa

from flightshuffle import footers, ops
from flightshuffle._exec import MapTask, Split, apply_ops
from flightshuffle.estimates import (
    NEEDS,
    PRODUCTS,
    UNITS,
    AggRef,
    Sample,
    Shape,
    combine,
    shaped,
    unit_products,
)
from flightshuffle.joblog import JobLog
from flightshuffle.rewrite import inline_derived, parse, ratio
from flightshuffle.units import FIRST_WAVE_ROWS, fact_units


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
    """Map side of ``group_by().agg()`` online: statistics per group with Polars, and the
    unit's products (a map task reads one unit of ``rows`` rows)."""

    keys: list[str]
    aggs: list[ops.Agg]
    rows: int = 0

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
                elif stat == "m" and a.inner is not None:
                    exprs.append(getattr(a.inner, a.kind)().alias(name))
        df = ops.to_polars(table)
        out = df.group_by(self.keys).agg(exprs) if self.keys else df.select(exprs)
        refs = [AggRef(f"a{j}", a.kind) for j, a in enumerate(self.aggs)]
        return unit_products(out.to_arrow(), refs, self.rows)


@dataclass
class SqlStats:
    """Map side of SQL online: the rewritten statistics query over the split, registered as
    ``table``, run by DataFusion or DuckDB."""

    engine: str
    table: str
    query: str
    keys: list[str]
    stat_of: dict[str, str]
    aggs: list[AggRef] = field(default_factory=list)
    rows: int = 0

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
        return unit_products(ops.to_polars(out).select(cols).to_arrow(), self.aggs, self.rows)


@dataclass
class SqlPlan:
    table: str
    """The first table of FROM (the only one for the DuckDB map side)."""
    tables: list[str]
    """Every table the query reads, once per time it is read."""
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
    terms: list[tuple[int, int]] = field(default_factory=list)
    """The products each unit appends to its statistics (``SplitTotalsExec``'s terms)."""
    term_of: dict[str, int] = field(default_factory=dict)
    """Each product column (:func:`product_columns`) -> its term."""


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

    tables = [t.name for t in parse(query, engine).find_all(exp.Table)]
    required = frozenset(never_null(tables) if never_null else ())
    return _plan_sql(query, engine, required)


@functools.lru_cache(maxsize=256)
def _plan_sql(query: str, engine: str, required: frozenset[str]) -> SqlPlan:
    import sqlglot
    from sqlglot import exp

    dialect = "duckdb" if engine == "duckdb" else None
    tree = inline_derived(parse(query, engine))

    def unsupported(what: str) -> ValueError:
        return ValueError(
            "online aggregation supports SELECT <group keys>, SUM/COUNT/AVG/MIN/MAX(<expr>) "
            "or SUM(<expr>) / SUM(<expr>) FROM <tables or one derived table> [JOIN ...] "
            f"[WHERE ...] GROUP BY <keys> [HAVING ...] [ORDER BY ...] [LIMIT n]; {what}"
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
                expr = {"c": f"COUNT({x})", "s": f"SUM({x})"}[stat]
            col = stat_items.setdefault(expr, f"__u{len(stat_items)}")
            stat_of[f"__{stat}{j}"] = col

    def add_ratio(num: exp.Expression, den: exp.Expression, name: str) -> None:
        # Estimated as an AVG is: ``s`` the numerator's sum, ``c`` the denominator's.
        j = len(aggs)
        aggs.append(AggRef(name, "ratio"))
        for stat, e in (("s", num), ("c", den)):
            if list(e.find_all(exp.AggFunc)):
                raise unsupported(f"{sql(e)} nests aggregates")
            x = column(sql(as_double(e, cast=to_double)))
            col = stat_items.setdefault(f"SUM({x})", f"__u{len(stat_items)}")
            stat_of[f"__{stat}{j}"] = col

    outputs: dict[str, str] = {}
    selected: list[str] = []
    for item in tree.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        # Unnamed: the text, function names in lower case (as DuckDB names `sum(x)`).
        name = item.alias_or_name or inner.sql(dialect=dialect, normalize_functions="lower")
        if not list(inner.find_all(exp.AggFunc)):
            if sql(inner) not in group_sql:
                raise unsupported(f"{sql(inner)} is neither an aggregate nor a GROUP BY key")
            keys.append(name)
            key_exprs.append(sql(inner))
            selected.append(name)
            continue
        selected += [name, f"{name}_low", f"{name}_high", f"{name}_reliable"]
        parts = ratio(inner)
        if parts is not None:
            add_ratio(*parts, name)
            outputs[sql(inner)] = name
            continue
        if not isinstance(inner, exp.AggFunc):
            raise unsupported(
                f"{sql(inner)} computes over aggregates: of those only a ratio of two sums, "
                "SUM(a) / SUM(b), either times a number, has an interval here; select the "
                "aggregates and compute it from the estimates"
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
    terms, term_of = _terms(aggs, list(stat_items.values()), stat_of)
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
        terms,
        term_of,
    )


# Factors of a term that are not statistics (see split_totals.rs).
SIZE, ONE = 2**32 - 1, 2**32 - 2


def _terms(
    aggs: list[AggRef], stat_columns: list[str], stat_of: dict[str, str]
) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The products of a unit's totals the intervals need, each once: factor pairs (a
    statistic's column index, or SIZE), and each product column's term."""
    terms: list[tuple[int, int]] = []
    term_of: dict[str, int] = {}

    def factor(f: str, j: int) -> int:
        return SIZE if f == "m" else stat_columns.index(stat_of[f"__{f}{j}"])

    def add(name: str, pair: tuple[int, int]) -> None:
        pair = (min(pair), max(pair))
        if pair not in terms:
            terms.append(pair)
        term_of[name] = terms.index(pair)

    for j, a in enumerate(aggs):
        for p in PRODUCTS[a.kind]:
            add(f"__{p}{j}", (factor(p[0], j), factor(p[1], j)))
    add(UNITS, (ONE, ONE))
    return terms, term_of


def expand_stats(table: pa.Table, plan: SqlPlan) -> pa.Table:
    """Folded statistics (keys, the statistics query's columns, then the terms' sums, by
    position) as the per-aggregate columns ``__{stat}{j}`` and product columns that
    :func:`combine` and :func:`estimate` read. A statistics query run whole (one final
    result) has no terms."""
    stats = len(plan.keys) + len(plan.stat_columns)
    terms = [f"__term{k}" for k in range(len(plan.terms))]
    if table.num_columns not in (stats, stats + len(terms)):
        raise RuntimeError(
            f"online aggregation: the folded statistics have {table.num_columns} columns, "
            f"expected {stats + len(terms)}"
        )
    with_terms = table.num_columns > stats
    table = table.rename_columns(plan.keys + plan.stat_columns + (terms if with_terms else []))
    cols = {k: table.column(k) for k in plan.keys}
    cols |= {s: table.column(c) for s, c in plan.stat_of.items()}
    if with_terms:
        cols |= {name: table.column(terms[k]) for name, k in plan.term_of.items()}
    return pa.table(cols)


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
    # Each map task reads one split, one sampling unit: its products need its rows.
    tasks = [
        (
            cloudpickle.dumps(MapTask([*pre_ops, replace(stats_op, rows=s.rows)])),
            None,
            0,
            s.native(columns),
        )
        for s in splits
    ]
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
    out = results(
        native, ops.to_polars, shape, sum(weights), len(splits), confidence, progress, started
    )
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
    names = list(dict.fromkeys(plan.tables))
    for t in names:
        if t not in tables:
            raise ValueError(f"unknown table {t!r}: pass it in tables= or register_parquet() it")
    files = {t: parquet_files(tables[t]) for t in names}
    rows = {t: sum(footers.file_rows(f) for f in fs) for t, fs in files.items()}
    # The largest table is sampled (the fact table). Each row of an inner join's result holds
    # one row of every table, so another table read once may be sampled instead: the next
    # largest is tried when the plan cannot make the largest its probe side (DataFusion builds
    # on the smaller side by its estimates: a filtered fact table can look smaller).
    candidates = sorted(names, key=lambda t: -rows[t])
    if plan.tables.count(candidates[0]) > 1:
        raise ValueError(
            f"online aggregation samples the largest table, {candidates[0]!r}, which the query "
            "reads twice (a self-join of the sampled table is not supported; other tables may "
            "repeat)"
        )
    candidates = [t for t in candidates if plan.tables.count(t) == 1][:2]
    shape = Shape(
        plan.keys, plan.aggs, plan.order, plan.limit, plan.having, plan.hidden, plan.selected
    )
    expand = lambda t: expand_stats(t, plan)
    log = JobLog(cluster.native, plan.query, cluster.workers)
    for i, fact in enumerate(candidates):
        # With joins the first estimate waits for the build sides: a first wave cut below a
        # row group brings it little earlier and its extra splits cost more (FIRST_WAVE_ROWS).
        head = FIRST_WAVE_ROWS if len(plan.tables) == 1 else None
        splits, per_task = fact_units(files[fact], want, seed, cluster.workers, rounds, head)
        if not splits:
            log.end(False, f"the fact table {fact!r} has no rows")
            raise ValueError(f"the fact table {fact!r} has no rows")
        total = sum(s[4] for s in splits)
        try:
            native, cluster.last_online_plan = cluster.native.online_sql(
                plan.stats,
                [(t, tables[t], footers.version(files[t])) for t in names],
                splits,
                rounds,
                emit_top(plan),
                plan.terms,
                per_task,
            )
            break
        except ValueError as e:
            if "must end in a partial aggregate" in str(e) and i + 1 < len(candidates):
                continue
            if "small enough to run whole" not in str(e):
                log.end(False, str(e))
                raise
            # Nothing to stream: the statistics query runs whole, its one result is exact.
            native = _Whole(cluster.sql(plan.stats), started)
            cluster.last_online_plan = cluster.explain(plan.stats)
            break
        except BaseException as e:
            log.end(False, str(e))
            raise
    out = results(native, expand, shape, total, len(splits), confidence, progress, started)
    return log.rounds(out)


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
    if kind == "ratio":
        # Denominators may be negative or zero: every group is sent.
        return None
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


def results(
    native: Any,
    to_stats: Any,
    shape: Shape,
    total: int,
    units: int,
    confidence: float,
    progress: bool | None,
    started: float,
) -> Iterator[OnlineResult]:
    """Turn each round's folded statistics from ``native`` (of ``units`` sampling units and
    ``total`` rows) into an :class:`OnlineResult`."""
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
            sample = Sample(
                units=units if info["final"] else info.get("units_done", info["maps_done"]),
                total_units=units,
                rows=round(info["progress"] * total),
                total_rows=total,
                row_squares=info.get("weight_squares", 0.0),
            )
            est = shaped(state, shape, sample, confidence)
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
