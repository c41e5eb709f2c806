"""Spill, corruption and worker loss, with real worker processes and real spill files."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import flightshuffle as fs
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import assert_keys_not_split, assert_same_multiset


def frame(n: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": list(range(n)),
            "key": [i % 1009 for i in range(n)],
            "payload": [f"payload-{i:09d}-{'x' * (i % 17)}" for i in range(n)],
        }
    )


def test_budget_of_an_eighth_spills_and_keeps_the_multiset(pids_gone):
    df = frame(300_000)
    size = df.to_arrow().nbytes
    with fs.Cluster(workers=3, memory_budget=size // 8, timeout=60) as c:
        parts = [pl.from_arrow(p) for p in c.shuffle(df, by="key", partitions=6, map_bytes="1MiB")]
        stats = c.stats()
        pids = c.worker_pids
    assert_same_multiset(df, parts)
    assert_keys_not_split(parts, ["key"])
    assert sum(s["spilled_bytes"] for s in stats) > 0
    assert sum(s["spill_files"] for s in stats) > 0
    assert all(s["memory_bytes"] <= size // 8 for s in stats)
    pids_gone(pids)


def test_corrupted_spill_byte_fails_with_a_checksum_error_naming_the_block(tmp_path):
    df = frame(50_000)
    with fs.Cluster(workers=2, memory_budget=0, spill_dir=str(tmp_path), timeout=60) as c:
        result = c.shuffle(df, by="key", partitions=4, map_bytes="512KiB")
        summary = result.wait_mapped()
        assert summary["rows"] == df.height
        files = sorted(glob.glob(str(tmp_path / "worker-*" / "*.seg")))
        assert files, "a zero budget must spill every block"
        # Partitions are read back in order as soon as the map side is done, the first ones
        # before this loop runs: flip a byte in every 32 KiB of each file (not only near its
        # start), so the blocks of the partitions still to be read are corrupted too.
        for f in files:
            size = os.path.getsize(f)
            with open(f, "r+b") as fh:
                for offset in range(100, max(101, size - 4096), 32 << 10):
                    fh.seek(offset)
                    byte = fh.read(1)
                    fh.seek(offset)
                    fh.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(
            fs.ChecksumError, match=r"checksum mismatch for block shuffle=\w+ map=\d+ partition=\d+"
        ):
            list(result)


def slow_reader(batches: int, rows: int, delay: float) -> pa.RecordBatchReader:
    schema = pa.schema([("id", pa.int64()), ("key", pa.int64())])

    def gen():
        for b in range(batches):
            ids = pa.array(range(b * rows, (b + 1) * rows), pa.int64())
            yield pa.record_batch([ids, pc.bit_wise_and(ids, 255)], schema=schema)
            time.sleep(delay)

    return pa.RecordBatchReader.from_batches(schema, gen())


@pytest.mark.parametrize("strategy", ["pull", "push", "two-level"])
def test_killed_worker_fails_within_30s_naming_it_and_is_replaced(pids_gone, strategy):
    c = fs.Cluster(workers=3, timeout=60)
    pids = c.worker_pids
    addresses = c.worker_addresses
    victim = 1
    replacements: list[int] = []
    try:
        # With push, the failure first shows on a worker pushing to the victim: the driver
        # still names the victim.
        result = c.shuffle(
            slow_reader(400, 20_000, 0.02),
            by="key",
            partitions=6,
            map_bytes="1MiB",
            strategy=strategy,
        )
        threading.Timer(1.0, os.kill, args=(pids[victim], signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(fs.WorkerLostError) as err:
            list(result)
        assert time.monotonic() - start < 30
        msg = str(err.value)
        assert f"worker {victim} ({addresses[victim]}) lost" in msg
        # The cluster keeps working: the lost worker's slot gets a new process, and the next
        # shuffle (which waits for it) is exact.
        df = pa.table({"key": list(range(50_000)), "v": [i % 7 for i in range(50_000)]})
        parts = list(c.shuffle(df, by="key", partitions=6, strategy=strategy))
        assert sum(p.num_rows for p in parts) == 50_000
        assert sorted(k for p in parts for k in p["key"].to_pylist()) == list(range(50_000))
        now = c.worker_pids
        assert now[victim] != pids[victim] and now[victim] > 0
        assert [now[i] for i in (0, 2)] == [pids[i] for i in (0, 2)]
        replacements = now
    finally:
        c.close()
    pids_gone(pids + replacements)


def test_dropping_the_driver_stops_its_workers_and_leaves_no_spill_files(pids_gone, tmp_path):
    """A driver killed with SIGKILL mid-use: its workers exit and remove their spill
    directories, and the next local cluster sweeps the dead driver's spill root."""
    import subprocess
    import sys

    script = (
        "import flightshuffle as fs, os, sys, pyarrow as pa\n"
        "c = fs.Cluster(workers=2, memory_budget=0)\n"
        "t = pa.table({'k': list(range(20000)), 'v': ['x' * 50] * 20000})\n"
        "job = c.shuffle(t, by=['k'], partitions=4)\n"
        "next(iter(job))\n"
        "print(c.spill_root, flush=True)\n"
        "print(' '.join(map(str, c.worker_pids)), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    lines = out.stdout.split("\n")
    root, pids = lines[0], [int(p) for p in lines[1].split()]
    assert len(pids) == 2, out.stderr
    assert os.path.isdir(root), "the killed driver could not remove its own root"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    pids_gone(pids)
    assert not glob.glob(os.path.join(root, "worker-*")), "workers left spill directories"
    with fs.Cluster(workers=1) as c:
        assert not os.path.exists(root), "the next cluster sweeps the dead driver's root"
        assert os.path.isdir(c.spill_root)


def test_dropping_an_unfinished_shuffle_after_close_does_not_hang():
    """The last owner of the driver runtime may be freed by the garbage collector while a
    reader thread waits for the GIL inside a Python data source: freeing must not wait for it.
    Run in a subprocess so a regression fails by timeout instead of hanging the suite."""
    import subprocess
    import sys

    script = (
        "import gc, time, pyarrow as pa, flightshuffle as fs\n"
        "schema = pa.schema([('id', pa.int64()), ('key', pa.int64())])\n"
        "def gen():\n"
        "    for b in range(400):\n"
        "        ids = pa.array(range(b * 1000, (b + 1) * 1000), pa.int64())\n"
        "        yield pa.record_batch([ids, ids], schema=schema)\n"
        "        time.sleep(0.02)\n"
        "c = fs.Cluster(workers=2)\n"
        "r = c.shuffle(pa.RecordBatchReader.from_batches(schema, gen()), by='key', partitions=2)\n"
        "time.sleep(0.5)\n"
        "c.close()\n"
        "del r, c\n"
        "gc.collect()\n"
        "print('freed')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert "freed" in out.stdout, out.stderr[-2000:]


def test_speculation_setting_runs_sql_and_shuffles_and_checks_its_value(tmp_path):
    """Speculative execution is exercised with a real straggler in the Rust cluster tests;
    here the Python setting reaches SQL and shuffles without changing their answers."""
    df = frame(50_000)
    path = tmp_path / "t.parquet"
    df.write_parquet(path, row_group_size=5_000)
    with pytest.raises(ValueError, match="speculation"):
        fs.Cluster(workers=1, speculation=0.5)
    with fs.Cluster(workers=2, speculation=1.5) as c:
        got = pl.from_arrow(
            c.sql(
                "SELECT key, count(*) AS n FROM t GROUP BY key ORDER BY key",
                tables={"t": str(path)},
            )
        )
        want = df.group_by("key").agg(pl.len().alias("n")).sort("key")
        assert got.cast({"n": pl.UInt32}).equals(want.cast({"n": pl.UInt32}))
        parts = list(c.shuffle(df, by="key", partitions=3, output="polars"))
        assert_same_multiset(df, parts)


def test_ctrl_c_interrupts_a_blocking_call_within_a_second_and_the_cluster_goes_on():
    """SIGINT (Ctrl-C) while Python waits for a shuffle's first partition (the maps read a slow
    source for ~8 s): KeyboardInterrupt within about a second; the next shuffle is exact."""
    with fs.Cluster(workers=2, timeout=60) as c:
        result = c.shuffle(slow_reader(400, 1_000, 0.02), by="key", partitions=4, map_bytes="1MiB")
        threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            next(iter(result))
        waited = time.monotonic() - start
        assert waited < 2.0, waited
        result.close()
        df = pa.table({"key": list(range(10_000)), "v": list(range(10_000))})
        parts = list(c.shuffle(df, by="key", partitions=4))
        assert sorted(k for p in parts for k in p["key"].to_pylist()) == list(range(10_000))
