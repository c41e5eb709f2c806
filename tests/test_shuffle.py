"""End-to-end shuffles from Python through real worker processes."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import duckdb
import flightshuffle as fs
import polars as pl
import pyarrow as pa
import pytest
from conftest import assert_keys_not_split, assert_same_multiset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def sample_frame(n: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "key": [i % 211 for i in range(n)],
            "name": [None if i % 13 == 0 else f"name-{i % 97}" for i in range(n)],
            "x": [i * 0.5 for i in range(n)],
        },
        schema={"key": pl.Int64, "name": pl.String, "x": pl.Float64},
    )


def as_polars(parts: list) -> list[pl.DataFrame]:
    return [p if isinstance(p, pl.DataFrame) else pl.from_arrow(p) for p in parts]


STRATEGIES = ["pull", "merged", "push", "two-level", "auto"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["pyarrow", "pyarrow_reader", "polars", "duckdb"])
def test_every_input_kind_keeps_the_multiset(cluster, kind, strategy):
    df = sample_frame(60_000)
    if kind == "pyarrow":
        data = df.to_arrow()
    elif kind == "pyarrow_reader":
        data = pa.RecordBatchReader.from_batches(
            df.to_arrow().schema, df.to_arrow().to_batches(max_chunksize=5_000)
        )
    elif kind == "polars":
        data = df
    else:
        con = duckdb.connect()
        con.register("df_view", df.to_arrow())
        data = con.sql("SELECT * FROM df_view")
    parts = list(
        cluster.shuffle(data, by="key", partitions=7, map_bytes="256KiB", strategy=strategy)
    )
    assert len(parts) == 7
    parts = as_polars(parts)
    expected = (
        pl.from_arrow(df.to_arrow()) if kind != "duckdb" else pl.from_arrow(data.to_arrow_table())
    )
    assert_same_multiset(expected, parts)
    assert_keys_not_split(parts, ["key"])


def test_polars_output_and_multi_key_hash(cluster):
    df = sample_frame(20_000)
    result = cluster.shuffle(df, by=["key", "name"], partitions=4, output="polars")
    parts = list(result)
    assert all(isinstance(p, pl.DataFrame) for p in parts)
    assert result.partition_ids == [0, 1, 2, 3]
    assert_same_multiset(df, parts)
    assert_keys_not_split(parts, ["key", "name"])


def test_range_partitions_are_ordered(cluster):
    df = sample_frame(30_000).with_columns(pl.col("x").shuffle(seed=1))
    parts = as_polars(list(cluster.shuffle(df, by="x", partitions=5, partitioner="range")))
    assert_same_multiset(df, parts)
    bounds = [(p["x"].min(), p["x"].max()) for p in parts if p.height]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bounds))


def test_round_robin_without_keys_balances(cluster):
    df = sample_frame(10_000)
    parts = as_polars(list(cluster.shuffle(df, partitions=4, map_bytes="64KiB")))
    assert_same_multiset(df, parts)
    sizes = [p.height for p in parts]
    assert max(sizes) - min(sizes) <= 0.2 * max(sizes)


def test_empty_input_yields_empty_partitions(cluster):
    df = sample_frame(0)
    parts = as_polars(list(cluster.shuffle(df, by="key", partitions=3)))
    assert [p.height for p in parts] == [0, 0, 0]
    assert parts[0].columns == df.columns


def test_bad_arguments_are_clear_errors(cluster):
    df = sample_frame(10)
    with pytest.raises(ValueError, match="nope"):
        list(cluster.shuffle(df, by="nope", partitions=2))
    with pytest.raises(ValueError, match="unknown strategy"):
        cluster.shuffle(df, by="key", strategy="scatter")
    with pytest.raises(TypeError, match="does not export Arrow"):
        cluster.shuffle([1, 2, 3], by="key")
    with pytest.raises(ValueError, match="needs key columns"):
        cluster.shuffle(df, partitioner="hash")
    with pytest.raises(ValueError, match="at most 65536"):
        list(cluster.shuffle(df, by="key", partitions=2**31))
    # Zero partitions is a mistake, not a request for the default.
    with pytest.raises(ValueError, match="partitions must be at least 1"):
        list(cluster.shuffle(df, by="key", partitions=0))
    with pytest.raises(ValueError, match="byte size"):
        fs.parse_bytes("lots")
    assert fs.parse_bytes("1.5KiB") == 1536


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.one_of(st.none(), st.integers(-5, 40)), min_size=0, max_size=400),
    partitions=st.integers(1, 9),
    partitioner=st.sampled_from(["hash", "range", "round_robin"]),
)
def test_any_small_input_keeps_its_multiset(cluster, keys, partitions, partitioner):
    df = pl.DataFrame(
        {"k": keys, "s": [f"s{i % 5}" for i in range(len(keys))]},
        schema={"k": pl.Int64, "s": pl.String},
    )
    by = None if partitioner == "round_robin" else "k"
    parts = as_polars(
        list(
            cluster.shuffle(
                df, by=by, partitions=partitions, partitioner=partitioner, map_bytes=512
            )
        )
    )
    assert len(parts) == partitions
    assert_same_multiset(df, parts)
    if by:
        assert_keys_not_split(parts, ["k"])


def test_merging_strategies_keep_the_multiset_with_fewer_blocks(cluster):
    df = sample_frame(60_000)
    # 30 batches of 2,000 rows, one map task each: many small map outputs to merge.
    data = pa.Table.from_batches(df.to_arrow().to_batches(max_chunksize=2_000))
    blocks = {}
    for strategy in STRATEGIES:
        result = cluster.shuffle(
            data, by="key", partitions=5, strategy=strategy, map_bytes=1, output="polars"
        )
        parts = list(result)
        assert_same_multiset(df, parts)
        assert_keys_not_split(parts, ["key"])
        blocks[strategy] = result.wait_mapped()["blocks"]
    for strategy in ["merged", "push", "two-level"]:
        assert blocks[strategy] * 4 <= blocks["pull"], blocks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skewed_keys_with_nulls_and_strings_under_a_spilling_budget(strategy):
    n = 40_000
    # Half the rows share one key; nulls and strings too.
    df = pl.DataFrame(
        {
            "k": [None if i % 17 == 0 else (7 if i % 2 else i % 501) for i in range(n)],
            "s": [None if i % 11 == 0 else f"str-{i % 313}" * (1 + i % 3) for i in range(n)],
            "x": list(range(n)),
        },
        schema={"k": pl.Int64, "s": pl.String, "x": pl.Int64},
    )
    data = pa.Table.from_batches(df.to_arrow().to_batches(max_chunksize=1_000))
    with fs.Cluster(workers=3, memory_budget="256KiB", timeout=60) as small:
        for by in ["k", ["s", "k"]]:
            result = small.shuffle(data, by=by, partitions=6, strategy=strategy, map_bytes=1)
            parts = as_polars(list(result))
            assert_same_multiset(df, parts)
            assert_keys_not_split(parts, [by] if isinstance(by, str) else by)
        assert sum(w["spilled_bytes"] for w in small.stats()) > 0


@pytest.mark.parametrize("kind", ["pyarrow", "polars", "pyarrow_reader"])
def test_auto_estimates_the_map_count_of_an_in_memory_table(cluster, kind):
    # auto decides after the first wave; for a table it knows M from the table's bytes over
    # map_bytes (not the maps submitted so far), and says so in its note. A stream's size is
    # unknown, and the note says that instead.
    df = sample_frame(200_000)
    table = df.to_arrow()
    data = {
        "pyarrow": table,
        "polars": df,
        "pyarrow_reader": pa.RecordBatchReader.from_batches(
            table.schema, table.to_batches(max_chunksize=5_000)
        ),
    }[kind]
    size = table.nbytes if kind != "polars" else df.estimated_size()
    result = cluster.shuffle(data, by="key", partitions=8, map_bytes="128KiB", strategy="auto")
    parts = as_polars(list(result))
    assert_same_multiset(df, parts)
    note = result.wait_mapped()["strategy_choice"]
    assert note.startswith("auto: "), note
    if kind == "pyarrow_reader":
        assert "so far, the input's size unknown" in note, note
    else:
        expected = -(-size // (128 << 10))
        assert f", {expected} maps, " in note, (expected, note)


def test_a_one_chunk_frame_is_cut_into_several_map_tasks(cluster):
    # A Polars DataFrame exports one chunk; it must still make about bytes / map_bytes maps
    # (cut into row slices), not one map task for the whole frame.
    df = sample_frame(300_000).rechunk()
    assert df.n_chunks() == 1
    result = cluster.shuffle(df, by="key", partitions=6, map_bytes="256KiB")
    parts = as_polars(list(result))
    assert_same_multiset(df, parts)
    assert_keys_not_split(parts, ["key"])
    # ~6.7 MB in 256 KiB maps: one map task before frames were cut, 19 now.
    maps = result.wait_mapped()["maps"]
    assert maps >= 10, maps


def test_connection_info_reaches_workers_and_the_token_stays_out_of_their_environment(cluster):
    """A pyarrow Flight client with the token from connection_info() is served; without it,
    or with another, it is refused; the workers never had the token in their environment
    (user code there could read it)."""
    from pyarrow import flight

    info = cluster.connection_info()
    assert info["ca"].startswith("-----BEGIN CERTIFICATE")
    assert len(info["addresses"]) == cluster.workers
    client = flight.FlightClient(f"grpc+tls://{info['addresses'][0]}", tls_root_certs=info["ca"])
    good = flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {info['token']}".encode())]
    )
    assert list(client.do_action(flight.Action("health", b""), options=good))
    for headers in ([], [(b"authorization", b"Bearer not-the-token")]):
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(
                client.do_action(
                    flight.Action("health", b""), flight.FlightCallOptions(headers=headers)
                )
            )
    for pid in cluster.worker_pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert info["token"].encode() not in environ
        assert b"FLIGHTSHUFFLE_TOKEN" not in environ


def _health(location: str, token: str, **tls: Any) -> None:
    from pyarrow import flight

    client = flight.FlightClient(location, **tls)
    options = flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10
    )
    try:
        list(client.do_action(flight.Action("health", b""), options=options))
    finally:
        client.close()


def test_tls_is_on_by_default_plaintext_and_unknown_cas_are_refused(cluster, tmp_path):
    """Workers speak TLS only: a plaintext client and a TLS client that does not trust the
    cluster's CA both fail, even with the token. Under mutual TLS a client without a
    certificate is refused and one with the cluster's is served; a cluster started with
    certificate files of its own works; tls=False runs plaintext."""
    from pyarrow import flight

    info = cluster.connection_info()
    addr = info["addresses"][0]
    _health(f"grpc+tls://{addr}", info["token"], tls_root_certs=info["ca"])
    with pytest.raises(flight.FlightError):
        _health(f"grpc://{addr}", info["token"])
    with pytest.raises(flight.FlightError):
        _health(f"grpc+tls://{addr}", info["token"])  # the system's CAs only

    with fs.Cluster(workers=1, tls="mutual") as c:
        m = c.connection_info()
        loc = f"grpc+tls://{m['addresses'][0]}"
        with pytest.raises(flight.FlightError):
            _health(loc, m["token"], tls_root_certs=m["ca"])
        _health(loc, m["token"], tls_root_certs=m["ca"], cert_chain=m["cert"], private_key=m["key"])
        files = {}
        for name in ("ca", "cert", "key"):
            files[name] = tmp_path / f"{name}.pem"
            files[name].write_text(m[name])
    table = pa.table({"k": list(range(1000))})
    for tls in (files, {**files, "mutual": True}, False):
        with fs.Cluster(workers=2, tls=tls) as c:
            got = pa.concat_tables(c.shuffle(table, by="k", partitions=3))
            assert sorted(got["k"].to_pylist()) == list(range(1000)), tls
            assert (c.connection_info()["ca"] is None) == (tls is False)
    with pytest.raises(ValueError, match="tls"):
        fs.Cluster(workers=1, tls="sometimes")
    with pytest.raises(ValueError, match="missing"):
        fs.Cluster(workers=1, tls={"ca": files["ca"]})


def test_large_batches_are_cut_and_a_row_over_the_message_cap_is_a_clear_error(cluster):
    """A 100 MB input batch of 50 KB strings crosses the transport's 64 MiB message cap in
    pieces (map input in 2 MiB messages, blocks in batches of at most 16 MiB) and comes back
    exact; a single 70 MiB row cannot be cut and is a ValueError naming the cap, at once; the
    cluster goes on."""
    big = "y" * 50_000
    table = pa.table({"k": list(range(2000)), "s": [f"{i}{big}" for i in range(2000)]})
    got = pa.concat_tables(cluster.shuffle(table, by="k", partitions=3))
    assert sorted(got["k"].to_pylist()) == list(range(2000))
    assert sorted(got["s"].to_pylist()) == sorted(table["s"].to_pylist())
    huge = pa.table({"k": [1, 2], "s": ["z" * (70 << 20), "a"]})
    with pytest.raises(ValueError, match="64 MiB"):
        pa.concat_tables(cluster.shuffle(huge, by="k", partitions=2))
    got = pa.concat_tables(cluster.shuffle(table, by="k", partitions=3))
    assert got.num_rows == 2000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_map_tasks_run_on_lower_priority_threads_apart_from_serving(cluster):
    """Map tasks run on their own runtime, whose worker threads are 10 nice steps below the
    worker's own priority; the threads serving Flight (block reads, folds, commits) keep it."""
    df = sample_frame(60_000)
    # Small map tasks: some run on every worker.
    result = cluster.shuffle(df, by="key", partitions=3, output="polars", map_bytes="64KiB")
    assert_same_multiset(df, list(result))
    for pid in cluster.worker_pids:
        nice: dict[str, set[int]] = {}
        base = None
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except FileNotFoundError:
                continue  # the thread ended meanwhile
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            value = int(stat[stat.rindex(")") + 2 :].split()[16])
            nice.setdefault(name, set()).add(value)
            if int(tid) == pid:
                base = value
        assert base is not None
        # Thread names are cut to 15 bytes. The compute runtime's blocking threads (file
        # reads, Python map tasks) keep the worker's priority.
        assert min(base + 10, 19) in nice.get("flightshuffle-c", set()), nice
        assert nice.get("flightshuffle-w") == {base}, nice
