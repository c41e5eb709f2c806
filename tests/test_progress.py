"""Progress bars on ``sql()`` and ``shuffle()``: drawn on stderr when asked (or on a terminal),
counting a query's exchanges sealed of those planned with the rows and bytes written, and a
shuffle's partitions read; nothing is written when stderr is not a terminal."""

from __future__ import annotations

import re

import flightshuffle as fs
import polars as pl
import pytest
from conftest import TPCH_SF
from flightshuffle_bench import tpch


@pytest.fixture(scope="module")
def cluster(tpch_data):
    with fs.Cluster(workers=2, memory_budget="256MiB", timeout=60) as c:
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        yield c


def test_a_query_bar_counts_its_stages_and_rows(cluster, capfd):
    sql, _ = tpch.query(3, TPCH_SF)
    cluster.sql(sql)
    assert capfd.readouterr().err == "", "no bar off a terminal by default"
    cluster.sql(sql, progress=True)
    err = capfd.readouterr().err
    stages = len(cluster.last_metrics["stages"])
    rows = sum(s["rows"] for s in cluster.last_metrics["stages"])
    # The last frame drawn before the bar is cleared: every stage sealed, every row counted.
    frames = [f for f in re.split(r"[\r\n]", err) if f.startswith("sql")]
    assert frames, err
    assert f"{stages}/{stages}" in frames[-1] and f"{rows:,} rows" in frames[-1], frames[-1]


def test_a_shuffle_bar_counts_partitions(cluster, capfd):
    df = pl.DataFrame({"k": [i % 101 for i in range(50_000)]})
    parts = list(cluster.shuffle(df, by="k", partitions=5, progress=True))
    assert sum(p.num_rows for p in parts) == 50_000
    frames = [f for f in re.split(r"[\r\n]", capfd.readouterr().err) if f.startswith("shuffle")]
    assert "5/5" in frames[-1] and "50,000 rows" in frames[-1], frames
    list(cluster.shuffle(df, by="k", partitions=5))
    assert capfd.readouterr().err == ""
