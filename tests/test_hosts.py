"""A static cluster across simulated hosts: network namespaces joined by a bridge, each link
capped at 1 Gbit/s with tc tbf (``flightshuffle_bench.simhosts``). Workers are started by hand
(``flightshuffle worker`` with a token file and certificates from ``flightshuffle certs``) and
the driver connects with ``Cluster(addresses=...)``. Needs root: skipped with the reason
elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from flightshuffle import Cluster, ShuffleError
from flightshuffle_bench import simhosts, tpch

pytestmark = pytest.mark.skipif(
    simhosts.unavailable() is not None, reason=str(simhosts.unavailable())
)


def certs(tmp_path, hosts: simhosts.SimHosts) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "flightshuffle.cli", "certs", str(tmp_path / "certs"),
         *(a for ip in hosts.ips for a in ("--host", ip))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def start(hosts, tmp_path, files, supervise=False, args=None) -> list[str]:
    spill = tmp_path / "spill"
    return [
        hosts.start_worker(i, files, str(spill / f"h{i}"), args=args, supervise=supervise)
        for i in range(hosts.n)
    ]


def table(rows: int) -> pa.Table:
    k = pa.array([(i * 7919) % 10007 for i in range(rows)], pa.int64())
    return pa.table({"k": k, "v": pa.array(range(rows), pa.int64())})


def multiset(t: pa.Table) -> tuple[int, int, int]:
    return t.num_rows, sum(t.column("k").to_pylist()), sum(t.column("v").to_pylist())


def connect(addresses, files, **kw) -> Cluster:
    with open(files["token_file"]) as f:
        token = f.read().strip()
    return Cluster(addresses=addresses, token=token, tls={"ca": files["ca"]}, **kw)


@pytest.fixture
def hosts():
    with simhosts.SimHosts(3, rate="1gbit") as h:
        yield h


def test_a_static_cluster_across_hosts_shuffles_and_answers_sql_exactly(hosts, tmp_path, tpch_data):
    files = certs(tmp_path, hosts)
    addresses = start(hosts, tmp_path, files)
    assert [a.rsplit(":", 1)[0] for a in addresses] == hosts.ips
    data = table(200_000)
    with connect(addresses, files) as c:
        assert c.runtime == "static" and c.workers == 3
        for strategy in ("pull", "push"):
            out = pa.concat_tables(
                c.shuffle(data, by="k", partitions=12, strategy=strategy), promote_options="none"
            )
            assert multiset(out) == multiset(data), strategy
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        con = tpch.duckdb_connect(tpch_data)
        for q in (3, 18):
            sql, ordered = tpch.query(q, 0.1)
            diff = tpch.compare(con.sql(sql).to_arrow_table(), c.sql(sql), ordered)
            assert diff is None, f"q{q}: {diff}"


def test_a_worker_restarted_at_its_address_takes_its_slot(hosts, tmp_path):
    files = certs(tmp_path, hosts)
    addresses = start(hosts, tmp_path, files, supervise=True)
    data = table(300_000)
    with connect(addresses, files, restart_wait=30) as c:
        result = c.shuffle(data, by="k", partitions=12, map_bytes="256KiB", strategy="pull")
        parts = [next(result)]
        old = hosts.worker_pid(1)
        os.kill(old, signal.SIGKILL)  # mid-read: 11 partitions to go
        parts += list(result)
        out = pa.concat_tables(parts)
        assert multiset(out) == multiset(data)
        rec = c.recovery()
        assert rec["replacements"] >= 1, rec
        assert rec["recomputed_maps"] >= 1, rec
        assert hosts.worker_pid(1) != old


def test_a_worker_that_does_not_come_back_fails_the_job_naming_it(hosts, tmp_path):
    files = certs(tmp_path, hosts)
    addresses = start(hosts, tmp_path, files)
    data = table(300_000)
    with connect(addresses, files, restart_wait=3, take_over=False) as c:
        result = c.shuffle(data, by="k", partitions=12, map_bytes="256KiB", strategy="pull")
        next(result)
        os.kill(hosts.worker_pid(2), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ShuffleError, match=r"no new worker process answered there"):
            list(result)
        assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("strategy", ["pull", "push"])
def test_a_worker_that_does_not_come_back_is_taken_over_by_a_survivor(
    hosts, tmp_path, tpch_data, strategy
):
    """No supervisor restarts the lost worker: after restart_wait a survivor serves its slot,
    lineage recomputes its maps there, and this job and the next end with the exact answer."""
    files = certs(tmp_path, hosts)
    addresses = start(hosts, tmp_path, files)
    data = table(300_000)
    with connect(addresses, files, restart_wait=2) as c:
        result = c.shuffle(data, by="k", partitions=12, map_bytes="256KiB", strategy=strategy)
        parts = [next(result)]
        lost = hosts.worker_pid(2)
        os.kill(lost, signal.SIGKILL)  # mid-read: 11 partitions to go
        parts += list(result)
        assert multiset(pa.concat_tables(parts)) == multiset(data)
        rec = c.recovery()
        # Pull recomputes the lost maps; push runs the shuffle again (every map pushed there).
        assert rec["replacements"] >= 1, rec
        assert rec["recomputed_maps" if strategy == "pull" else "rerun_jobs"] >= 1, rec
        # Nothing restarted it: a second worker process on host 0 serves its slot.
        assert hosts.worker_pids(2) == []
        assert len(hosts.worker_pids(0)) == 2 and len(hosts.worker_pids(1)) == 1
        # The next jobs run on the two processes left, three slots between them.
        out = pa.concat_tables(c.shuffle(data, by="k", partitions=12, strategy=strategy))
        assert multiset(out) == multiset(data)
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        con = tpch.duckdb_connect(tpch_data)
        sql, ordered = tpch.query(3, 0.1)
        assert tpch.compare(con.sql(sql).to_arrow_table(), c.sql(sql), ordered) is None
    # The driver that asked for the stand-in closed: it is told to exit.
    deadline = time.monotonic() + 20
    while len(hosts.worker_pids(0)) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(hosts.worker_pids(0)) == 1


def test_a_paused_worker_is_fenced_and_its_restart_takes_over(hosts, tmp_path):
    import threading

    files = certs(tmp_path, hosts)
    addresses = start(hosts, tmp_path, files, supervise=True)
    data = table(300_000)
    with connect(addresses, files, restart_wait=60, timeout=5) as c:
        result = c.shuffle(data, by="k", partitions=12, map_bytes="256KiB", strategy="pull")
        parts = [next(result)]
        paused = hosts.worker_pid(0)
        os.kill(paused, signal.SIGSTOP)
        # Resumed once the driver has given it up; it must not serve its old blocks again.
        resume = threading.Timer(12, os.kill, (paused, signal.SIGCONT))
        resume.start()
        try:
            parts += list(result)
        finally:
            resume.cancel()
            with contextlib.suppress(ProcessLookupError):  # fenced: gone already
                os.kill(paused, signal.SIGCONT)
        assert multiset(pa.concat_tables(parts)) == multiset(data)
        assert c.recovery()["replacements"] >= 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{paused}"):
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{paused}"), "the paused worker was not fenced"
