"""Distributed datasets on real worker processes: Polars functions and DuckDB SQL run on the
workers over TPC-H SF 0.1 must give what the same work gives on one process."""

from __future__ import annotations

import os

import duckdb
import flightshuffle as fs
import polars as pl
import pytest
from conftest import assert_keys_not_split, assert_same_multiset
from flightshuffle_bench import tpch

SF = 0.1
DATA = os.environ.get(
    "FLIGHTSHUFFLE_TPCH_DATA",
    os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", f"tpch-sf{SF}"),
)


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return tpch.table_paths(tpch.ensure_data(SF, DATA, progress=False))


@pytest.fixture(scope="module")
def cl():
    with fs.Cluster(workers=2, memory_budget="512MiB", timeout=120) as c:
        yield c


def same_frame(got: pl.DataFrame, want: pl.DataFrame, keys: list[str]) -> None:
    assert got.columns == want.columns
    assert got.height == want.height
    got, want = got.sort(keys), want.sort(keys)
    for c in want.columns:
        if want[c].dtype.is_float() or want[c].dtype == pl.Decimal:
            a, b = got[c].cast(pl.Float64), want[c].cast(pl.Float64)
            assert ((a - b).abs() <= 1e-9 * b.abs().clip(1.0)).all(), c
        else:
            assert got[c].to_list() == want[c].to_list(), c


def test_polars_pipeline_matches_one_process(cl, paths):
    def prep(df: pl.DataFrame) -> pl.DataFrame:
        return df.filter(pl.col("l_quantity") > 5).with_columns(
            (pl.col("l_extendedprice") * (1 - pl.col("l_discount"))).alias("net")
        )

    aggs = [
        pl.col("net").sum().alias("revenue"),
        pl.col("l_quantity").mean().alias("avg_qty"),
        pl.len().alias("n"),
        pl.col("l_shipdate").min().alias("first_ship"),
        pl.col("l_shipdate").max().alias("last_ship"),
        pl.col("l_tax").count().alias("taxed"),
    ]
    keys = ["l_returnflag", "l_linestatus"]
    got = cl.read_parquet(paths["lineitem"]).map_partitions(prep).group_by(keys).agg(aggs)
    want = prep(pl.read_parquet(paths["lineitem"])).group_by(keys).agg(aggs)
    same_frame(got.to_polars(), want, keys)


def test_aggregate_without_partial_form_shuffles_rows(cl, paths):
    keys = ["o_orderpriority"]
    aggs = [pl.col("o_custkey").n_unique().alias("customers"), pl.col("o_totalprice").median()]
    got = cl.read_parquet(paths["orders"]).group_by(keys).agg(aggs).to_polars()
    want = pl.read_parquet(paths["orders"]).group_by(keys).agg(aggs)
    same_frame(got, want, keys)


def test_duckdb_pipeline_matches_one_process(cl, paths):
    ds = (
        cl.read_parquet(paths["orders"])
        .duckdb_sql("SELECT o_custkey, o_totalprice FROM partition WHERE o_orderstatus = 'F'")
        .repartition(4, by="o_custkey")
        .duckdb_sql(
            "SELECT o_custkey, count(*) AS n, sum(o_totalprice) AS total "
            "FROM partition GROUP BY o_custkey"
        )
    )
    got = ds.to_polars()
    want = pl.from_arrow(
        duckdb.sql(
            f"SELECT o_custkey, count(*) AS n, sum(o_totalprice) AS total "
            f"FROM read_parquet('{paths['orders']}/*.parquet') WHERE o_orderstatus = 'F' "
            "GROUP BY o_custkey"
        ).to_arrow_table()
    )
    same_frame(got, want, ["o_custkey"])
    # DuckDB reads a dataset directly (Arrow PyCapsule export).
    assert duckdb.sql("SELECT count(*) FROM ds").fetchall() == [(want.height,)]


def test_repartition_keeps_every_row_and_never_splits_a_key(cl, paths):
    src = pl.read_parquet(paths["orders"]).select("o_orderkey", "o_custkey", "o_comment")
    parts = [
        pl.from_arrow(p)
        for p in cl.from_arrow(src).repartition(5, by="o_custkey").iter_partitions()
    ]
    assert len(parts) == 5
    assert_same_multiset(src, parts)
    assert_keys_not_split(parts, ["o_custkey"])
    rr = cl.from_arrow(src).repartition(3).to_polars()
    assert_same_multiset(src, [rr])


def test_errors_are_clear(cl, paths):
    ds = cl.read_parquet(paths["nation"])
    with pytest.raises(fs.ShuffleError, match="ZeroDivisionError"):
        ds.map_partitions(lambda df: 1 / 0 if df.height else df).to_polars()
    with pytest.raises(ValueError, match="not a column"):
        ds.repartition(2, by="nope").to_polars()
    with pytest.raises(ValueError, match="not columns"):
        ds.group_by("nope").agg(pl.len())
    with pytest.raises(ValueError, match="at least 1"):
        ds.group_by("n_regionkey").agg(pl.len(), partitions=0)
    with pytest.raises(TypeError):
        ds.map_partitions("not a function")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        cl.read_parquet("/no/such/dir")
    # The cluster still works after a failed stage.
    assert ds.to_polars().height == 25
