"""Kill trials: SIGKILL one worker at a seeded random moment of a job and check the answer.

Each trial starts a fresh 3-worker cluster with the trial's strategy and parity (``all``
cycles through pull, merged, push, two-level, auto and parity 0 and 1), runs the job twice
without a fault (the second, warm run is the reference time), then runs it again with a
timer that kills a random worker after a random delay within that time. The kill *landed*
when the job noticed it (a replacement was started while it ran); a kill that came after the
job is retried earlier, up to three times, so the table counts kills during jobs. Each trial
ends in one of: ``exact`` (the answer equals the reference), ``error`` (a clear exception,
no answer) or ``wrong`` (an answer that differs: the one outcome that must never happen). A
trial also reports the time with the kill, the extra time over the fault-free run (recovery
time), the workers replaced, the map outputs recomputed and the blocks rebuilt from parity.
Shuffle trials use one map task in every other trial (fewer maps than workers), so the
victim is often a worker that ran no map but holds pushed blocks. ``flightshuffle
kill-trials`` prints one JSON object per kind with the trials and a summary.

Kinds: ``sql`` (TPC-H queries at SF 0.1, compared with DuckDB), ``shuffle`` (a
``Cluster.shuffle`` of a streamed input, compared by multiset), ``dataset`` (a Parquet map
stage and a grouped aggregate, compared with Polars on one process) and ``online`` (an
online aggregation of a Q1-like query in 6 rounds, plus an early first one: every round
once, the final exact).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from flightshuffle import Cluster

from flightshuffle_bench import tpch

KINDS = ("sql", "shuffle", "dataset", "online")
STRATEGIES = ("pull", "merged", "push", "two-level", "auto")


def _root(sf: float) -> str:
    root = os.environ.get(
        "FLIGHTSHUFFLE_TPCH_DATA",
        os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", f"tpch-sf{sf}"),
    )
    return tpch.ensure_data(sf, root, progress=False)


def _data(sf: float) -> dict[str, str]:
    return tpch.table_paths(_root(sf))


def _streamed(batches: int, rows: int) -> pa.RecordBatchReader:
    schema = pa.schema([("id", pa.int64()), ("key", pa.int64())])

    def gen():
        for b in range(batches):
            ids = pa.array(range(b * rows, (b + 1) * rows), pa.int64())
            yield pa.record_batch([ids, pc.bit_wise_and(ids, 1023)], schema=schema)

    return pa.RecordBatchReader.from_batches(schema, gen())


def _job(kind: str, trial: int) -> tuple[Callable[[Cluster], Any], Callable[[Any], bool]]:
    """The job of one trial and the check of its answer."""
    if kind == "sql":
        paths = _data(0.1)
        q = (3, 9, 18, 21)[trial % 4]
        sql, ordered = tpch.query(q, 0.1)
        con = tpch.duckdb_connect(_root(0.1))
        want = con.sql(sql).to_arrow_table()

        def run(c: Cluster) -> Any:
            for name, path in paths.items():
                c.register_parquet(name, path)
            return c.sql(sql)

        return run, lambda got: tpch.compare(want, got, ordered) is None
    if kind == "shuffle":
        batches, rows = 400, 20_000
        # Every other trial one map task: the other workers ran none, and under push and
        # two-level they hold its blocks.
        map_bytes = "1GiB" if trial % 2 else "1MiB"

        def run(c: Cluster) -> Any:
            import numpy as np

            parts = c.shuffle(
                _streamed(batches, rows),
                by="key",
                partitions=8,
                map_bytes=map_bytes,
            )
            ids = [a.to_numpy() for p in parts for a in p["id"].chunks]
            return np.sort(np.concatenate(ids))

        def check(got: Any) -> bool:
            import numpy as np

            return bool(np.array_equal(got, np.arange(batches * rows)))

        return run, check
    if kind == "dataset":
        import polars as pl

        path = _data(0.1)["lineitem"]
        keys = ["l_returnflag", "l_linestatus"]
        aggs = [pl.col("l_quantity").sum().alias("qty"), pl.len().alias("n")]

        def prep(df: pl.DataFrame) -> pl.DataFrame:
            return df.filter(pl.col("l_quantity") > 5)

        want = prep(pl.read_parquet(path)).group_by(keys).agg(aggs).sort(keys)

        def run(c: Cluster) -> Any:
            return c.read_parquet(path).map_partitions(prep).group_by(keys).agg(aggs).to_polars()

        return run, lambda got: got.sort(keys).equals(want.cast(got.schema))
    if kind == "online":
        import duckdb
        import polars as pl

        from flightshuffle_bench.tpch import Q1_LIKE

        path = _data(0.1)["lineitem"]
        exact_sql = Q1_LIKE.replace("FROM lineitem", f"FROM read_parquet('{path}/*.parquet')")
        want = pl.from_arrow(duckdb.sql(exact_sql).to_arrow_table())
        keys = ["l_returnflag", "l_linestatus"]

        def run(c: Cluster) -> Any:
            c.register_parquet("lineitem", path)
            results = list(c.online(Q1_LIKE, rounds=6, seed=trial, progress=False))
            return [r.round for r in results], results[-1].rounds, results[-1].estimates

        def check(got: Any) -> bool:
            rounds, total, est = got
            # Every round once (the native map side adds an early first round: 7 in all).
            if rounds != list(range(total)) or total not in (6, 7):
                return False
            j = est.join(want, on=keys, how="full", suffix="_x", coalesce=True)
            cols = [c for c in want.columns if c not in keys]
            return j.height == want.height and all(
                (
                    (j[c].cast(pl.Float64) - j[f"{c}_x"].cast(pl.Float64)).abs()
                    <= 1e-9 * j[f"{c}_x"].cast(pl.Float64).abs().clip(1.0)
                ).all()
                for c in cols
            )

        return run, check
    raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")


def trial(
    kind: str,
    n: int,
    seed: int,
    memory_budget: str | None = None,
    parity: int = 0,
    strategy: str = "pull",
) -> dict[str, Any]:
    rng = random.Random(seed * 1000 + n)
    run, check = _job(kind, n)
    if strategy == "all":
        strategy = STRATEGIES[n % len(STRATEGIES)]
    if parity < 0:  # all: 0 and 1 in turn, changing every len(STRATEGIES) trials
        parity = (n // len(STRATEGIES)) % 2
    budget = {"memory_budget": memory_budget} if memory_budget else {}
    with Cluster(workers=3, timeout=120, parity=parity, strategy=strategy, **budget) as c:
        ok_clean = check(run(c))  # the first run warms up (files, caches, calibration)
        start = time.monotonic()
        ok_clean = check(run(c)) and ok_clean
        clean = time.monotonic() - start
        landed, late_ok = False, True
        error, ok, seconds, delay, victim = None, False, 0.0, 0.0, 0
        for tries in range(4):
            victim = rng.randrange(3)
            # Within the job (a warm run again), at a random moment of it; earlier on a retry.
            delay = rng.uniform(0.02, 0.9 * clean) / (tries + 1)
            pid = c.worker_pids[victim]
            before = c.recovery()["replacements"]
            killer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
            start = time.monotonic()
            killer.start()
            try:
                ok = check(run(c))
            except Exception as e:  # noqa: BLE001 (a trial records any failure; it goes on)
                ok, error = False, f"{type(e).__name__}: {e}"
            seconds = time.monotonic() - start
            killer.join()
            landed = c.recovery()["replacements"] > before
            if landed or error is not None:
                break
            # Killed after the job: the next job notices it and must be exact too.
            try:
                late_ok = check(run(c)) and late_ok
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
                break
        rec = c.recovery()
        spilled = sum(s["spilled_bytes"] for s in c.stats())
    outcome = (
        "error" if error is not None else ("exact" if ok and ok_clean and late_ok else "wrong")
    )
    return {
        "trial": n,
        "strategy": strategy,
        "parity": parity,
        "victim": victim,
        "kill_after_s": round(delay, 3),
        "clean_s": round(clean, 3),
        "seconds": round(seconds, 3),
        "recovery_s": round(max(0.0, seconds - clean), 3),
        "kill_landed": landed,
        "outcome": outcome,
        "replacements": rec["replacements"],
        "recomputed_maps": rec["recomputed_maps"],
        "rebuilt_blocks": rec["rebuilt_blocks"],
        "rerun_jobs": rec["rerun_jobs"],
        "spilled_bytes": spilled,
        "error": error,
    }


def run_trials(
    kinds: list[str],
    trials: int,
    seed: int,
    log: Callable[[str], None],
    memory_budget: str | None = None,
    parity: int = 0,
    strategy: str = "pull",
) -> dict:
    out: dict[str, Any] = {}
    for kind in kinds:
        rows = []
        for n in range(trials):
            r = trial(kind, n, seed, memory_budget, parity, strategy)
            log(f"{kind} trial {n}: {r}")
            rows.append(r)
        landed = [r for r in rows if r["kill_landed"]]
        out[kind] = {
            "trials": len(rows),
            "kill_landed": len(landed),
            "exact": sum(r["outcome"] == "exact" for r in rows),
            "error": sum(r["outcome"] == "error" for r in rows),
            "wrong": sum(r["outcome"] == "wrong" for r in rows),
            "mean_recovery_s": round(
                statistics.mean(r["recovery_s"] for r in landed) if landed else 0.0, 3
            ),
            "mean_clean_s": round(statistics.mean(r["clean_s"] for r in rows), 3),
            "recomputed_maps": sum(r["recomputed_maps"] for r in rows),
            "rebuilt_blocks": sum(r["rebuilt_blocks"] for r in rows),
            "rerun_jobs": sum(r["rerun_jobs"] for r in rows),
            "runs": rows,
        }
    return out
