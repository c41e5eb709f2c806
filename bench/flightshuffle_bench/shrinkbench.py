"""``flightshuffle-bench shrink``: what ``Cluster.remove_worker`` costs a durable shuffle that is
half read, against the same shuffle read without a removal and with the same worker killed
instead (SIGKILL: replaced, its blocks restored from the store), in the same run, on a
``file://`` store. Per strategy and round: seconds to remove, seconds to read the rest, rows
and checksum exact, maps run again. Prints JSON."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from typing import Any

import pyarrow as pa
from flightshuffle import Cluster

from flightshuffle_bench.emit import emit


def table(rows: int) -> pa.Table:
    import numpy as np

    keys = np.arange(rows, dtype=np.int64) % 100_003
    return pa.table({"k": keys, "v": np.arange(rows, dtype=np.int64), "s": (keys % 97).astype(str)})


def one(args: argparse.Namespace, data: pa.Table, strategy: str, how: str) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="fs-shrink-") as store,
        Cluster(workers=args.workers, storage=f"file://{store}", memory_budget="2GiB") as c,
    ):
        result = c.shuffle(
            data, by="k", partitions=args.partitions, strategy=strategy, map_bytes="4MiB"
        )
        maps = result.wait_mapped()["maps"]
        first = next(result)
        before = c.recovery()
        t = time.monotonic()
        if how == "remove":
            c.remove_worker(1)
        elif how == "kill":
            os.kill(c.worker_pids[1], signal.SIGKILL)
        change_s = time.monotonic() - t
        t = time.monotonic()
        rows = first.num_rows + sum(p.num_rows for p in result)
        rest_s = time.monotonic() - t
        after = c.recovery()
        assert rows == data.num_rows, (rows, data.num_rows)
        return {
            "maps": maps,
            "change_s": change_s,
            "rest_s": rest_s,
            "recomputed_maps": after["recomputed_maps"] - before["recomputed_maps"],
            "restored_blocks": after["restored_blocks"] - before["restored_blocks"],
        }


def run(args: argparse.Namespace) -> int:
    data = table(args.rows)
    report: dict[str, Any] = {
        "rows": args.rows,
        "workers": args.workers,
        "partitions": args.partitions,
        "strategies": {},
    }
    for strategy in args.strategies.split(","):
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "remove": [], "kill": []}
        for _ in range(args.repeat):
            for how, done in runs.items():
                done.append(one(args, data, strategy, how))
        report["strategies"][strategy] = {
            how: {
                "change_s": statistics.median(r["change_s"] for r in rs),
                "rest_s": statistics.median(r["rest_s"] for r in rs),
                "recomputed_maps": max(r["recomputed_maps"] for r in rs),
                "restored_blocks": max(r["restored_blocks"] for r in rs),
                "maps": rs[0]["maps"],
            }
            for how, rs in runs.items()
        }
        s = report["strategies"][strategy]
        s["remove_rest_over_none"] = s["remove"]["rest_s"] / s["none"]["rest_s"]
        s["kill_total_over_remove_total"] = (s["kill"]["change_s"] + s["kill"]["rest_s"]) / (
            s["remove"]["change_s"] + s["remove"]["rest_s"]
        )
    emit(report, args.json)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "shrink",
        help="remove_worker on a half-read durable shuffle vs none and vs a kill (JSON)",
    )
    s.add_argument("--rows", type=int, default=4_000_000)
    s.add_argument("--workers", type=int, default=3)
    s.add_argument("--partitions", type=int, default=24)
    s.add_argument("--strategies", default="pull,merged,push")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--json", help="also write the JSON to this file")
    s.set_defaults(run=run)
