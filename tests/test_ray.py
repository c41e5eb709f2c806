"""Workers hosted on Ray (``Cluster(runtime="ray")``) on a local Ray cluster of two nodes that
the test starts itself (``ray.cluster_utils.Cluster``): shuffles, SQL, datasets and online
aggregation give what they give on one process, and a worker actor killed mid-query is
replaced while the answer stays exact."""

from __future__ import annotations

import os
import threading
import time

import flightshuffle as fs
import polars as pl
import pytest
from conftest import TPCH_SF, alive, assert_same_multiset
from flightshuffle_bench import tpch

ray = pytest.importorskip(
    "ray", reason='Ray is not installed: pip install "flightshuffle[ray]" to run these tests'
)

SF = TPCH_SF


@pytest.fixture(scope="module")
def ray_nodes():
    """A Ray cluster of two nodes (one CPU each) on this machine, and a driver connected."""
    from ray.cluster_utils import Cluster as RayCluster

    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, logging_level="warning", include_dashboard=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def test_a_paused_worker_dies_with_its_actor(ray_nodes):
    """A paused (SIGSTOPped) worker cannot see its stdin close; killing its actor must still
    kill it, so it never comes back with stale attempts after a replacement."""
    import signal
    import time

    # Runs before the module's cluster exists (that one holds both nodes' CPUs).
    with fs.Cluster(workers=1, runtime="ray", timeout=30) as c:
        (pid,) = c.worker_pids
        os.kill(pid, signal.SIGSTOP)
        c._ray.kill(0)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "a paused worker outlived its actor"


# The tests above the module's cluster run before it takes both nodes' CPUs.


def test_workers_ray_cannot_place_are_a_clear_error_within_the_timeout(ray_nodes):
    """More CPUs per worker than any node has: a clear error naming what was asked, within the
    cluster's timeout, and the Ray cluster is left as it was."""
    import time

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="could not place 2 workers"):
        fs.Cluster(workers=2, runtime="ray", timeout=5, ray_resources={"CPU": 64})
    assert time.monotonic() - started < 30
    assert ray.is_initialized(), "Ray started by the caller stays up"


def test_speculation_is_checked_on_ray_too(ray_nodes):
    with pytest.raises(ValueError, match="speculation"):
        fs.Cluster(workers=1, runtime="ray", timeout=20, speculation=0.5)


@pytest.fixture(scope="module")
def rc(ray_nodes, tpch_data):
    with fs.Cluster(workers=2, runtime="ray", memory_budget="256MiB", timeout=60) as c:
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        pids = c.worker_pids
        yield c
        pids += c.worker_pids
    assert pids and not any(alive(p) for p in pids), "workers left behind after close"


def test_workers_are_actors_spread_over_the_nodes_and_a_shuffle_is_exact(rc):
    nodes = ray.get([a.node_id.remote() for a in rc._ray.actors])
    assert len(set(nodes)) == 2, "one worker per node (placement group spread)"
    assert rc.connection_info()["ca"], "TLS on by default on Ray too"
    n = 200_000
    df = pl.DataFrame(
        {
            "k": [None if i % 97 == 0 else i % 1000 for i in range(n)],
            "s": [f"row-{i % 37}" for i in range(n)],
            "v": list(range(n)),
        }
    )
    parts = [pl.from_arrow(p) for p in rc.shuffle(df, by="k", partitions=6)]
    assert_same_multiset(df, parts)


def test_each_actor_serves_its_own_key_and_no_secret_is_a_constructor_argument(rc):
    """Each worker actor made its own TLS key (the workers show different public keys, both
    signed by the cluster CA, whose key stays with the driver), and the actors were created
    with no token, key or certificate among their constructor arguments. Before: one key and
    certificate for every worker, passed with the token to each actor's constructor."""
    import inspect
    import socket
    import ssl

    from flightshuffle.ray_runtime import WorkerHost

    info = rc.connection_info()
    ctx = ssl.create_default_context(cadata=info["ca"])
    ctx.check_hostname = False
    shown = []
    for addr in info["addresses"]:
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        with ctx.wrap_socket(sock) as tls:  # verified against the cluster CA
            shown.append(tls.getpeercert(binary_form=True))
    assert len(set(shown)) == len(shown) == 2, "workers share a certificate"
    assert "key" not in (rc._ray.pem or {}), "a key travels to the actors"

    params = inspect.signature(WorkerHost.__init__).parameters
    assert [p for p in params if not p.startswith("_")] == ["self", "slot"]


def test_tpch_queries_equal_duckdb(rc, tpch_data):
    con = tpch.duckdb_connect(tpch_data)
    for q in (1, 3, 5, 18):
        sql, ordered = tpch.query(q, SF)
        assert tpch.compare(con.sql(sql).to_arrow_table(), rc.sql(sql), ordered) is None, q


def test_a_dataset_and_an_online_aggregation(rc, tpch_data):
    path = tpch.table_paths(tpch_data)["orders"]
    keys = ["o_orderpriority"]
    aggs = [pl.col("o_totalprice").sum().alias("total"), pl.len().alias("n")]
    got = rc.read_parquet(path).group_by(keys).agg(aggs).to_polars().sort(keys)
    want = pl.read_parquet(path).group_by(keys).agg(aggs).sort(keys)
    assert got["n"].to_list() == want["n"].to_list()
    total, want_total = got["total"].cast(pl.Float64), want["total"].cast(pl.Float64)
    assert ((total - want_total).abs() <= 1e-9 * want_total.abs()).all()

    query = "SELECT o_orderstatus, COUNT(*) AS n, SUM(o_totalprice) AS s FROM orders GROUP BY o_orderstatus"
    results = list(rc.online(query, rounds=3, seed=1, progress=False))
    assert results[-1].final
    final = results[-1].estimates.sort("o_orderstatus")
    exact = (
        pl.read_parquet(path)
        .group_by("o_orderstatus")
        .agg(pl.len().alias("n"), pl.col("o_totalprice").sum().alias("s"))
    )
    exact = exact.sort("o_orderstatus")
    assert final["n"].cast(pl.Int64).to_list() == exact["n"].to_list()
    s, want_s = final["s"].cast(pl.Float64), exact["s"].cast(pl.Float64)
    assert ((s - want_s).abs() <= 1e-9 * want_s.abs()).all()


def test_an_actor_killed_mid_query_is_replaced_and_the_answer_is_exact(rc, tpch_data):
    """Kill one worker's actor as a query starts: its worker process dies with it (fenced),
    the driver finds the worker lost, Ray starts a new actor in the same bundle, and the query
    equals DuckDB's answer; so does the next one."""
    con = tpch.duckdb_connect(tpch_data)
    sql, ordered = tpch.query(18, SF)
    want = con.sql(sql).to_arrow_table()
    pids = rc.worker_pids
    before = rc.recovery()["replacements"]
    killer = threading.Timer(0.02, rc._ray.kill, args=(1,))
    killer.start()
    assert tpch.compare(want, rc.sql(sql), ordered) is None
    killer.join()
    assert tpch.compare(want, rc.sql(sql), ordered) is None
    assert rc.recovery()["replacements"] == before + 1
    assert rc.recovery()["rerun_jobs"] == 0
    assert not alive(pids[1]), "the killed actor's worker process died with it"
    now = rc.worker_pids
    assert now[0] == pids[0] and now[1] not in (0, pids[1])


def test_ray_runtime_errors_are_clear():
    with pytest.raises(ValueError, match="runtime"):
        fs.Cluster(workers=1, runtime="yarn")  # type: ignore[arg-type]


def test_a_removed_worker_stops_its_actor_and_queries_stay_exact(rc, tpch_data):
    """Last in this module (it shrinks the shared cluster): with no shuffle alive, a worker is
    removed, its actor and process stop, and the one-worker cluster answers like DuckDB."""
    con = tpch.duckdb_connect(tpch_data)
    pids = rc.worker_pids
    rc.remove_worker(0)
    assert rc.worker_pids == [pids[1]]
    assert len(rc._ray.actors) == 1
    # Ray kills the actor asynchronously; its worker process dies with it.
    deadline = time.monotonic() + 30
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[0])
    sql, ordered = tpch.query(3, SF)
    assert tpch.compare(con.sql(sql).to_arrow_table(), rc.sql(sql), ordered) is None
