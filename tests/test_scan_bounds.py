"""Broadcast joins' scans, distributed. The build side's key bounds reach the scans of its
probe side in the same stage (``BuildBoundsExec``, placed by each worker): the scans skip the
row groups no key can meet. And a build side that only reads a table's columns is read by each
worker from the files, not cut into a stage.

The proof is a file whose row groups outside the keys' range are corrupted after DuckDB has
answered over the intact copy: a worker that read one of them would fail. The joins whose
probe rows must all be kept, or whose NULLs are equal, get no bounds, and are checked over the
intact file."""

from __future__ import annotations

import datetime
import re

import duckdb
import flightshuffle as fs
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flightshuffle_bench import tpch

ROWS, GROUP = 200_000, 10_000


def big_table() -> pa.Table:
    """Keys 0..199,989 in order then 10 NULLs, 20 row groups; a date and a string column in the
    same order."""
    k = pa.array([i if i < ROWS - 10 else None for i in range(ROWS)], pa.int64())
    day0 = datetime.date(2000, 1, 1)
    return pa.table(
        {
            "k": k,
            "d": pa.array([day0 + datetime.timedelta(days=i // 100) for i in range(ROWS)]),
            "s": pa.array([f"key{i:07d}" for i in range(ROWS)]),
            "v": pa.array([i % 7 for i in range(ROWS)], pa.int64()),
        }
    )


def corrupt_row_groups(path, keep: set[int]) -> None:
    """Overwrite the column chunks of every row group not in ``keep`` with 0xFF bytes; the
    footer (and its statistics) stays intact."""
    meta = pq.ParquetFile(path).metadata
    spans = []
    for g in range(meta.num_row_groups):
        if g in keep:
            continue
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            spans.append((start, col.total_compressed_size))
    with open(path, "r+b") as f:
        for start, size in spans:
            f.seek(start)
            f.write(b"\xff" * size)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounds")
    pq.write_table(big_table(), d / "big.parquet", row_group_size=GROUP, compression="none")
    # Keys in row groups 3 and 4 only (30,000..49,999), with a duplicate and a NULL.
    keys = [30_005, 31_000, 31_000, 49_999, None, 42_424]
    small = pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "d": pa.array(
                [
                    None if x is None else datetime.date(2000, 1, 1) + datetime.timedelta(x // 100)
                    for x in keys
                ]
            ),
            "s": pa.array([None if x is None else f"key{x:07d}" for x in keys]),
            # Not in `big`, and never NULL (a REQUIRED column): NOT IN may be null-aware.
            "w": pa.array([300_000 + i for i in range(len(keys))], pa.int64()),
        },
    )
    small = small.cast(small.schema.set(3, pa.field("w", pa.int64(), nullable=False)))
    pq.write_table(small, d / "small.parquet")
    pq.write_table(small.filter(pa.compute.is_null(small["k"])), d / "nulls.parquet")
    return d


JOINS = {
    "inner": "SELECT a.w, b.k, b.v FROM small a JOIN big b ON a.k = b.k",
    "date_key": "SELECT a.w, count(*) AS n, sum(b.v) AS v FROM small a JOIN big b ON a.d = b.d "
    "GROUP BY a.w",
    "string_key": "SELECT a.w, b.k FROM small a JOIN big b ON a.s = b.s",
    "two_keys": "SELECT a.w, b.k FROM small a JOIN big b ON a.k = b.k AND a.s = b.s",
    "exists": "SELECT a.w FROM small a WHERE EXISTS (SELECT 1 FROM big b WHERE b.k = a.k)",
    "not_exists": "SELECT a.w FROM small a WHERE NOT EXISTS "
    "(SELECT 1 FROM big b WHERE b.k = a.k AND b.v > 3)",
    "left": "SELECT a.w, b.v FROM small a LEFT JOIN big b ON a.k = b.k AND b.v < 3",
}
# Every probe row (of `big`) must be read: no bounds, so these are checked on the intact file.
WHOLE = {
    "right": "SELECT count(*) AS n, count(a.w) AS m FROM small a RIGHT JOIN big b ON a.k = b.k",
    "null_equal": "SELECT a.w, b.k FROM small a JOIN big b ON a.k IS NOT DISTINCT FROM b.k",
    # `big`'s NULL keys (row group 19, outside any bounds of `w`) empty the answer.
    "not_in": "SELECT a.w FROM small a WHERE a.w NOT IN (SELECT b.k FROM big b)",
}


def test_a_broadcast_joins_probe_scan_skips_the_row_groups_its_keys_cannot_meet(files):
    con = duckdb.connect()
    for t in ["big", "small", "nulls"]:
        con.execute(f"CREATE TABLE {t} AS SELECT * FROM '{files}/{t}.parquet'")
    want = {name: con.sql(sql).to_arrow_table() for name, sql in (JOINS | WHOLE).items()}
    # No build key can match (the Rust tests check that a join reading its probe side then
    # reads no row group; here the planner's semi join skips the probe side altogether).
    unmatched = "SELECT count(*) AS n, count(b.v) AS m FROM nulls a LEFT JOIN big b ON a.k = b.k"
    with fs.Cluster(workers=2, small_query_rows=0) as c:
        for t in ["big", "small", "nulls"]:
            c.register_parquet(t, str(files / f"{t}.parquet"))
        plan = c.explain(JOINS["inner"])
        assert "mode=CollectLeft" in plan and "Stage 1" in plan, plan
        for name, sql in (JOINS | WHOLE).items():
            diff = tpch.compare(want[name], c.sql(sql), ordered=False)
            assert diff is None, f"{name} (intact file): {diff}"
        corrupt_row_groups(files / "big.parquet", keep={3, 4})
        with pytest.raises(fs.ShuffleError, match="Parquet"):
            c.sql("SELECT sum(v) FROM big")
        # Without the bounds, each join reads a corrupted row group.
        c.sql("SET flightshuffle.build_bounds = false")
        for name, sql in JOINS.items():
            with pytest.raises(fs.ShuffleError, match="Parquet"):
                c.sql(sql)
        c.sql("SET flightshuffle.build_bounds = true")
        for name, sql in JOINS.items():
            diff = tpch.compare(want[name], c.sql(sql), ordered=False)
            assert diff is None, f"{name}: {diff}"
        assert c.sql(unmatched).to_pylist() == [{"n": 1, "m": 0}]


def test_a_broadcast_build_side_that_is_a_plain_scan_is_read_by_each_worker(tmp_path):
    """A build side that only reads columns of a table (here 200,000 rows, over the 128 Ki rows
    of a small gather) is read by each worker from the files rather than cut into a stage
    (``plain_build_rows``); with the setting at 0, or a build side that computes or filters,
    it is a stage. Answers equal DuckDB's."""
    n, m = 2_000_000, 200_000
    pq.write_table(
        pa.table({"k": pa.array([i % 300_000 for i in range(n)], pa.int64()), "v": range(n)}),
        tmp_path / "f.parquet",
    )
    pq.write_table(
        pa.table({"k": pa.array(range(0, 2 * m, 2), pa.int64()), "x": range(m)}),
        tmp_path / "d.parquet",
    )
    sql = "SELECT count(*) AS n, sum(f.v) AS v, sum(d.x) AS x FROM f JOIN d ON f.k = d.k"
    con = duckdb.connect()
    want = con.sql(
        sql.replace("FROM f", f"FROM '{tmp_path}/f.parquet' f").replace(
            "JOIN d", f"JOIN '{tmp_path}/d.parquet' d"
        )
    ).to_arrow_table()
    with fs.Cluster(workers=2, small_query_rows=0) as c:
        c.register_parquet("f", str(tmp_path / "f.parquet"))
        c.register_parquet("d", str(tmp_path / "d.parquet"))
        for rows, stage in [("0", True), ("8388608", False)]:
            c.sql(f"SET flightshuffle.plain_build_rows = {rows}")
            plan = c.explain(sql)
            assert "mode=CollectLeft" in plan, plan
            blocks = re.split(r"\n(?=Stage |Driver)", plan)
            alone = [b for b in blocks if "d.parquet" in b and "f.parquet" not in b]
            assert bool(alone) == stage, plan
            assert tpch.compare(want, c.sql(sql), ordered=False) is None, rows
        # A build side that computes a value (one random() per row must be one for every
        # worker) or filters rows stays a stage of its own.
        for query in [
            "SELECT count(*), sum(d.r) FROM f JOIN (SELECT k, random() AS r FROM d) d ON f.k = d.k",
            sql.replace("JOIN d", "JOIN (SELECT k, x FROM d WHERE x % 3 > 0) d"),
        ]:
            plan = c.explain(query)
            blocks = re.split(r"\n(?=Stage |Driver)", plan)
            assert [b for b in blocks if "d.parquet" in b and "f.parquet" not in b], plan


def test_a_small_build_side_with_exchanges_is_computed_by_each_worker(tmp_path):
    """A build side that aggregates a small table (a correlated scalar subquery's average
    per key, TPC-DS q06's shape) is computed whole by each worker, its repartition inside,
    instead of two stages (``small_build_stages_in_place``); off, it is staged. With a
    volatile value it stays staged (each worker would draw its own). Answers equal DuckDB's,
    over NULL keys and keys the small table lacks."""
    n, m = 400_000, 5_000
    facts = pa.table(
        {
            "k": pa.array([i % 700 if i % 97 else None for i in range(n)], pa.int64()),
            "v": [float(i % 1000) for i in range(n)],
        }
    )
    (tmp_path / "f").mkdir()
    for i in range(4):  # a partition each: the fact side is a stage
        pq.write_table(facts.slice(i * n // 4, n // 4), tmp_path / "f" / f"{i}.parquet")
    pq.write_table(
        pa.table({"k": pa.array([i % 600 for i in range(m)], pa.int64()), "p": range(m)}),
        tmp_path / "d.parquet",
    )
    sql = (
        "SELECT count(*) AS n, sum(f.v) AS s FROM f WHERE f.v > "
        "(SELECT avg(d.p) / 10 FROM d WHERE d.k = f.k)"
    )
    con = duckdb.connect()
    con.sql(f"CREATE VIEW f AS SELECT * FROM '{tmp_path}/f/*.parquet'")
    con.sql(f"CREATE VIEW d AS SELECT * FROM '{tmp_path}/d.parquet'")
    want = con.sql(sql).to_arrow_table()
    with fs.Cluster(workers=2, small_query_rows=0) as c:
        c.register_parquet("f", str(tmp_path / "f"))
        c.register_parquet("d", str(tmp_path / "d.parquet"))
        stages = {}
        for on in ("false", "true"):
            c.sql(f"SET flightshuffle.small_build_stages_in_place = {on}")
            plan = c.explain(sql)
            stages[on] = plan.count("\nStage ") + plan.startswith("Stage ")
            assert tpch.compare(want, c.sql(sql), ordered=False) is None, on
        assert stages["true"] < stages["false"], stages
        volatile = sql.replace("avg(d.p) / 10", "avg(d.p) / 10 + random() * 0")
        plan = c.explain(volatile)
        assert plan.count("\nStage ") + plan.startswith("Stage ") == stages["false"], plan
