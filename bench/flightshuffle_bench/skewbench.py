"""``flightshuffle-bench skew-bench``: a join whose probe side has one key on a large share of its rows,
run distributed with skew splits on and off, next to single-process DataFusion on the same files
(same run, same answers checked); prints JSON.

Broadcast joins are turned off for the run (``hash_join_single_partition_threshold = 0``): a
broadcast build side leaves the probe side where it is, and skew in a hash exchange is what
this measures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from flightshuffle_bench.emit import emit

QUERY = (
    "SELECT f.v % 10 AS g, count(*) AS n, sum(f.v + d.w) AS t, max(f.s) AS ms "
    "FROM fact f JOIN dim d ON f.k = d.k GROUP BY f.v % 10 ORDER BY g"
)


def generate(root: str, rows: int, files: int, hot: float, keys: int) -> None:
    """Fact files where key 7 holds ``hot`` of the rows, the rest spread over ``keys`` keys."""
    import duckdb

    os.makedirs(os.path.join(root, "fact"), exist_ok=True)
    con = duckdb.connect()
    per = rows // files
    every = max(2, round(1 / max(1e-9, 1 - hot)))
    for f in range(files):
        path = os.path.join(root, "fact", f"{f}.parquet")
        con.sql(
            f"COPY (SELECT CASE WHEN i % {every} = 0 THEN i % {keys} ELSE 7 END AS k, "
            f"i AS v, 'row ' || i::VARCHAR AS s FROM range({f * per}, {(f + 1) * per}) t(i)) "
            f"TO '{path}' (FORMAT parquet)"
        )
    path = os.path.join(root, "dim.parquet")
    con.sql(
        f"COPY (SELECT i AS k, i * 3 AS w, 'dim ' || i::VARCHAR AS name FROM range({keys}) t(i)) "
        f"TO '{path}' (FORMAT parquet)"
    )


def run(args: argparse.Namespace) -> int:
    from flightshuffle import Cluster

    root = args.data or os.path.join("data", f"skew-{args.rows}-{args.hot:g}")
    if not os.path.exists(os.path.join(root, "dim.parquet")):
        print(f"generating {args.rows} rows in {root}", file=sys.stderr)
        generate(root, args.rows, args.files, args.hot, args.keys)
    runs = {}
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:
        c.register_parquet("fact", os.path.join(root, "fact"))
        c.register_parquet("dim", os.path.join(root, "dim.parquet"))
        for s in (
            "hash_join_single_partition_threshold",
            "hash_join_single_partition_threshold_rows",
        ):
            c.sql(f"SET datafusion.optimizer.{s} = 0")
        expected, single_s = None, float("inf")
        for _ in range(args.repeat):
            table, secs = c.sql_single_process(QUERY)
            single_s = min(single_s, secs)
            expected = table
        for name, factor in (("split", args.factor), ("no split", 0)):
            c.sql(f"SET flightshuffle.skew_factor = {factor}")
            best = float("inf")
            for _ in range(args.repeat):
                t = time.monotonic()
                got = c.sql(QUERY)
                best = min(best, time.monotonic() - t)
            notes = [s["strategy"] for s in c.last_metrics["stages"] if "skew" in s["strategy"]]
            runs[name] = {
                "seconds": best,
                "stages": [
                    {k: s[k] for k in ("stage", "exchange", "tasks", "start_s", "end_s")}
                    for s in c.last_metrics["stages"]
                ],
                "same_answer_as_single_process": got.equals(expected),
                "split": notes,
                "largest_partition_bytes": max(
                    s["max_partition_bytes"] for s in c.last_metrics["stages"]
                ),
                "median_partition_bytes": [
                    s["median_partition_bytes"] for s in c.last_metrics["stages"]
                ],
            }
    report = {
        "query": QUERY,
        "rows": args.rows,
        "hot_share": args.hot,
        "workers": args.workers,
        "repeat": args.repeat,
        "single_process_datafusion_s": single_s,
        "runs": runs,
        "speedup_of_split": runs["no split"]["seconds"] / runs["split"]["seconds"],
    }
    emit(report, args.json)
    return 0 if all(r["same_answer_as_single_process"] for r in runs.values()) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("skew-bench", help="a skewed join with skew splits on and off (JSON)")
    s.add_argument("--rows", type=int, default=20_000_000)
    s.add_argument("--files", type=int, default=8)
    s.add_argument("--hot", type=float, default=0.5, help="share of rows on the hot key")
    s.add_argument("--keys", type=int, default=1_000_000, help="keys of the dimension table")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--memory-budget", default="4GiB")
    s.add_argument("--factor", type=float, default=3.0, help="skew_factor of the split run")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--data", help="data directory (default data/skew-<rows>-<hot>)")
    s.add_argument("--json", help="also write the JSON to this file")
    s.set_defaults(run=run)
