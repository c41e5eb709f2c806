"""``flightshuffle-bench online-coverage``: do the online intervals hold on TPC-H as tpchgen
stores it? Real online runs on a local cluster, ``--seeds`` random unit orders per query: for
each run, the first round after ``--share`` of the fact table's rows, and per (group,
aggregate) pair whether the exact answer (DuckDB's, on the same files) lies in its interval,
and whether the estimate is flagged unreliable. Queries: TPC-H Q1, Q3, Q5, Q6, Q10 as stored,
and Q1 over a copy of lineitem in a random row order. Prints the report as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

from flightshuffle.estimates import value_columns

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit


def coverage_of(est: Any, exact: Any, keys: list[str]) -> dict[str, int]:
    """Counts of (group, aggregate) pairs of one round: in all, covered, flagged, flagged
    and covered; groups of the exact answer not estimated yet."""
    import polars as pl

    names = [c for c in est.columns if f"{c}_low" in est.columns]
    names = [n for n in names if est[f"{n}_low"].null_count() < est.height or est.height == 0]
    j = (
        est.join(exact, on=keys, how="inner", suffix="_exact")
        if keys
        else est.hstack(exact.rename({c: f"{c}_exact" for c in exact.columns}))
    )
    out = {"pairs": 0, "covered": 0, "flagged": 0, "flagged_covered": 0}
    for n in names:
        truth = j[f"{n}_exact"].cast(pl.Float64)
        ok = ((j[f"{n}_low"] <= truth) & (truth <= j[f"{n}_high"])).fill_null(False)
        flag = ~j[f"{n}_reliable"].fill_null(False)
        out["pairs"] += j.height
        out["covered"] += int(ok.sum())
        out["flagged"] += int(flag.sum())
        out["flagged_covered"] += int((ok & flag).sum())
    out["missing_groups"] = exact.height - j.height if keys else 0
    return out


def run(args: argparse.Namespace) -> int:
    import polars as pl
    import pyarrow.parquet as pq
    from flightshuffle import Cluster

    root = args.data or os.path.join("data", f"tpch-sf{args.sf:g}")
    data = tpch.ensure_data(args.sf, root, progress=True)
    paths = tpch.table_paths(data)
    con = tpch.duckdb_connect(data)
    random_copy = os.path.join(data, "lineitem-random-order.parquet")
    if not os.path.exists(random_copy):
        rows = con.sql("SELECT * FROM lineitem ORDER BY hash(l_orderkey * 8 + l_linenumber)")
        pq.write_table(rows.to_arrow_table(), random_copy, row_group_size=262_144)
    queries = [int(q) for q in args.queries.split(",")]
    report: dict[str, Any] = {
        "bench": "online-coverage",
        "date": datetime.date.today().isoformat(),
        "sf": args.sf,
        "workers": args.workers,
        "seeds": args.seeds,
        "share": args.share,
        "confidence": 0.95,
        "queries": [],
    }
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:
        for name, path in paths.items():
            c.register_parquet(name, path)
        c.register_parquet("lineitem_random", random_copy)
        cases = [(f"q{q:02d}", tpch.query(q, args.sf)[0]) for q in queries]
        if 1 in queries:
            q1 = tpch.query(1, args.sf)[0]
            cases.append(("q01-random-order", q1.replace("lineitem", "lineitem_random")))
        for label, query in cases:
            exact_sql = query.replace("lineitem_random", "lineitem")
            exact = pl.from_arrow(con.sql(exact_sql).to_arrow_table())
            plan_keys = None
            totals = {"pairs": 0, "covered": 0, "flagged": 0, "flagged_covered": 0}
            totals["missing_groups"] = 0
            shares, started = [], time.perf_counter()
            for seed in range(args.seeds):
                stream = c.online(query, rounds=args.rounds, seed=seed, progress=False)
                r = None
                for r in stream:
                    if r.progress >= args.share or r.final:
                        break
                stream.close()
                assert r is not None
                est = r.estimates
                if plan_keys is None:
                    names = [x for x in est.columns if f"{x}_low" in est.columns]
                    plan_keys = [k for k in value_columns(est.columns) if k not in names]
                counts = coverage_of(est, exact, plan_keys)
                for k, v in counts.items():
                    totals[k] += v
                shares.append(r.progress)
            reliable = totals["pairs"] - totals["flagged"]
            line = {
                "query": label,
                "runs": args.seeds,
                "median_share_read": sorted(shares)[len(shares) // 2],
                "pairs": totals["pairs"],
                "covered": totals["covered"] / max(totals["pairs"], 1),
                "flagged": totals["flagged"] / max(totals["pairs"], 1),
                "covered_when_reliable": (totals["covered"] - totals["flagged_covered"])
                / max(reliable, 1),
                "missing_groups_per_run": totals["missing_groups"] / args.seeds,
                "seconds": time.perf_counter() - started,
            }
            print(line, file=sys.stderr)
            report["queries"].append(line)
    emit(report, args.json)
    return 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "online-coverage",
        help="coverage of the online intervals on TPC-H as stored, over many seeds",
    )
    b.add_argument("--sf", type=tpch.scale_factor, default=0.1)
    b.add_argument("--data", help="TPC-H data directory (default data/tpch-sf<SF>)")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--memory-budget", default="2GiB")
    b.add_argument("--queries", default="1,3,5,6,10")
    b.add_argument("--seeds", type=int, default=100)
    b.add_argument("--rounds", type=int, default=10)
    b.add_argument("--share", type=float, default=0.1, help="fraction read before judging")
    b.add_argument("--json", help="also write the report here")
    b.set_defaults(run=run)
