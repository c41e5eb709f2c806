"""``flightshuffle-bench hosts-loss``: what losing a host costs a static cluster when nothing
restarts its worker. Three simulated hosts (:mod:`.simhosts`, links capped with tc tbf) each
run one ``flightshuffle worker``; the driver connects with ``restart_wait=0``, so a lost
worker's slot goes at once to a stand-in that a surviving host starts beside its own worker,
and lineage recomputes what was lost there.

Per TPC-H query, on fresh workers each time: the query clean (after one warm-up run), then
again with host 2's worker killed (SIGKILL) at ``--kill-at`` of the clean time (with
``--trials`` above 1, the further trials kill at random points). Reported: both
times, whether the answer equals DuckDB's, and the cluster's recovery counters, which show
that the kill landed while the query ran (a kill after the end would change none). Prints
JSON."""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from flightshuffle_bench import simhosts, tpch
from flightshuffle_bench.emit import emit
from flightshuffle_bench.hostsbench import _certs


def _one_query(
    args: argparse.Namespace, root: str, q: int, duck: Any, kill_at: float
) -> dict[str, Any]:
    from flightshuffle import Cluster

    sql, ordered = tpch.query(q, args.sf)
    with (
        simhosts.SimHosts(3, rate=args.rate) as hosts,
        tempfile.TemporaryDirectory(prefix="fs-loss-") as tmp,
    ):
        files = _certs(f"{tmp}/certs", hosts)
        addresses = [hosts.start_worker(i, files, f"{tmp}/spill{i}") for i in range(hosts.n)]
        with open(files["token_file"]) as f:
            token = f.read().strip()
        with Cluster(
            addresses=addresses, token=token, tls={"ca": files["ca"]}, restart_wait=0
        ) as c:
            for name, path in tpch.table_paths(root).items():
                c.register_parquet(name, path)
            c.sql(sql)  # warm-up
            t = time.monotonic()
            c.sql(sql)
            clean = time.monotonic() - t
            before = c.recovery()
            victim = hosts.worker_pid(2)
            kill = threading.Timer(clean * kill_at, os.kill, (victim, signal.SIGKILL))
            t = time.monotonic()
            kill.start()
            try:
                got = c.sql(sql)
            finally:
                kill.cancel()
            lost = time.monotonic() - t
            after = c.recovery()
            diff = tpch.compare(duck.sql(sql).to_arrow_table(), got, ordered)
            stand_ins = len(hosts.worker_pids(0)) + len(hosts.worker_pids(1)) - 2
    counters = ("replacements", "recomputed_maps", "rerun_jobs", "rerun_stages")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in counters if k in after}
    return {
        "query": q, "kill_at": kill_at, "clean_s": clean, "with_loss_s": lost,
        "ratio": lost / clean,
        "right": diff is None, "kill_landed": delta.get("replacements", 0) > 0,
        "stand_ins": stand_ins, "recovery": delta,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    why = simhosts.unavailable()
    if why is not None:
        raise SystemExit(f"flightshuffle-bench hosts-loss: {why}")
    root = tpch.ensure_data(args.sf, args.data, progress=False)
    duck = tpch.duckdb_connect(root)
    rows = []
    rng = random.Random(args.seed)
    for trial in range(args.trials):
        for q in args.queries:
            # One trial at --kill-at; more at random points of the clean time.
            at = args.kill_at if trial == 0 else rng.uniform(0.05, 0.9)
            rows.append(_one_query(args, root, q, duck, at))
            print(rows[-1], file=sys.stderr, flush=True)
    emit(
        {
            "bench": "hosts-loss",
            "sf": args.sf,
            "rate": args.rate,
            "hosts": 3,
            "trials": args.trials,
            "queries": rows,
            "all_right": all(r["right"] for r in rows),
            "all_landed": all(r["kill_landed"] for r in rows),
        },
        args.output,
    )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("hosts-loss", help="TPC-H with a host lost and not restarted")
    p.add_argument("--sf", type=float, default=1.0)
    p.add_argument("--data", default="data/tpch-sf1", help="where the TPC-H Parquet files are")
    p.add_argument("--queries", type=int, nargs="+", default=[3, 9, 18, 21])
    p.add_argument("--rate", default="1gbit", help="each host's link (tc tbf rate)")
    p.add_argument("--kill-at", type=float, default=0.4, help="kill at this share of clean time")
    p.add_argument("--trials", type=int, default=1, help="trials per query (then random kills)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("-o", "--output", help="also write the JSON here")
    p.set_defaults(run=run)
