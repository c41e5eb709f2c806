"""Shared helpers: multiset checks on shuffle output, a shared local cluster, TPC-H SF 0.1
data."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import flightshuffle as fs
import polars as pl
import pytest
from flightshuffle_bench import tpch

# Test data is small: every SQL query of the tests is distributed (its stages, exchanges and
# recovery are what they test) unless a test asks for a cluster's default threshold.
os.environ.setdefault("FLIGHTSHUFFLE_SMALL_QUERY_ROWS", "0")

TPCH_SF = 0.1
TPCH_DATA = os.environ.get(
    "FLIGHTSHUFFLE_TPCH_DATA",
    os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", f"tpch-sf{TPCH_SF}"),
)


@pytest.fixture(scope="session")
def tpch_data() -> str:
    """TPC-H SF 0.1 Parquet files (generated on first use)."""
    return tpch.ensure_data(TPCH_SF, TPCH_DATA, progress=False)


@pytest.fixture(scope="module")
def tpch_cluster(tpch_data: str) -> Iterator[fs.Cluster]:
    """Two real workers with every TPC-H SF 0.1 table registered (one per test module)."""
    with fs.Cluster(workers=2, timeout=120) as c:
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        yield c


@pytest.fixture(scope="session")
def tpch_duckdb(tpch_data: str) -> Any:
    """DuckDB over the same TPC-H files: the reference answers."""
    return tpch.duckdb_connect(tpch_data)


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
    # Gone before the open, or reaped between the open and the read (ESRCH).
    except (FileNotFoundError, ProcessLookupError):
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


@pytest.fixture(autouse=True)
def _python_handles_ctrl_c() -> Iterator[None]:
    """Every test starts with Python's own SIGINT handler, installed again (which also puts
    back CPython's C-level handler): the Ctrl-C tests failed once in a full run, after some
    earlier code in the process had taken SIGINT over, and never alone."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3-compatible server (moto's, in a thread of this process) on loopback for the
    whole session. Its buckets live in this process, so a server stopped and started again on
    the same port still has them."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server
    server.stop()


def s3_endpoint(server: Any) -> str:
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


def s3_bucket(server: Any, bucket: str) -> dict[str, str]:
    """Create ``bucket`` on ``server``; returns the ``storage_options`` that reach it."""
    options = {
        "aws_endpoint": s3_endpoint(server),
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing-secret",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }
    s3_client(options).create_bucket(Bucket=bucket)
    return options


def s3_client(options: dict[str, str]) -> Any:
    """A boto3 client of the server ``options`` name (the server's own view of requests)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options["aws_endpoint"],
        aws_access_key_id=options["aws_access_key_id"],
        aws_secret_access_key=options["aws_secret_access_key"],
        region_name=options["aws_region"],
    )


def s3_keys(options: dict[str, str], bucket: str) -> list[str]:
    """Every object key in ``bucket``, as the server lists them."""
    pages = s3_client(options).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


os.environ.setdefault("FLIGHTSHUFFLE_LOG", "error")
