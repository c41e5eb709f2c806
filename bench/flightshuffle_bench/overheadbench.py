"""``flightshuffle-bench sql-overhead``: what the Flight SQL endpoint and the event log cost a
query. The 22 TPC-H queries run four ways in the same run, interleaved query by query:
``Cluster.sql`` on a cluster, the same through the cluster's Flight SQL endpoint (the ADBC
driver, over TLS) with results read from the workers (the default), through the endpoint of a
second cluster that serves results from the driver, and ``Cluster.sql`` on a third cluster
that writes an event log. Every answer is checked against DuckDB's. Prints JSON: per query the best of
``--repeat`` of each way, the totals, and each way's total over plain ``Cluster.sql``'s."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from flightshuffle import Cluster

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit


def run(args: argparse.Namespace) -> int:
    import adbc_driver_flightsql.dbapi as flight_sql
    from adbc_driver_flightsql import DatabaseOptions

    root = args.data or os.path.join("data", f"tpch-sf{args.sf:g}")
    data = tpch.ensure_data(args.sf, root, progress=False)
    con = tpch.duckdb_connect(data)
    ways = ("sql", "flight_sql", "flight_sql_driver", "sql_event_log")
    report: dict[str, Any] = {"sf": args.sf, "workers": args.workers, "queries": {}}
    budget = args.memory_budget
    with (
        tempfile.TemporaryDirectory(prefix="fs-events-") as logs,
        Cluster(workers=args.workers, memory_budget=budget) as plain,
        Cluster(workers=args.workers, memory_budget=budget) as served,
        Cluster(workers=args.workers, memory_budget=budget, event_log=logs) as logged,
    ):
        for c in (plain, served, logged):
            for name, path in tpch.table_paths(data).items():
                c.register_parquet(name, path)

        def connect(info: dict[str, Any]) -> Any:
            db_kwargs = {DatabaseOptions.AUTHORIZATION_HEADER.value: "Bearer " + info["token"]}
            if info["ca"] is not None:
                db_kwargs[DatabaseOptions.TLS_ROOT_CERTS.value] = info["ca"]
            return flight_sql.connect(info["uri"], db_kwargs=db_kwargs, autocommit=True)

        def through(conn: Any) -> Any:
            def read(sql: str) -> Any:
                with conn.cursor() as cur:
                    cur.execute(sql)
                    return cur.fetch_arrow_table()

            return read

        with (
            connect(plain.serve_flight_sql()) as on_workers,
            connect(served.serve_flight_sql(results="driver")) as on_driver,
        ):
            run_way = {
                "sql": plain.sql,
                "flight_sql": through(on_workers),
                "flight_sql_driver": through(on_driver),
                "sql_event_log": logged.sql,
            }
            for q in range(1, 23):
                sql, ordered = tpch.query(q, args.sf)
                want = con.sql(sql).to_arrow_table()
                best = dict.fromkeys(ways, float("inf"))
                for _ in range(args.repeat):
                    for way in ways:
                        t = time.monotonic()
                        got = run_way[way](sql)
                        best[way] = min(best[way], time.monotonic() - t)
                        assert tpch.compare(want, got, ordered) is None, f"q{q} ({way})"
                report["queries"][str(q)] = best
        report["event_log_bytes"] = sum(
            os.path.getsize(os.path.join(logs, f)) for f in os.listdir(logs)
        )
    total = {w: sum(v[w] for v in report["queries"].values()) for w in ways}
    report["total_seconds"] = total
    report["over_sql"] = {w: total[w] / total["sql"] for w in ways if w != "sql"}
    emit(report, args.json)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "sql-overhead",
        help="TPC-H through Cluster.sql, the Flight SQL endpoint and with an event log (JSON)",
    )
    s.add_argument("--sf", type=float, default=1.0)
    s.add_argument("--data", help="data directory (default data/tpch-sf<SF>)")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--memory-budget", default="2GiB")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--json", help="also write the JSON to this file")
    s.set_defaults(run=run)
