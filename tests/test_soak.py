"""Eight threads at once on one 2-worker cluster with a 64 MiB budget: TPC-H queries,
shuffles, dataset pipelines and online aggregations, every answer checked, no worker lost."""

from __future__ import annotations

from flightshuffle_bench import soak


def test_eight_threads_of_mixed_jobs_are_all_exact_and_lose_no_worker():
    report = soak.run_soak(threads=8, jobs_per_thread=1, shuffle_rows=400_000)
    failed = {k: v["errors"] for k, v in report["by_kind"].items() if v["errors"]}
    assert report["exact"] == report["jobs"] == 8, failed
    assert set(report["by_kind"]) == set(soak.KINDS)
    assert report["workers_replaced"] == 0 and report["workers_kept"] == 2
    assert all(p > 0 for p in report["peak_rss_mib"])
    # The jobs shared each worker's budget: tasks waited for room, and none deadlocked
    # (every answer above is exact).
    assert all(a["waited_tasks"] > 0 for a in report["admission"]), report["admission"]
