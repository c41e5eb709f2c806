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

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import polars as pl
import pyarrow as pa

from flightshuffle import footers, ops
from flightshuffle._exec import MapTask, Split, apply_ops
from flightshuffle.estimates import (
    DISTINCT_COUNTS,
    NEEDS,
    AggRef,
    Sample,
    Shape,
    combine,
    shaped,
    unit_products,
)
from flightshuffle.joblog import JobLog
from flightshuffle.sql_plan import SqlPlan, distinct_counts, emit_top, expand_stats
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
        shape = Shape(
            keys, aggs, order, limit, plan.having, plan.hidden, plan.selected,
            having_certain=plan.having_certain,
        )  # fmt: skip
    out = results(
        native, ops.to_polars, shape, sum(weights), len(splits), confidence, progress, started
    )
    return log.rounds(out)


def plan_online_sql(cluster: Any, query: str, engine: str) -> tuple[SqlPlan, list[str]]:
    """``query`` planned for online aggregation on ``cluster``: with the DataFusion engine its
    subqueries run exactly first (:func:`flightshuffle.rewrite.resolve`), their values written
    into the query. Returns the plan and the tables made for it (many values, or a correlated
    subquery's value per key, as a table the query joins), which :func:`forget` removes once
    the online query ends; on an error they are removed at once."""
    import uuid

    from flightshuffle.rewrite import resolve
    from flightshuffle.sql_plan import plan_sql

    kept: list[str] = []

    def keep(values: Any) -> str:
        name = f"__in_{uuid.uuid4().hex[:12]}"
        cluster._tables[name] = cluster._write_arrow(values, name)
        kept.append(name)
        return name

    # The first subquery registers the tables online queries were given (an EXISTS runs
    # several probes; each would register them all again).
    unregistered = dict(cluster._tables)

    def run(q: str) -> Any:
        pending = dict(unregistered)
        unregistered.clear()
        return cluster.sql(q, tables=pending, progress=False)

    try:
        if engine == "datafusion":  # (DuckDB map tasks take one table, no subquery)
            query = resolve(query, engine, run, keep)
        return plan_sql(query, engine, cluster._never_null), kept
    except BaseException:
        forget(cluster, kept)
        raise


def forget(cluster: Any, names: list[str]) -> None:
    """Unregister the tables ``names`` from ``cluster`` and remove their files."""
    for name in names:
        path = cluster._tables.pop(name, None)
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)


def forgetting(cluster: Any, results: Iterator[Any], names: list[str]) -> Iterator[Any]:
    """``results``, then (when exhausted, closed or dropped) :func:`forget` ``names``."""
    try:
        yield from results
    finally:
        forget(cluster, names)


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
    candidates = sorted(dict.fromkeys(plan.samplable), key=lambda t: -rows[t])
    # A table that a semi or anti join also reads is read whole there (TPC-H Q21's EXISTS
    # over lineitem): only its rows in the result are sampled.
    if plan.samplable.count(candidates[0]) > 1:
        raise ValueError(
            f"online aggregation samples the largest table, {candidates[0]!r}, which the query "
            "joins with itself (a self-join of the sampled table is not supported, except in "
            "an EXISTS or as the table of a LEFT JOIN; other tables may repeat)"
        )
    candidates = [t for t in candidates if plan.samplable.count(t) == 1][:2]
    keys = plan.keys[:-1] if plan.distinct else plan.keys  # without COUNT(DISTINCT)'s value
    shape = Shape(
        keys, plan.aggs, plan.order, plan.limit, plan.having, plan.hidden, plan.selected,
        having_certain=plan.having_certain, distinct=plan.distinct,
    )  # fmt: skip
    expand = lambda t: expand_stats(t, plan)
    if plan.distinct:
        # The folds send COUNT(DISTINCT)'s counts per group (keys, __d, __f1), not their
        # state per group and value (estimates.distinct_estimates); a whole run sends that.
        expand = lambda t: (
            t.rename_columns(keys + DISTINCT_COUNTS)
            if t.column_names[-2:] == DISTINCT_COUNTS
            else expand_stats(t, plan)
        )
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
                distinct_counts(plan),
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
