"""``flightshuffle-bench online-bench``: online aggregation of TPC-H queries (with joins) next to the
same queries as distributed SQL, in the same run on the same cluster; prints JSON and draws
one estimate-vs-time plot per query.

Per query: when the first estimate arrived, when every estimate of the top groups (the rows
the query returns, at most ``--top``, in its order) was within ``--within`` (and within 1%) of
the final answer, the whole streaming run, and the distributed SQL run: ``--repeat`` runs of each,
alternating, the fastest of each kept (its history gives the times of the estimates). Every
final answer is checked against DuckDB's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from flightshuffle.estimates import value_columns

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit


def top_within(history: list, final: Any, keys: list[str], names: list[str], top: int, rel: float):
    """The first result in which each of the final's first ``top`` groups has every estimate
    within ``rel`` of its final value (the final result if none is earlier)."""
    want = final.estimates.head(top).select(keys + names)
    for r in history:
        est = r.estimates.select(keys + names)
        if keys:
            got = want.join(est, on=keys, how="left", suffix="_e")
        else:  # one row each
            got = want.hstack(est.rename({n: f"{n}_e" for n in names}))
        ok = True
        for n in names:
            err = ((got[f"{n}_e"] - got[n]).abs() / got[n].abs().clip(1e-12)).fill_nan(0.0)
            if err.null_count() or float(err.max() or 0.0) > rel:
                ok = False
                break
        if ok:
            return r
    return final


def estimate_columns(est: Any) -> tuple[list[str], list[str]]:
    """An online result's group keys and estimated columns (those with an interval)."""
    names = [x for x in est.columns if f"{x}_low" in est.columns]
    keys = [k for k in value_columns(est.columns) if k not in names]
    return keys, names


def first_within(history: list, top: int = 10, rel: float = 0.05):
    """:func:`top_within` of a whole run (its last result is the final)."""
    keys, names = estimate_columns(history[-1].estimates)
    return top_within(history, history[-1], keys, names, top, rel)


def run(args: argparse.Namespace) -> int:
    from flightshuffle import Cluster
    from flightshuffle.online import plot_history

    root = tpch.ensure_data(args.sf, args.data or f"data/tpch-sf{args.sf:g}", progress=True)
    con = tpch.duckdb_connect(root)
    report: dict[str, Any] = {"sf": args.sf, "workers": args.workers, "rounds": args.rounds}
    # --ab NAME=V1,V2: each query online once per value of the setting, alternating.
    setting, values = None, [None]
    if args.ab:
        setting, _, listed = args.ab.partition("=")
        values = listed.split(",")
        report["ab"] = {"setting": setting, "values": values}
    rows = []
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:
        for name, path in tpch.table_paths(root).items():
            c.register_parquet(name, path)
        for n in args.queries:
            query, ordered = tpch.query(n, args.sf)
            # Warm both paths (first DataFusion session and Parquet reads on each worker).
            c.sql(query)
            list(c.online(query, rounds=args.rounds, seed=args.seed, progress=False))
            # Both sides the same way: runs alternate, the fastest of each is kept.
            sql_s: list[float] = []
            runs: dict[Any, list] = {v: [] for v in values}
            for rep in range(args.repeat):
                start = time.perf_counter()
                c.sql(query)
                sql_s.append(time.perf_counter() - start)
                for v in values if rep % 2 == 0 else values[::-1]:
                    if setting is not None:
                        c.sql(f"SET {setting} = '{v}'")
                    start = time.perf_counter()
                    got = list(c.online(query, rounds=args.rounds, seed=args.seed, progress=False))
                    runs[v].append((time.perf_counter() - start, got))
            for v in values:
                row = _row(n, runs[v], sql_s, con, query, ordered, args)
                if setting is not None:
                    row["setting"] = {setting: v}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.plot_dir:
                    _, history = min(runs[v], key=lambda r: r[0])
                    keys, names = estimate_columns(history[-1].estimates)
                    os.makedirs(args.plot_dir, exist_ok=True)
                    path = f"{args.plot_dir}/q{n:02d}-sf{args.sf:g}-w{args.workers}.png"
                    plot_history(history, keys, names, path, args.top_plot)
    report["queries"] = rows
    emit(report, args.json)
    return 0 if all(r["final_matches_duckdb"] for r in rows) else 1


def _row(n: int, runs: list, sql_s: list[float], con: Any, query: str, ordered: bool, args: Any):
    """One query's report: its fastest online run, the fastest SQL run, the final checked
    against DuckDB's."""
    streaming, history = min(runs, key=lambda r: r[0])
    final = history[-1]
    est = final.estimates
    keys, names = estimate_columns(est)
    cols = value_columns(est.columns)
    problem = tpch.compare(con.sql(query).to_arrow_table(), est.select(cols).to_arrow(), ordered)
    close = top_within(history, final, keys, names, args.top, args.within)
    close_1 = top_within(history, final, keys, names, args.top, 0.01)
    best_sql = min(sql_s)
    return {
        "query": f"q{n:02d}",
        "splits": final.maps_total,
        "rounds": len(history),
        "first_estimate_s": history[0].elapsed,
        "first_estimate_progress": history[0].progress,
        "within_s": close.elapsed,
        "within_progress": close.progress,
        "streaming_s": streaming,
        "streaming_runs_s": sorted(r[0] for r in runs),
        "distributed_sql_runs_s": sorted(sql_s),
        "distributed_sql_s": best_sql,
        "within_over_sql": close.elapsed / best_sql,
        "within_1pct_s": close_1.elapsed,
        "within_1pct_progress": close_1.progress,
        "within_1pct_over_sql": close_1.elapsed / best_sql,
        "first_estimate_over_sql": history[0].elapsed / best_sql,
        "streaming_over_sql": streaming / best_sql,
        "final_matches_duckdb": problem is None,
    }


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "online-bench",
        help="online aggregation of TPC-H queries vs the same queries as distributed SQL",
    )
    b.add_argument("--sf", type=tpch.scale_factor, default=1.0)
    b.add_argument("--data", help="TPC-H data directory (default data/tpch-sf<SF>)")
    b.add_argument("--queries", type=tpch.query_numbers, default=[1, 3, 5, 10])
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--memory-budget", default="4GiB")
    b.add_argument("--rounds", type=int, default=10)
    b.add_argument("--seed", type=int, default=1)
    b.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each side, alternating (the fastest of each is kept)",
    )
    b.add_argument("--within", type=float, default=0.05)
    b.add_argument("--top", type=int, default=10, help="top groups whose estimates must be close")
    b.add_argument("--top-plot", type=int, default=4, help="groups to plot")
    b.add_argument("--plot-dir", help="write q<N>-sf<SF>-w<W>.png here")
    b.add_argument("--json", help="also write the report here")
    b.add_argument(
        "--ab",
        metavar="NAME=V1,V2",
        help="run each query online once per value of this setting (SET NAME = V), "
        "alternating; one report row per value",
    )
    b.set_defaults(run=run)
