"""Concurrency soak: many threads run SQL queries, shuffles, dataset pipelines and online
aggregations at once on one small cluster with a small memory budget, and every answer is
checked.

``flightshuffle-bench soak`` prints one JSON object: the jobs by kind (run, exact, failed, mean
seconds), the wall time, the workers replaced (a lost worker is a failure of the soak), and
per worker its idle RSS after start, its peak RSS (the kernel's high-water mark) and the
budget. Kinds: ``sql`` (TPC-H query n at SF 0.1 against DuckDB, n cycling 1..22),
``shuffle`` (a streamed input of ``shuffle_rows`` rows, strategy cycling, compared by sorted
ids), ``dataset`` and ``online`` (as in :mod:`flightshuffle_bench.killtrials`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from flightshuffle import Cluster

from flightshuffle_bench import tpch
from flightshuffle_bench.killtrials import _data, _job, _root, _streamed

KINDS = ("sql", "shuffle", "dataset", "online")


def _rss(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of a process, in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


ADMISSION_FIELDS = ("admitted_tasks", "waited_tasks", "overdraft_tasks", "peak_running_tasks")


def _settled_rss(pids: list[int], wait_s: float = 5.0) -> list[int]:
    """Each worker's RSS once it stops growing (a Python-hosted worker imports Polars and
    pyarrow in the background as it starts): the idle figure the peak is compared with."""
    last = [_rss(p, "VmRSS") for p in pids]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = [_rss(p, "VmRSS") for p in pids]
        if all(abs(a - b) < (1 << 20) for a, b in zip(now, last, strict=True)):
            return now
        last = now
    return last


def _sql_job(n: int) -> tuple[Callable[[Cluster], Any], Callable[[Any], bool]]:
    q = n % 22 + 1
    sql, ordered = tpch.query(q, 0.1)
    want = tpch.duckdb_connect(_root(0.1)).sql(sql).to_arrow_table()
    return (lambda c: c.sql(sql)), (lambda got: tpch.compare(want, got, ordered) is None)


def _shuffle_job(n: int, rows: int) -> tuple[Callable[[Cluster], Any], Callable[[Any], bool]]:
    import numpy as np

    batches = max(1, rows // 20_000)
    strategy = ("pull", "merged", "push", "two-level", "auto")[n % 5]

    def run(c: Cluster) -> Any:
        parts = c.shuffle(
            _streamed(batches, 20_000), by="key", partitions=8, map_bytes="1MiB", strategy=strategy
        )
        return np.sort(np.concatenate([a.to_numpy() for p in parts for a in p["id"].chunks]))

    return run, lambda got: bool(np.array_equal(got, np.arange(batches * 20_000)))


def run_soak(
    threads: int = 8,
    jobs_per_thread: int = 4,
    workers: int = 2,
    memory_budget: str = "64MiB",
    shuffle_rows: int = 2_000_000,
    log: Callable[[str], None] = lambda _: None,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, Any]:
    """Run ``threads`` × ``jobs_per_thread`` jobs at once (see the module doc), of ``kinds``
    in turn."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown soak kinds {unknown} (known: {', '.join(KINDS)})")
    # Every job and its reference answer, made before the clock starts (DuckDB, Polars).
    plan: list[list[tuple[str, Callable, Callable]]] = []
    for t in range(threads):
        jobs = []
        for j in range(jobs_per_thread):
            n = t * jobs_per_thread + j
            kind = kinds[(t + j) % len(kinds)]
            if kind == "sql":
                run, check = _sql_job(n)
            elif kind == "shuffle":
                run, check = _shuffle_job(n, shuffle_rows)
            else:
                run, check = _job(kind, n)
            jobs.append((kind, run, check))
        plan.append(jobs)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    with Cluster(workers=workers, memory_budget=memory_budget, timeout=600) as c:
        for name, path in _data(0.1).items():
            c.register_parquet(name, path)
        pids = c.worker_pids
        idle = _settled_rss(pids)

        def worker(jobs: list[tuple[str, Callable, Callable]]) -> None:
            for kind, run, check in jobs:
                start = time.monotonic()
                try:
                    ok, error = bool(check(run(c))), None
                except Exception as e:  # noqa: BLE001 (the soak records every failure)
                    ok, error = False, f"{type(e).__name__}: {e}"
                r = {"kind": kind, "exact": ok, "seconds": time.monotonic() - start}
                if error:
                    r["error"] = error[:500]
                log(f"{kind}: {'exact' if ok else 'FAILED'} in {r['seconds']:.2f} s {error or ''}")
                with lock:
                    results.append(r)

        start = time.monotonic()
        running = [threading.Thread(target=worker, args=(jobs,)) for jobs in plan]
        for t in running:
            t.start()
        for t in running:
            t.join()
        wall = time.monotonic() - start
        peak = [_rss(p, "VmHWM") for p in pids]
        admission = [
            {k: w[k] for k in ADMISSION_FIELDS}
            | {"peak_granted_mib": w["peak_granted_bytes"] >> 20}
            for w in c.stats()
        ]
        replaced = c.recovery()["replacements"]
        alive_after = [p for p in c.worker_pids if p in pids]
    by_kind = {}
    for kind in KINDS:
        rows = [r for r in results if r["kind"] == kind]
        if rows:
            by_kind[kind] = {
                "jobs": len(rows),
                "exact": sum(r["exact"] for r in rows),
                "mean_s": round(statistics.mean(r["seconds"] for r in rows), 3),
                "errors": [r["error"] for r in rows if "error" in r],
            }
    mib = 1 << 20
    return {
        "threads": threads,
        "jobs": len(results),
        "exact": sum(r["exact"] for r in results),
        "wall_s": round(wall, 2),
        "workers": workers,
        "workers_replaced": replaced,
        "workers_kept": len(alive_after),
        "memory_budget": memory_budget,
        "idle_rss_mib": [round(x / mib) for x in idle],
        "peak_rss_mib": [round(x / mib) for x in peak],
        "peak_above_idle_mib": [round((p - i) / mib) for p, i in zip(peak, idle, strict=True)],
        "admission": admission,
        "by_kind": by_kind,
    }
