"""Event logs (``Cluster(event_log=DIR)``) of real queries on real workers, and their report:
every map attempt of a query is in its log with its worker and figures, a worker killed
during a query shows on the timeline with its recovery, the page has no script."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading

import flightshuffle as fs
import pytest
from conftest import TPCH_SF
from flightshuffle.report import read_events, render, report, tasks_of
from flightshuffle_bench import tpch


@pytest.fixture(scope="module")
def logged(tpch_data, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs") / "events"
    with fs.Cluster(workers=3, memory_budget="256MiB", timeout=60, event_log=logs) as c:
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        yield c, logs


def test_a_query_logs_every_map_attempt_and_its_stages(logged, tpch_data):
    c, logs = logged
    sql, ordered = tpch.query(18, TPCH_SF)
    got = c.sql(sql)
    want = tpch.duckdb_connect(tpch_data).sql(sql).to_arrow_table()
    assert tpch.compare(want, got, ordered) is None
    path = c.last_event_log
    assert path and os.path.dirname(path) == str(logs)
    assert os.stat(path).st_mode & 0o077 == 0, "the log is private"
    assert os.stat(logs).st_mode & 0o077 == 0, "so is its directory"
    events = read_events(path)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "query_start" and kinds[-1] == "query_end", kinds
    assert events[-1]["ok"] and events[-1]["rows"] == got.num_rows
    assert [e["t"] for e in events] == sorted(e["t"] for e in events), "the driver's clock"
    stages = [e for e in events if e["event"] == "stage"]
    assert stages == [
        {**s, "t": e["t"], "event": "stage"}
        for s, e in zip(c.last_metrics["stages"], stages, strict=True)
    ]
    # Every committed map of every stage is a task that ended well, on a worker of the cluster.
    tasks = tasks_of(events)
    ok = [t for t in tasks if t["ok"]]
    assert len(ok) == sum(s["tasks"] for s in stages), (len(ok), stages)
    assert {t["worker"] for t in ok} <= {0, 1, 2}
    for s in stages:
        mine = [t for t in ok if t["shuffle"] == s["shuffle"]]
        assert sum(t["rows"] for t in mine) == s["rows"], s
        assert sum(t["bytes"] for t in mine) == s["bytes"], s
    assert any(e["event"] == "shuffle_sealed" for e in events)
    page = c.last_report()
    assert page.count('<rect class="task"') == len(tasks)
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )


def test_a_worker_killed_during_a_query_shows_on_the_timeline(logged, tpch_data, tmp_path):
    """The kill must land during the query: the log of a query records only what happened
    while it ran, so a `worker_lost` event in it proves the kill landed in time."""
    c, _ = logged
    sql, ordered = tpch.query(9, TPCH_SF)
    want = tpch.duckdb_connect(tpch_data).sql(sql).to_arrow_table()
    rng = random.Random(5)
    c.sql(sql)
    took = c.last_metrics["seconds"]
    for attempt in range(5):
        victim = c.worker_pids[rng.randrange(3)]
        kill = threading.Timer(took * rng.uniform(0.2, 0.6), os.kill, (victim, signal.SIGKILL))
        kill.start()
        got = c.sql(sql)
        kill.join()
        assert tpch.compare(want, got, ordered) is None, "exact after the kill"
        events = read_events(c.last_event_log)
        if any(e["event"] == "worker_lost" for e in events):
            break
    else:
        pytest.fail("no kill landed during a query in 5 tries")
    kinds = {e["event"] for e in events}
    assert kinds & {"maps_recomputed", "query_rerun", "worker_replaced"}, kinds
    assert events[-1]["event"] == "query_end" and events[-1]["ok"]
    # The report from the shell: the recovery is on the timeline.
    out = tmp_path / "q9.html"
    done = subprocess.run(
        [sys.executable, "-m", "flightshuffle.cli", "report", c.last_event_log, "-o", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == str(out)
    page = out.read_text()
    assert page == report(c.last_event_log)
    assert '<line class="recovery"' in page and "lost" in page


def test_a_bad_log_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"t": 0, "event": "query_start"}) + "\nnot json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        report(bad)
    with fs.Cluster(workers=1) as c, pytest.raises(ValueError, match="event_log="):
        c.last_report()


def test_a_shuffle_job_logs_its_tasks_and_a_worker_killed_mid_way(tmp_path):
    """A shuffle from Python writes its own log: its map attempts, its stage, and a worker
    killed after the first partition was read (its blocks lost: maps run again), with the
    answer exact."""
    import polars as pl
    from conftest import assert_same_multiset

    n = 200_000
    df = pl.DataFrame({"k": [i % 1009 for i in range(n)], "v": list(range(n))})
    with fs.Cluster(workers=3, timeout=60, event_log=tmp_path / "events") as c:
        result = c.shuffle(df, by="k", partitions=6, map_bytes="128KiB", strategy="pull")
        assert result.wait_mapped()["maps"] >= 6
        parts = [pl.from_arrow(next(result))]
        os.kill(c.worker_pids[1], signal.SIGKILL)
        parts += [pl.from_arrow(p) for p in result]
        assert_same_multiset(df, parts)
        path = c.last_event_log
        assert path and os.path.basename(path) == f"shuffle-{result.shuffle_id}.jsonl"
        events = read_events(path)
        kinds = [e["event"] for e in events]
        assert kinds[0] == "query_start" and kinds[-1] == "query_end", kinds
        assert events[-1]["ok"] and events[-1]["rows"] == n
        assert {"worker_lost", "maps_recomputed"} <= set(kinds), kinds
        [stage] = [e for e in events if e["event"] == "stage"]
        assert stage["shuffle"] == result.shuffle_id and stage["rows"] == n
        tasks = tasks_of(events)
        assert sum(1 for t in tasks if t["ok"]) >= stage["tasks"]
        page = c.last_report()
        assert '<line class="recovery"' in page and page.count('<rect class="task"') == len(tasks)


def test_tasks_that_wait_for_memory_log_the_wait(tmp_path):
    """A worker whose budget admits a few map tasks at once makes the rest wait for a share:
    each task_end carries the seconds its task waited on its worker (and the report shows
    them), so a stage slowed by memory is told from one slowed by work."""
    import polars as pl

    n = 400_000
    df = pl.DataFrame({"k": [i % 1009 for i in range(n)], "v": list(range(n))})
    with fs.Cluster(
        workers=2, memory_budget="16MiB", timeout=60, event_log=tmp_path / "events"
    ) as c:
        result = c.shuffle(df, by="k", partitions=4, map_bytes="64KiB", strategy="pull")
        assert sum(p.num_rows for p in result) == n
        events = read_events(c.last_event_log)
    ends = [e for e in events if e["event"] == "task_end" and e["ok"]]
    assert ends and all(e["admission_wait_s"] >= 0 for e in ends)
    assert max(e["admission_wait_s"] for e in ends) > 0, "no task waited for memory"
    assert "wait for memory" in render(events, title="t")


def test_an_online_job_logs_its_rounds_beside_its_tasks(tmp_path, tpch_data):
    """Online aggregation writes its own log: its start, the driver's task events, one
    online_round per round (fraction read rising to 1, the widest interval shrinking to 0 at
    the exact last round) and its end; the report lists the rounds."""
    sql = "SELECT l_returnflag, SUM(l_quantity) AS q FROM lineitem GROUP BY l_returnflag"
    with fs.Cluster(workers=2, timeout=60, event_log=tmp_path / "events") as c:
        c.register_parquet("lineitem", tpch.table_paths(tpch_data)["lineitem"])
        got = list(c.online(sql, rounds=4, progress=False))
        path = c.last_event_log
        assert path and os.path.basename(path).startswith("online-"), path
        events = read_events(path)
        page = c.last_report()
    kinds = [e["event"] for e in events]
    assert kinds[0] == "query_start" and kinds[-1] == "query_end", kinds
    assert events[0]["sql"] == sql and events[-1]["ok"]
    rounds = [e for e in events if e["event"] == "online_round"]
    assert len(rounds) == len(got) >= 2
    assert [r["fraction"] for r in rounds] == sorted(r["fraction"] for r in rounds)
    assert rounds[-1]["final"] and rounds[-1]["fraction"] == 1.0
    assert rounds[-1]["widest_interval"] == 0 and rounds[0]["widest_interval"] > 0
    assert "task_end" in kinds, "the driver's task events are in the same log"
    assert "Online rounds" in page and "(exact)" in page
