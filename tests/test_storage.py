"""Durable shuffles through a real S3-compatible server (moto's, on loopback): every strategy,
datasets, SQL (TPC-H at SF 0.1, every exchange durable) and online aggregation give the exact
answers; a worker killed after its maps committed costs no map re-run; the objects are
checked as the server lists them, the requests as the cluster counts them; bad stores, wrong
credentials and a server that stops are clear errors that name the store and never show a
credential."""

from __future__ import annotations

import os
import signal
import time

import flightshuffle as fs
import polars as pl
import pytest
from conftest import (
    TPCH_SF,
    alive,
    assert_keys_not_split,
    assert_same_multiset,
    s3_bucket,
    s3_endpoint,
    s3_keys,
)
from flightshuffle.estimates import value_columns
from flightshuffle_bench import tpch


def frame(n: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "key": [i % 389 for i in range(n)],
            "name": [None if i % 17 == 0 else f"n-{i % 101}" for i in range(n)],
            "x": [i * 0.25 for i in range(n)],
        }
    )


@pytest.fixture(scope="module")
def store(s3_server):
    options = s3_bucket(s3_server, "fs-durable")
    return "s3://fs-durable/shuffles", options


@pytest.fixture(scope="module")
def durable(store):
    url, options = store
    with fs.Cluster(
        workers=3, memory_budget="256MiB", timeout=60, storage=url, storage_options=options
    ) as c:
        yield c


@pytest.mark.parametrize("strategy", ["pull", "merged", "push", "two-level", "auto"])
def test_every_strategy_is_exact_and_leaves_no_object(durable, store, strategy):
    df = frame(40_000)
    # `auto` calibrates on first use, with shuffles of its own (durable too): done first.
    list(durable.shuffle(frame(10), by="key", partitions=2, strategy=strategy))
    before = durable.storage_stats()
    parts = [
        pl.from_arrow(p)
        for p in durable.shuffle(df, by="key", partitions=5, map_bytes="128KiB", strategy=strategy)
    ]
    assert_same_multiset(df, parts)
    assert_keys_not_split(parts, ["key"])
    after = durable.storage_stats()
    # One object per map task (the writes the server took), and no LIST while reading.
    assert after["puts"] > before["puts"], after
    assert after["bytes_written"] > before["bytes_written"], after
    assert after["lists"] - before["lists"] == 1, "one LIST, when the shuffle is dropped"
    # Dropped with the shuffle, as the server sees it.
    assert s3_keys(store[1], "fs-durable") == []


@pytest.mark.parametrize("strategy", ["pull", "merged", "push", "two-level"])
def test_a_worker_killed_after_its_maps_committed_costs_no_map_rerun(durable, store, strategy):
    df = frame(120_000)
    before = durable.recovery()
    result = durable.shuffle(df, by="key", partitions=6, map_bytes="128KiB", strategy=strategy)
    mapped = result.wait_mapped()
    assert mapped["maps"] >= 6
    # The server holds one object per map, under this cluster's run.
    keys = s3_keys(store[1], "fs-durable")
    assert len(keys) == mapped["maps"], keys
    assert all(k.startswith("shuffles/run-") and k.endswith(".fsobj") for k in keys)
    parts = [pl.from_arrow(next(result))]
    victim = durable.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    parts += [pl.from_arrow(p) for p in result]
    assert_same_multiset(df, parts)
    after = durable.recovery()
    assert after["replacements"] == before["replacements"] + 1, after
    assert after["recomputed_maps"] == before["recomputed_maps"], after
    assert after["rerun_jobs"] == before["rerun_jobs"], after
    assert after["restored_blocks"] > before["restored_blocks"], after
    assert not alive(victim)
    assert s3_keys(store[1], "fs-durable") == []


def test_datasets_and_sql_are_exact_through_the_store(durable, store, tpch_data):
    paths = tpch.table_paths(tpch_data)
    keys = ["l_returnflag", "l_linestatus"]
    got = (
        durable.read_parquet(paths["lineitem"])
        .group_by(keys)
        .agg(pl.len().alias("n"), pl.col("l_quantity").sum().alias("q"))
        .to_polars()
        .sort(keys)
    )
    want = (
        pl.read_parquet(paths["lineitem"])
        .group_by(keys)
        .agg(pl.len().alias("n"), pl.col("l_quantity").sum().alias("q"))
        .sort(keys)
    )
    assert got.equals(want)
    for name, path in paths.items():
        durable.register_parquet(name, path)
    con = tpch.duckdb_connect(tpch_data)
    before = durable.storage_stats()
    for q in range(1, 23):
        sql, ordered = tpch.query(q, TPCH_SF)
        diff = tpch.compare(con.sql(sql).to_arrow_table(), durable.sql(sql), ordered)
        assert diff is None, f"q{q} through the store: {diff}"
    after = durable.storage_stats()
    assert after["puts"] > before["puts"], "the queries' exchanges wrote objects"
    # Each exchange reports what it wrote to the store, in its metrics and EXPLAIN ANALYZE.
    stages = durable.last_metrics["stages"]
    assert stages and all(
        s["stored_objects"] >= 1 and s["stored_bytes"] > s["bytes"] for s in stages if s["bytes"]
    ), stages
    analyzed = durable.explain(tpch.query(3, TPCH_SF)[0], analyze=True)
    assert "objects (" in analyzed and "bytes) to the store" in analyzed, analyzed
    # Online aggregation over the same store: the final round is the exact answer.
    sql, ordered = tpch.query(1, TPCH_SF)
    final = list(durable.online(sql, rounds=3, seed=1, progress=False))[-1]
    cols = value_columns(final.estimates.columns)
    got = final.estimates.select(cols).to_arrow()
    assert tpch.compare(con.sql(sql).to_arrow_table(), got, ordered) is None
    assert s3_keys(store[1], "fs-durable") == []


def test_a_missing_bucket_or_wrong_credentials_fail_at_start_without_the_secret(s3_server):
    options = s3_bucket(s3_server, "fs-creds")
    started = time.monotonic()
    with pytest.raises(Exception, match="no-such-bucket") as missing:
        fs.Cluster(workers=1, storage="s3://no-such-bucket/x", storage_options=options)
    wrong = {**options, "aws_secret_access_key": "a-wrong-secret-value"}
    # moto checks signatures only with auth on; a wrong endpoint port stands for a store
    # that cannot be reached.
    unreachable = {**wrong, "aws_endpoint": "http://127.0.0.1:9"}
    with pytest.raises(Exception, match="127.0.0.1:9") as refused:
        fs.Cluster(workers=1, storage="s3://fs-creds/x", storage_options=unreachable)
    assert time.monotonic() - started < 90, "errors come within the request timeouts"
    for e in (missing, refused):
        text = str(e.value)
        assert "testing-secret" not in text and "a-wrong-secret-value" not in text, text
    with pytest.raises(ValueError, match="storage_options= needs storage="):
        fs.Cluster(workers=1, storage_options=options)
    with pytest.raises(Exception, match="not an object_store S3 option"):
        fs.Cluster(workers=1, storage="s3://fs-creds/x", storage_options={"no_such": "x"})
    with pytest.raises(Exception, match="not supported"):
        fs.Cluster(workers=1, storage="ftp://host/x")


def test_a_store_that_stops_mid_shuffle_is_a_clear_error_and_the_cluster_works_after(
    s3_server,
):
    from moto.server import ThreadedMotoServer

    options = s3_bucket(s3_server, "fs-stops")
    # A second server of this process (same buckets), stopped while a shuffle writes.
    second = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    second.start()
    port = second.get_host_and_port()[1]
    options = {**options, "aws_endpoint": s3_endpoint(second)}
    df = frame(200_000)
    with fs.Cluster(workers=2, timeout=60, storage="s3://fs-stops/p", storage_options=options) as c:
        second.stop()
        with pytest.raises(Exception, match="fs-stops") as stopped:
            list(c.shuffle(df, by="key", partitions=4, map_bytes="256KiB"))
        assert "testing-secret" not in str(stopped.value)
        # Back on the same port: the cluster is usable, and exact.
        again = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        again.start()
        try:
            parts = [pl.from_arrow(p) for p in c.shuffle(df, by="key", partitions=4)]
            assert_same_multiset(df, parts)
        finally:
            again.stop()


def test_storage_sweep_deletes_only_what_crashed_runs_left(s3_server, monkeypatch, capsys):
    from conftest import s3_client
    from flightshuffle.cli import main

    options = s3_bucket(s3_server, "fs-sweep")
    client = s3_client(options)
    for key in ["p/run-0123/4/0-0.fsobj", "p/run-0123/probe", "p/tables/t.parquet", "q.fsobj"]:
        client.put_object(Bucket="fs-sweep", Key=key, Body=b"x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    base = ["storage", "sweep", "s3://fs-sweep/p", "--option", "aws_allow_http=true"]
    base += [
        "--option",
        f"aws_endpoint={options['aws_endpoint']}",
        "--option",
        "aws_region=us-east-1",
    ]
    assert main([*base, "--older-than", "1d"]) == 0
    assert "deleted 0 object(s)" in capsys.readouterr().out
    assert main([*base, "--older-than", "0", "--dry-run"]) == 0
    assert "would delete 2 object(s)" in capsys.readouterr().out
    assert len(s3_keys(options, "fs-sweep")) == 4
    assert main([*base, "--older-than", "0s"]) == 0
    assert sorted(s3_keys(options, "fs-sweep")) == ["p/tables/t.parquet", "q.fsobj"]
    assert main([*base, "--older-than", "soon"]) == 1
    assert "--older-than" in capsys.readouterr().err


def test_set_flightshuffle_storage_picks_the_store_per_query(durable, store, tpch_data, tmp_path):
    for name, path in tpch.table_paths(tpch_data).items():
        durable.register_parquet(name, path)
    con = tpch.duckdb_connect(tpch_data)
    sql, ordered = tpch.query(3, TPCH_SF)
    want = con.sql(sql).to_arrow_table()

    def run() -> tuple[int, int]:
        before = durable.storage_stats()["puts"]
        assert tpch.compare(want, durable.sql(sql), ordered) is None
        stored = sum(s["stored_objects"] for s in durable.last_metrics["stages"])
        return stored, durable.storage_stats()["puts"] - before

    try:
        durable.sql("SET flightshuffle.storage = 'off'")
        assert run() == (0, 0), "not durable: nothing written"
        durable.sql("SET flightshuffle.storage = 's3://fs-durable/elsewhere'")
        stored, puts = run()
        assert stored > 0 and puts >= stored
        # A store the driver cannot write to is refused when set, naming it; the session
        # keeps the previous store.
        with pytest.raises(Exception, match="no-such-bucket"):
            durable.sql("SET flightshuffle.storage = 's3://no-such-bucket/x'")
        assert run()[0] > 0
        durable.sql(f"SET flightshuffle.storage = 'file://{tmp_path}'")
        assert run()[0] > 0
        assert not [p for p in tmp_path.rglob("*") if p.is_file()], "objects dropped"
    finally:
        durable.sql("SET flightshuffle.storage = ''")
    assert run()[0] > 0
    assert s3_keys(store[1], "fs-durable") == []


def test_a_disk_budget_moves_spill_segments_to_the_store_and_reads_them_back(s3_server):
    """``durable=False, disk_budget=0``: the store is only the tier below local disk. Every
    spill segment moves to it once closed, the shuffle reads back exact by range, no map
    object is written, and nothing is left on the server after the drop."""
    options = s3_bucket(s3_server, "fs-tier")
    with fs.Cluster(
        workers=2,
        memory_budget="2MiB",
        timeout=60,
        storage="s3://fs-tier/spill",
        storage_options=options,
        durable=False,
        disk_budget=0,
    ) as c:
        df = frame(300_000)
        before = c.storage_stats()
        result = c.shuffle(df, by="key", partitions=4, map_bytes="256KiB")
        result.wait_mapped()
        keys = s3_keys(options, "fs-tier")
        assert keys and all("/spill/" in k and k.endswith(".seg") for k in keys), keys
        stats = c.stats()
        tiered = sum(w["tiered_segments"] for w in stats)
        assert tiered == len(keys), (stats, keys)
        assert all(w["disk_bytes"] == 0 for w in stats), stats
        parts = [pl.from_arrow(p) for p in result]
        assert_same_multiset(df, parts)
        assert_keys_not_split(parts, ["key"])
        requests = c.storage_stats()
        assert requests["puts"] - before["puts"] == tiered, (before, requests)
        assert requests["gets"] > before["gets"], (before, requests)
        assert c.recovery()["restored_blocks"] == 0
        del result
        deadline = time.monotonic() + 30
        while s3_keys(options, "fs-tier") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s3_keys(options, "fs-tier") == []
    with pytest.raises(ValueError, match="need storage="):
        fs.Cluster(workers=1, disk_budget="1GiB")


@pytest.mark.parametrize("strategy", ["store", "store-two-level"])
def test_strategy_store_reads_through_the_store_for_shuffles_and_sql(
    durable, store, tpch_data, strategy
):
    """``strategy="store"`` (Seer's direct exchange) and ``"store-two-level"`` (its second
    level first): readers fetch objects by range, so a worker killed after the maps committed
    costs no restore and no re-run; SQL exchanges through the store give DuckDB's answers
    (all 22 TPC-H queries two-level, four direct)."""
    df = frame(120_000)
    before, rec = durable.storage_stats(), durable.recovery()
    result = durable.shuffle(df, by="key", partitions=6, map_bytes="128KiB", strategy=strategy)
    maps = result.wait_mapped()["maps"]
    os.kill(durable.worker_pids[1], signal.SIGKILL)
    parts = [pl.from_arrow(p) for p in result]
    assert_same_multiset(df, parts)
    after = durable.recovery()
    assert after["recomputed_maps"] == rec["recomputed_maps"], after
    assert after["restored_blocks"] == rec["restored_blocks"], after
    assert after["rerun_jobs"] == rec["rerun_jobs"], after
    deadline = time.monotonic() + 60
    while True:  # the killed worker's replacement first (stats ask every worker)
        try:
            now = durable.storage_stats()
            break
        except fs.ShuffleError:  # WorkerLostError until the replacement is up
            assert time.monotonic() < deadline, "no replacement within 60 s"
            time.sleep(0.2)
    reads = now["gets"] - before["gets"]
    assert 6 <= reads <= maps * 6, (reads, maps)
    paths = tpch.table_paths(tpch_data)
    for name, path in paths.items():
        durable.register_parquet(name, path)
    con = tpch.duckdb_connect(tpch_data)
    durable.sql(f"SET flightshuffle.strategy = '{strategy}'")
    gets = durable.storage_stats()["gets"]
    try:
        for q in range(1, 23) if strategy == "store-two-level" else (3, 5, 9, 18):
            sql, ordered = tpch.query(q, TPCH_SF)
            diff = tpch.compare(con.sql(sql).to_arrow_table(), durable.sql(sql), ordered)
            assert diff is None, f"q{q} through the store ({strategy}): {diff}"
            # Every exchange through the store but a last one of sorted runs (merged by the
            # reader from each map's own output, which stays a pull), its ranged GETs shown.
            stages = durable.last_metrics["stages"]
            through = [s for s in stages if s["strategy"].startswith(strategy + ":")]
            assert len(through) >= len(stages) - 1, (q, [s["strategy"] for s in stages])
            assert all(s["store_gets"] > 0 for s in through if s["rows"]), (q, through)
        assert durable.storage_stats()["gets"] > gets
    finally:
        durable.sql("SET flightshuffle.strategy = ''")
    with fs.Cluster(workers=1) as plain, pytest.raises(ValueError, match="storage="):
        list(plain.shuffle(df, by="key", partitions=2, strategy="store"))


def test_remove_worker_shrinks_a_durable_cluster_without_losing_a_row(store, tpch_data):
    """A worker removed while a shuffle is half read: the rest is exact, read from the store,
    with no map run again and no replacement; its process is gone, the last worker took its
    index, and the smaller cluster answers TPC-H like DuckDB."""
    url, options = store
    df = frame(120_000)
    with fs.Cluster(
        workers=3, memory_budget="256MiB", timeout=60, storage=url, storage_options=options
    ) as c:
        result = c.shuffle(df, by="key", partitions=6, map_bytes="128KiB", strategy="merged")
        assert result.wait_mapped()["maps"] >= 6
        parts = [pl.from_arrow(next(result))]
        pids = c.worker_pids
        before = c.recovery()
        c.remove_worker(0)
        assert c.worker_pids == [pids[2], pids[1]], "the last worker took index 0"
        assert not alive(pids[0])
        parts += [pl.from_arrow(p) for p in result]
        assert_same_multiset(df, parts)
        assert_keys_not_split(parts, ["key"])
        after = c.recovery()
        for k in ("replacements", "recomputed_maps", "rerun_jobs", "restored_blocks"):
            assert after[k] == before[k], (k, after)
        result.close()
        paths = tpch.table_paths(tpch_data)
        for name, path in paths.items():
            c.register_parquet(name, path)
        con = tpch.duckdb_connect(tpch_data)
        for q in (3, 18):
            sql, ordered = tpch.query(q, TPCH_SF)
            assert tpch.compare(con.sql(sql).to_arrow_table(), c.sql(sql), ordered) is None
        c.remove_worker(1)
        with pytest.raises(ValueError, match="last worker"):
            c.remove_worker(0)
    assert s3_keys(store[1], "fs-durable") == []


def test_remove_worker_refuses_what_would_lose_rows():
    df = frame(20_000)
    with fs.Cluster(workers=2, timeout=60) as c:
        result = c.shuffle(df, by="key", partitions=4)
        parts = [pl.from_arrow(next(result))]
        with pytest.raises(ValueError, match=rf"{result.shuffle_id}.*not durable"):
            c.remove_worker(1)
        assert len(c.worker_pids) == 2 and all(alive(p) for p in c.worker_pids)
        parts += [pl.from_arrow(p) for p in result]
        assert_same_multiset(df, parts)
        result.close()
        with pytest.raises(ValueError, match="no worker 7"):
            c.remove_worker(7)
        with pytest.raises(ValueError, match="worker must be an index"):
            c.remove_worker(-1)
        c.remove_worker(1)  # nothing alive to lose
        assert_same_multiset(df, [pl.from_arrow(p) for p in c.shuffle(df, by="key")])
