"""``flightshuffle-bench online-having``: how far ``having_certain`` can be trusted. Online
queries with a HAVING over estimates run on a local cluster over TPC-H, ``--seeds`` random
unit orders each; every round's groups are checked against the exact answer (DuckDB's, the
same query without its ORDER BY / LIMIT). Per round, counted over all runs: groups shown,
groups called certain, certain groups the exact HAVING keeps (should be all of them, up to the
intervals' 95%), groups shown that the exact HAVING drops, and groups the exact answer keeps
that the round does not show. Prints the report as JSON."""

from __future__ import annotations

import argparse
import os
from typing import Any

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit

QUERIES = {
    # TPC-H Q11 as written (its HAVING compares with a scalar subquery run first, exactly).
    "q11": None,
    # Nations whose quantity passes a bar near the middle of the nations' totals.
    "nations": (
        "SELECT n_name, sum(l_quantity) AS qty FROM lineitem, supplier, nation "
        "WHERE l_suppkey = s_suppkey AND s_nationkey = n_nationkey "
        "GROUP BY n_name HAVING sum(l_quantity) > {bar}"
    ),
}


def _query(name: str, sf: float, con: Any) -> str:
    if name == "q11":
        return tpch.query(11, sf)[0]
    totals = con.sql(
        "SELECT sum(l_quantity) AS q FROM lineitem, supplier, nation "
        "WHERE l_suppkey = s_suppkey AND s_nationkey = n_nationkey GROUP BY n_name ORDER BY q"
    ).fetchall()
    bar = float(totals[len(totals) // 2][0])
    return QUERIES[name].format(bar=bar)


def run(args: argparse.Namespace) -> int:
    import polars as pl
    from flightshuffle import Cluster
    from flightshuffle.estimates import value_columns

    root = args.data or os.path.join("data", f"tpch-sf{args.sf:g}")
    data = tpch.ensure_data(args.sf, root, progress=False)
    con = tpch.duckdb_connect(data)
    report: dict[str, Any] = {"sf": args.sf, "workers": args.workers, "seeds": args.seeds}
    with Cluster(workers=args.workers) as c:
        for name, path in tpch.table_paths(data).items():
            c.register_parquet(name, path)
        for qname in args.queries.split(","):
            sql = _query(qname, args.sf, con)
            exact = pl.from_arrow(con.sql(sql).to_arrow_table())
            rounds: list[dict[str, int]] = []
            for seed in range(args.seeds):
                results = list(c.online(sql, rounds=args.rounds, seed=seed, progress=False))
                for i, r in enumerate(results):
                    est = r.estimates
                    keys = [k for k in value_columns(est.columns) if f"{k}_low" not in est.columns]
                    kept = est.join(exact.select(keys), on=keys, how="semi")
                    certain = est.filter(pl.col("having_certain"))
                    row = {
                        "shown": est.height,
                        "certain": certain.height,
                        "certain_and_kept": certain.join(
                            exact.select(keys), on=keys, how="semi"
                        ).height,
                        "shown_not_kept": est.height - kept.height,
                        "kept_not_shown": exact.height - kept.height,
                    }
                    if len(rounds) <= i:
                        rounds.append(dict.fromkeys(row, 0))
                    for k, v in row.items():
                        rounds[i][k] += v
            report[qname] = {"query": sql, "exact_groups": exact.height, "rounds": rounds}
    emit(report, args.json)
    return 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser("online-having", help="is having_certain right, round by round (JSON)")
    b.add_argument("--sf", type=tpch.scale_factor, default=0.1)
    b.add_argument("--data", help="TPC-H data directory (default data/tpch-sf<SF>)")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--queries", default="q11,nations")
    b.add_argument("--seeds", type=int, default=20)
    b.add_argument("--rounds", type=int, default=10)
    b.add_argument("--json", help="also write the report here")
    b.set_defaults(run=run)
