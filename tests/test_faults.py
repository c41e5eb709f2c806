"""Spill, corruption and worker loss, with real worker processes and real spill files."""

from __future__ import annotations

import glob
import os
import random
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
    # Three workers hold at most 3/8 of the data at the seal (every block is still there):
    # at least half of it must have gone to disk.
    assert sum(s["spilled_bytes"] for s in stats) >= size // 2, (size, stats)
    pids_gone(pids)


def test_corrupted_spill_byte_fails_with_a_checksum_error_naming_the_block(tmp_path):
    df = frame(50_000)
    with fs.Cluster(workers=2, memory_budget=0, spill_dir=str(tmp_path), timeout=60) as c:
        result = c.shuffle(df, by="key", partitions=4, map_bytes="512KiB")
        summary = result.wait_mapped()
        assert summary["rows"] == df.height
        # Under the cluster's own private directory inside spill_dir.
        assert os.path.dirname(c.spill_root) == str(tmp_path)
        files = sorted(glob.glob(os.path.join(c.spill_root, "worker-*", "*.seg")))
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


def kill_after_the_map_side(c: fs.Cluster, victims: list[int], **opts) -> tuple[dict, dict]:
    """Shuffle a 300k-row table, read its first partition, SIGKILL `victims`, read the rest:
    every key once, no partition twice. Returns the recovery counts before the kill and the
    map side's summary."""
    df = pa.table({"key": list(range(300_000)), "v": [i % 7 for i in range(300_000)]})
    result = c.shuffle(df, by="key", partitions=6, map_bytes="256KiB", **opts)
    mapped = result.wait_mapped()
    first = next(result)
    before = c.recovery()
    for victim in victims:
        os.kill(c.worker_pids[victim], signal.SIGKILL)
    parts = [first, *result]
    assert result.partition_ids == list(range(6)), "no partition twice"
    keys = sorted(k for p in parts for k in p["key"].to_pylist())
    assert keys == list(range(300_000))
    assert_keys_not_split([pl.from_arrow(p) for p in parts], ["key"])
    return before, mapped


@pytest.mark.parametrize(
    ("strategy", "seed"), [("pull", 1), ("merged", 2), ("push", 3), ("two-level", 4), ("auto", 5)]
)
def test_worker_killed_at_a_random_moment_is_replaced_and_the_shuffle_stays_exact(
    pids_gone, strategy, seed
):
    """SIGKILL one worker at a seeded random moment while a streamed input is being mapped:
    the worker is replaced, the driver replays the map inputs it kept, and the output is the
    input's multiset exactly. Then a worker killed after the map side: only its map outputs
    run again (pull, merged) and the partitions already read are not read twice."""
    rng = random.Random(seed)
    c = fs.Cluster(workers=3, timeout=60)
    pids = c.worker_pids
    victim = rng.randrange(3)
    replacements: list[int] = []
    try:
        result = c.shuffle(
            slow_reader(200, 20_000, 0.01),
            by="key",
            partitions=6,
            map_bytes="1MiB",
            strategy=strategy,
        )
        kill = threading.Timer(rng.uniform(0.2, 2.0), os.kill, (pids[victim], signal.SIGKILL))
        kill.start()
        ids = sorted(i for p in result for i in p["id"].to_pylist())
        assert ids == list(range(200 * 20_000)), "every row exactly once"
        kill.join()
        # The kill landed while the job ran (its input takes over 2 s to produce): the job
        # noticed and recovered it, not the next one.
        assert c.recovery()["replacements"] == 1, c.recovery()
        # After the map side: the next partitions need the lost worker's blocks.
        before, _ = kill_after_the_map_side(c, [rng.randrange(3)], strategy=strategy)
        after = c.recovery()
        assert after["replacements"] == before["replacements"] + 1
        if strategy in ("pull", "merged"):
            assert after["recomputed_maps"] > before["recomputed_maps"], after
        assert after["replacements"] == 2, after
        now = c.worker_pids
        assert now[victim] != pids[victim] and now[victim] > 0
        replacements = c.worker_pids
    finally:
        c.close()
    pids_gone(pids + replacements)


@pytest.mark.parametrize(("parity", "seed"), [(1, 11), (2, 12)])
def test_parity_rebuilds_a_killed_workers_blocks_without_running_maps_again(
    pids_gone, parity, seed
):
    """Cluster(parity=r): a worker SIGKILLed after the map side (and, with r = 2, a second
    one at the same time) loses its blocks; they are rebuilt from the survivors and the
    parity, no map runs again, and the output is the input's multiset exactly. Then a kill at
    a random moment of a streamed shuffle: still exact."""
    rng = random.Random(seed)
    c = fs.Cluster(workers=3, timeout=60, parity=parity)
    pids = c.worker_pids
    try:
        before, mapped = kill_after_the_map_side(c, rng.sample(range(3), parity))
        assert mapped["strategy_choice"].startswith(f"parity {parity}"), mapped
        after = c.recovery()
        assert after["rebuilt_blocks"] > before["rebuilt_blocks"], after
        assert after["recomputed_maps"] == before["recomputed_maps"], after
        # Killed while a slow input is mapped: committed outputs rebuilt, running maps rerun.
        result = c.shuffle(slow_reader(150, 20_000, 0.01), by="key", partitions=6, map_bytes="1MiB")
        kill = threading.Timer(rng.uniform(0.3, 1.5), os.kill, (c.worker_pids[0], signal.SIGKILL))
        kill.start()
        ids = sorted(i for p in result for i in p["id"].to_pylist())
        assert ids == list(range(150 * 20_000)), "every row exactly once"
        kill.join()
        replacements = c.worker_pids
    finally:
        c.close()
    pids_gone(pids + replacements)


def test_dropping_the_driver_stops_its_workers_and_leaves_no_spill_files(pids_gone, tmp_path):
    """A driver killed with SIGKILL mid-use: its workers exit and remove their spill
    directories, and the next local cluster sweeps the dead driver's spill root and the map
    inputs it kept on disk."""
    import subprocess
    import sys
    import tempfile

    script = (
        "import os\n"
        "os.environ['FLIGHTSHUFFLE_KEEP_MEMORY'] = '0'  # kept map inputs go to disk\n"
        "import flightshuffle as fs, sys, pyarrow as pa\n"
        "c = fs.Cluster(workers=2, memory_budget=0)\n"
        "t = pa.table({'k': list(range(20000)), 'v': ['x' * 50] * 20000})\n"
        "job = c.shuffle(t, by=['k'], partitions=4)\n"
        "next(iter(job))\n"
        "print(c.spill_root, flush=True)\n"
        "print(' '.join(map(str, c.worker_pids)), flush=True)\n"
        "print(os.getpid(), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    lines = out.stdout.split("\n")
    root, pids = lines[0], [int(p) for p in lines[1].split()]
    assert len(pids) == 2, out.stderr
    assert os.path.isdir(root), "the killed driver could not remove its own root"
    kept_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"flightshuffle-kept-{lines[2]}-*"))
    assert len(kept_dirs) == 1, kept_dirs
    kept = kept_dirs[0]
    assert glob.glob(os.path.join(kept, "*.arrow")), "map inputs kept on the driver's disk"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    pids_gone(pids)
    assert not glob.glob(os.path.join(root, "worker-*")), "workers left spill directories"
    with fs.Cluster(workers=1) as c:
        assert not os.path.exists(root), "the next cluster sweeps the dead driver's root"
        assert not os.path.exists(kept), "and the dead driver's kept map inputs"
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


@pytest.mark.parametrize("seed", [21, 22])
def test_dataset_pipeline_with_a_worker_killed_at_a_random_moment_matches_one_process(
    pids_gone, seed
):
    """A two-stage dataset pipeline (Polars map over Parquet splits, then a grouped
    aggregate) with one worker SIGKILLed at a seeded random moment: a stage that lost a worker
    while mapping runs again, a lost stage's outputs are recomputed from their splits, and the
    answer equals one process's."""
    from flightshuffle_bench import tpch

    data = os.environ.get(
        "FLIGHTSHUFFLE_TPCH_DATA",
        os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", "tpch-sf0.1"),
    )
    path = tpch.table_paths(tpch.ensure_data(0.1, data, progress=False))["lineitem"]
    keys = ["l_returnflag", "l_linestatus"]
    aggs = [pl.col("l_quantity").sum().alias("qty"), pl.len().alias("n")]

    def prep(df: pl.DataFrame) -> pl.DataFrame:
        return df.filter(pl.col("l_quantity") > 5)

    want = prep(pl.read_parquet(path)).group_by(keys).agg(aggs).sort(keys)
    rng = random.Random(seed)
    c = fs.Cluster(workers=3, timeout=60)
    pids = c.worker_pids

    def run() -> None:
        got = c.read_parquet(path).map_partitions(prep).group_by(keys).agg(aggs).to_polars()
        assert got.sort(keys).equals(want.cast(got.schema)), got

    try:
        started = time.monotonic()
        run()
        took = time.monotonic() - started
        # Killed during a run: a kill that lands after it (noticed by no one yet) does not
        # count, and the next try kills earlier.
        landed = False
        for tries in range(4):
            before = c.recovery()["replacements"]
            victim = c.worker_pids[rng.randrange(3)]
            delay = rng.uniform(0.1, 0.6) * took / (tries + 1)
            kill = threading.Timer(delay, os.kill, (victim, signal.SIGKILL))
            kill.start()
            run()
            kill.join()
            if c.recovery()["replacements"] > before:
                landed = True
                break
            run()  # the late kill is noticed here, and the answer is still exact
        assert landed, "no kill landed during a run"
        replacements = c.worker_pids
    finally:
        c.close()
    pids_gone(pids + replacements)


def test_a_worker_paused_during_a_shuffle_is_replaced_and_nothing_stale_is_read(pids_gone):
    """SIGSTOP a worker while a shuffle maps, for longer than the health timeout (10 s), then
    SIGCONT: the driver declares it lost and kills it (it cannot come back with stale
    attempts), its maps run again, and the output is the input exactly."""
    import contextlib

    from conftest import alive

    c = fs.Cluster(workers=3, timeout=60)
    pids = c.worker_pids
    replacements: list[int] = []

    def pause_then_resume() -> None:
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(13)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)

    try:
        result = c.shuffle(slow_reader(200, 20_000, 0.01), by="key", partitions=6, map_bytes="1MiB")
        pauser = threading.Timer(0.5, pause_then_resume)
        pauser.start()
        ids = sorted(i for p in result for i in p["id"].to_pylist())
        pauser.join()
        assert ids == list(range(200 * 20_000)), "every row exactly once"
        replacements = c.worker_pids
        assert replacements[1] != pids[1]
        assert not alive(pids[1]), "the paused worker was killed, not left to come back"
        assert c.recovery()["replacements"] == 1
    finally:
        c.close()
    pids_gone(pids + replacements)


def test_parity_settings_are_checked():
    with pytest.raises(ValueError, match="parity=1 needs at least 2 workers"):
        fs.Cluster(workers=1, parity=1)
    with pytest.raises(ValueError, match="parity must be 0, 1 or 2"):
        fs.Cluster(workers=3, parity=3)
    with fs.Cluster(workers=2) as c:
        table = pa.table({"k": [1, 2, 3]})
        with pytest.raises(ValueError, match="at most 2 parity"):
            c.shuffle(table, by="k", partitions=2, parity=3)
        with pytest.raises(ValueError, match="parity=2 needs at least 3 workers"):
            c.shuffle(table, by="k", partitions=2, parity=2)


def test_a_full_spill_disk_is_a_clear_error_frees_its_space_and_the_next_job_works(tmp_path):
    """Spill directories on an 8 MiB tmpfs, a shuffle that must spill more than that: a clear
    error naming the full disk, no partition handed out, the space freed once the shuffle is
    closed, and the next (smaller) shuffle on the same cluster is exact."""
    import shutil
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        check=False,
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        df = frame(400_000)
        with fs.Cluster(workers=2, memory_budget="1MiB", spill_dir=str(mnt), timeout=60) as c:
            result = c.shuffle(df, by="key", partitions=4, map_bytes="1MiB")
            handed = []
            with pytest.raises(fs.ShuffleError, match="(?i)no space|full") as err:
                handed.extend(result)
            assert handed == [], "nothing partial is returned"
            result.close()
            time.sleep(0.5)
            used = shutil.disk_usage(mnt).used
            assert used < 1 << 20, f"{used} bytes still used after the failed shuffle closed"
            small = frame(20_000)
            parts = [pl.from_arrow(p) for p in c.shuffle(small, by="key", partitions=4)]
            assert_same_multiset(small, parts)
        assert "No space left on device" in str(err.value), err.value
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
