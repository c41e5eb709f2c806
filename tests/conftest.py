"""Shared helpers: multiset checks on shuffle output, a shared local cluster, TPC-H SF 0.1
data."""

from __future__ import annotations

import os

import flightshuffle as fs
import polars as pl
import pytest
from flightshuffle_bench import tpch

TPCH_SF = 0.1
TPCH_DATA = os.environ.get(
    "FLIGHTSHUFFLE_TPCH_DATA",
    os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", f"tpch-sf{TPCH_SF}"),
)


@pytest.fixture(scope="session")
def tpch_data() -> str:
    """TPC-H SF 0.1 Parquet files (generated on first use)."""
    return tpch.ensure_data(TPCH_SF, TPCH_DATA, progress=False)


def checksum(df: pl.DataFrame) -> tuple[int, int]:
    """Row count and an order-independent content checksum (sum of row hashes mod 2^64)."""
    if df.height == 0:
        return (0, 0)
    return (df.height, sum(df.hash_rows(seed=7).to_list()) % 2**64)


def assert_same_multiset(expected: pl.DataFrame, parts: list[pl.DataFrame]) -> None:
    got = pl.concat(parts) if parts else expected.clear()
    assert checksum(got) == checksum(expected)
    cols = expected.columns
    assert got.sort(cols, nulls_last=True).equals(expected.sort(cols, nulls_last=True))


def assert_keys_not_split(parts: list[pl.DataFrame], keys: list[str]) -> None:
    tagged = pl.concat(
        [
            p.select(keys).unique().with_columns(pl.lit(i).alias("_part"))
            for i, p in enumerate(parts)
        ]
    )
    per_key = tagged.group_by(keys).agg(pl.col("_part").n_unique().alias("n"))
    assert (per_key["n"].max() or 1) == 1, "a key was split across partitions"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return ") Z " not in f.read()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def cluster():
    with fs.Cluster(workers=3, memory_budget="256MiB", timeout=60) as c:
        pids = c.worker_pids
        yield c
        # Taken before close (after it the cluster lists none), replacements included.
        pids += c.worker_pids
    assert pids and not any(alive(p) for p in pids), "workers left behind"


@pytest.fixture
def pids_gone():
    def check(pids: list[int]) -> None:
        left = [p for p in pids if alive(p)]
        assert not left, f"processes left behind: {left}"

    return check


os.environ.setdefault("FLIGHTSHUFFLE_LOG", "error")
