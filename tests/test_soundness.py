"""Failure paths that once lost or mixed rows without an error (issue 35): a lost worker that
held pushed blocks but ran no map, two clusters sharing a ``spill_dir``, and the modes of the
files a cluster writes. Real worker processes, real kills, exact multisets."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import flightshuffle as fs
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import alive


def table(n: int) -> pa.Table:
    ids = pa.array(range(n), pa.int64())
    return pa.table(
        {
            "id": ids,
            "k": pc.bit_wise_and(ids, 1023),
            "x": pc.multiply(pc.cast(ids, pa.float64()), 0.5),
            "s": pa.array([f"row-{i % 977}" for i in range(n)]),
        }
    )


def wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(pid), f"worker {pid} survived SIGKILL"


# Under push every partition p is held by worker p % 4; under two-level by the worker in the
# mapper's grid row and p's column (mapper 0: workers 0 and 1). With one map (on worker 0),
# workers 1 and 3 ran no map; under push both hold blocks, under two-level worker 1 does.
CASES = [
    ("push", 0, 3),
    ("push", 0, 1),
    ("two-level", 0, 1),
    ("merged", 0, 3),
    ("pull", 0, 3),
    ("auto", 0, 3),
    ("push", 1, 3),
    ("two-level", 1, 1),
]


@pytest.mark.parametrize(("strategy", "parity", "victim"), CASES)
def test_losing_a_holder_that_ran_no_map_keeps_every_row(pids_gone, strategy, parity, victim):
    """One map task (M = 1 < N = 4) runs on worker 0 and leaves blocks on the partitions'
    holders; SIGKILL a holder that ran no map after the map side, before its partitions are
    read: every row comes back exactly once (the loss is recovered, never a short answer)."""
    n = 400_000
    t = table(n)
    c = fs.Cluster(workers=4, timeout=60, parity=parity, strategy=strategy)
    pids = c.worker_pids
    replacements: list[int] = []
    try:
        before = c.recovery()
        result = c.shuffle(t, by="k", partitions=8, map_bytes="1GiB")
        mapped = result.wait_mapped()
        assert mapped["maps"] == 1, mapped
        os.kill(pids[victim], signal.SIGKILL)
        wait_dead(pids[victim])
        parts = list(result)
        after = c.recovery()
        replacements = c.worker_pids
    finally:
        c.close()
    pids_gone(pids + replacements)
    got = pa.concat_tables(parts)
    assert [p.num_rows for p in parts].count(0) == 0, [p.num_rows for p in parts]
    assert got.num_rows == n, f"{got.num_rows} of {n} rows"
    assert sorted(got["id"].to_pylist()) == list(range(n)), "every row exactly once"
    assert pc.sum(got["x"]).as_py() == pc.sum(t["x"]).as_py()
    # The kill landed during the job: a replacement was started for it.
    assert after["replacements"] == before["replacements"] + 1, after


def sql_sums(spill_dir: str, seed: int, out: list, errors: list) -> None:
    try:
        with fs.Cluster(workers=2, spill_dir=spill_dir, timeout=60) as c:
            for i in range(4):
                base = seed * 1_000_000 + i * 1000
                t = pa.table({"x": pa.array(range(base, base + 500 + seed), pa.int64())})
                got = c.sql("SELECT sum(x) AS s, count(*) AS n FROM t", tables={"t": t})
                expected = (pc.sum(t["x"]).as_py(), t.num_rows)
                out.append(((got["s"][0].as_py(), got["n"][0].as_py()), expected))
    except Exception as e:  # noqa: BLE001 (reported by the test thread)
        errors.append(e)


def test_two_clusters_sharing_a_spill_dir_see_their_own_tables_and_leave_nothing(tmp_path):
    """Two clusters at once with the same ``spill_dir``: each answers over its own tables,
    and once both closed nothing of theirs is left in the directory."""
    d = str(tmp_path)
    results: list[list] = [[], []]
    errors: list[Exception] = []
    threads = [threading.Thread(target=sql_sums, args=(d, s, results[s], errors)) for s in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not errors, errors
    for r in results:
        assert len(r) == 4
        for got, expected in r:
            assert got == expected
    assert os.listdir(d) == [], os.listdir(d)


def modes(root: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    dirs, files = [], []
    for here, ds, fs_ in os.walk(root):
        for names, into in ((ds, dirs), (fs_, files)):
            for x in names:
                path = os.path.join(here, x)
                into.append((path, stat.S_IMODE(os.stat(path).st_mode)))
    return dirs, files


def test_spill_files_and_directories_are_private(tmp_path):
    """Everything a cluster writes under ``spill_dir`` (its root, the workers' directories,
    spill segments, datasets) is readable by its user only: directories 0700, files 0600."""
    t = table(200_000)
    with fs.Cluster(workers=2, memory_budget=0, spill_dir=str(tmp_path), timeout=60) as c:
        result = c.shuffle(t, by="k", partitions=4, map_bytes="512KiB")
        result.wait_mapped()
        counted = c.sql("SELECT count(*) AS n FROM t", tables={"t": t})
        assert counted["n"][0].as_py() == t.num_rows
        root = c.spill_root
        assert root and os.path.dirname(os.path.abspath(root)) == str(tmp_path), root
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        dirs, files = modes(root)
        assert any(p.endswith(".seg") for p, _ in files), files
        assert any(p.endswith(".parquet") for p, _ in files), files
        assert all(m == 0o700 for _, m in dirs), dirs
        assert all(m & 0o077 == 0 for _, m in files), files
        list(result)
    assert os.listdir(tmp_path) == []


def test_a_cancelled_python_task_holds_its_grant_until_its_body_stops_and_skips_what_is_left(
    tmp_path,
):
    """Ctrl-C while a dataset map's Python body runs (its first operator sleeps 4 s): the task
    is aborted, but its memory grant stays held while the body still runs, and the body stops
    at its next operator (the second never runs); then the grant comes back. Before: the
    grant came back at the abort and the second operator ran."""
    import polars as pl
    import pyarrow.parquet as pq

    path = str(tmp_path / "t.parquet")
    pq.write_table(table(1_000), path)
    marker = tmp_path / "second-operator-ran"
    marker_path = str(marker)

    # Both run once on the driver on an empty frame (to learn the output schema): only a
    # partition with rows sleeps or leaves the marker.
    def slow(df: pl.DataFrame) -> pl.DataFrame:
        if df.height:
            time.sleep(5)
        return df

    def second(df: pl.DataFrame) -> pl.DataFrame:
        if df.height:
            with open(marker_path, "w") as f:
                f.write("ran")
        return df

    with fs.Cluster(workers=1, timeout=60) as c:
        ds = c.read_parquet(path).map_partitions(slow).map_partitions(second)
        threading.Timer(2.0, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            ds.to_polars()
        # The call went away, so the worker aborted the task: its body is still sleeping.
        time.sleep(0.5)
        held = c.stats()[0]
        assert held["running_tasks"] >= 1 and held["granted_bytes"] > 0, held
        deadline = time.monotonic() + 20
        while c.stats()[0]["running_tasks"] > 0:
            assert time.monotonic() < deadline, "the grant never came back"
            time.sleep(0.2)
        assert c.stats()[0]["granted_bytes"] == 0
        time.sleep(0.5)
        assert not marker.exists(), "the body went on to its next operator after the cancel"
