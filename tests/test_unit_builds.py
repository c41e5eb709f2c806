"""Online aggregation reads a build side stored in the order of its join key with the sampled
table per sampling unit: only the pages whose key statistics meet the unit's
(``flightshuffle.unit_builds``). Real workers, real Parquet files with small pages and a page
index; every final answer equals DuckDB's, on tables stored in key order (cut per unit), in a
random order (read whole), with NULL keys, duplicate keys across pages, keys missing on
either side, a build side computed in place and one cut into a stage, string keys over
several files, and a build side without a page index (row-group statistics)."""

from __future__ import annotations

import os

import duckdb
import flightshuffle as fs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flightshuffle.estimates import value_columns
from flightshuffle_bench import tpch

FACT_ROWS = 400_000
DIM_ROWS = 10_000


def write(table: pa.Table, path, row_group_size: int, page_rows: int) -> str:
    """Pages of about `page_rows` rows (plain, 8-byte keys), with a page index."""
    pq.write_table(
        table,
        path,
        row_group_size=row_group_size,
        use_dictionary=False,
        data_page_size=page_rows * 8,
        write_batch_size=page_rows,
        write_page_index=True,
    )
    return str(path)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """`fact` (sorted by k, duplicates across pages, 1% NULL keys, keys past dim's end) and
    `dim` (sorted by k, every third key missing, NULL keys at its end), each also in a
    random order."""
    root = tmp_path_factory.mktemp("unit_builds")
    rng = np.random.default_rng(7)
    k = np.sort(rng.integers(0, DIM_ROWS * 3 // 2 + 500, FACT_ROWS))
    fact_k = pa.array(k, mask=rng.random(FACT_ROWS) < 0.01)
    fact = pa.table({"k": fact_k, "v": rng.integers(0, 1000, FACT_ROWS)})
    dk = np.arange(DIM_ROWS * 3 // 2)
    dk = dk[dk % 3 != 1]
    n = len(dk) + 300
    dim_k = pa.array(
        np.concatenate([dk, np.zeros(300, dtype=dk.dtype)]), mask=np.arange(n) >= len(dk)
    )
    dim = pa.table({"k": dim_k, "g": np.arange(n) % 7, "x": (np.arange(n) * 37) % 100})
    out = {}
    for name, t, rg, page in (("fact", fact, 100_000, 16), ("dim", dim, 20_000, 4)):
        out[name] = write(t, root / f"{name}.parquet", rg, page)
        shuffled = t.take(rng.permutation(t.num_rows))
        out[f"{name}_random"] = write(shuffled, root / f"{name}_random.parquet", rg, page)
    return out


@pytest.fixture(scope="module")
def cluster():
    with fs.Cluster(workers=2) as c:
        yield c


def exact(cluster, query: str, tables: dict[str, str]) -> None:
    """The online query's final answer equals DuckDB's."""
    results = list(cluster.online(query, rounds=3, seed=5, tables=tables, progress=False))
    assert results[-1].final
    got = results[-1].estimates
    got = got.select(value_columns(got.columns)).to_arrow()
    con = duckdb.connect()
    for name, path in tables.items():
        files = f"{path}/*.parquet" if os.path.isdir(path) else path
        con.sql(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{files}')")
    want = con.sql(query).to_arrow_table()
    problem = tpch.compare(want, got, ordered=True)
    assert problem is None, problem


def exact_without_unit_builds(cluster, query: str, tables: dict[str, str]) -> str:
    """:func:`exact` with `flightshuffle.unit_builds` off; the plan it ran."""
    cluster.sql("SET flightshuffle.unit_builds = false")
    try:
        exact(cluster, query, tables)
        return cluster.last_online_plan
    finally:
        cluster.sql("SET flightshuffle.unit_builds = true")


def cut(cluster) -> bool:
    """The last online query read a build side per unit (a partitioned join of the units)."""
    return "HashJoinExec: mode=Partitioned" in cluster.last_online_plan


INNER = """SELECT d.g, SUM(f.v) AS s, COUNT(*) AS n FROM fact f JOIN dim d ON f.k = d.k
WHERE d.x < 60 GROUP BY d.g ORDER BY d.g"""
PLAIN = """SELECT d.g, SUM(f.v) AS s, COUNT(*) AS n FROM fact f JOIN dim d ON f.k = d.k
GROUP BY d.g ORDER BY d.g"""
NARROW = """SELECT d.g, SUM(f.v) AS s, COUNT(*) AS n FROM fact f JOIN dim d ON f.k = d.k
WHERE d.k BETWEEN 2000 AND 2100 GROUP BY d.g ORDER BY d.g"""


@pytest.mark.parametrize("query", [INNER, PLAIN, NARROW], ids=["filtered", "plain", "narrow"])
def test_a_build_side_in_key_order_is_read_per_unit_and_exact(cluster, tables, query):
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    exact(cluster, query, t)
    assert cut(cluster), cluster.last_online_plan
    # dim is read in parts too, one per unit.
    assert cluster.last_online_plan.count("SplitScanExec:") == 2
    cluster.sql("SET flightshuffle.unit_builds = false")
    try:
        exact(cluster, query, t)
        assert not cut(cluster)
        assert cluster.last_online_plan.count("SplitScanExec:") == 1
    finally:
        cluster.sql("SET flightshuffle.unit_builds = true")


@pytest.mark.parametrize("which", ["fact_random", "dim_random"])
def test_a_table_in_random_order_keeps_its_build_side_whole(cluster, tables, which):
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    t[which.removesuffix("_random")] = tables[which]
    exact(cluster, INNER, t)
    assert not cut(cluster), cluster.last_online_plan


def test_the_units_read_few_pages_of_the_build_side(cluster, tables):
    """The build side's parts read about its rows once, not once per unit."""
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    exact(cluster, INNER, t)
    plan = cluster.last_online_plan
    scans = [line for line in plan.splitlines() if "SplitScanExec:" in line]
    assert len(scans) == 2, plan
    dim_scan = next(s for s in scans if "the rows each split can meet" in s)
    assert "dim.parquet" in dim_scan
    rows = int(dim_scan.split(" rows in ")[0].split()[-1])
    dim_rows = pq.ParquetFile(tables["dim"]).metadata.num_rows
    # Each unit's range adds a few 4-row pages on its edges to dim's 10,000 non-NULL keys;
    # the 300 NULL keys (whole pages of NULLs) are read by none.
    assert DIM_ROWS <= rows <= 1.1 * DIM_ROWS, (dim_rows, dim_scan[:200])


def test_not_exists_against_a_build_side_in_key_order_is_exact(cluster, tables):
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    query = """SELECT f.v % 5 AS b, COUNT(*) AS n, SUM(f.v) AS s FROM fact f
    WHERE NOT EXISTS (SELECT 1 FROM dim d WHERE d.k = f.k AND d.x < 30)
    GROUP BY b ORDER BY b"""
    exact(cluster, query, t)
    assert cut(cluster), cluster.last_online_plan


def test_exists_is_a_semi_join_read_per_unit_and_exact(cluster, tables):
    """TPC-H Q4's shape: a positive EXISTS stays a semi join (not an IN run first), its
    subquery's table the build side, cut per unit; over one of the outer query's own tables
    it is still an IN run first (the sampled table is read once), and exact."""
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    query = """SELECT f.v % 5 AS b, COUNT(*) AS n, SUM(f.v) AS s FROM fact f
    WHERE EXISTS (SELECT 1 FROM dim d WHERE d.k = f.k AND d.x < 30)
    GROUP BY b ORDER BY b"""
    exact(cluster, query, t)
    assert cut(cluster), cluster.last_online_plan
    assert "join_type=RightSemi" in cluster.last_online_plan
    assert "__in_" not in cluster.last_online_plan
    # Over the outer query's own table: the EXISTS runs first (its keys a table it joins).
    query = """SELECT f.v % 5 AS b, COUNT(*) AS n FROM fact f
    WHERE EXISTS (SELECT 1 FROM fact g WHERE g.v = f.k AND g.v < 900) GROUP BY b ORDER BY b"""
    exact(cluster, query, t)
    assert "RightSemi" not in cluster.last_online_plan


def test_exists_over_a_join_of_the_sampled_table_is_one_semi_join_cut_per_unit(
    cluster, tables, tmp_path
):
    """The sampled table joined with another, and an EXISTS on the sampled table's key: the
    semi join is not copied below the inner join (online, every join is a broadcast: a copy
    would build the same keys again on every worker and keep them from being read per
    unit). One semi join, cut per unit, exact."""
    other = pa.table({"c": np.arange(1000), "g": np.arange(1000) % 6})
    t = {
        "fact": tables["fact"],
        "dim": tables["dim"],
        "other": write(other, tmp_path / "other.parquet", 1000, 64),
    }
    query = """SELECT o.g, COUNT(*) AS n, SUM(f.v) AS s FROM fact f, other o
    WHERE f.v = o.c AND EXISTS (SELECT 1 FROM dim d WHERE d.k = f.k AND d.x < 30)
    GROUP BY o.g ORDER BY o.g"""
    exact(cluster, query, t)
    plan = cluster.last_online_plan
    assert plan.count("join_type=RightSemi") == 1, plan
    assert cut(cluster), plan


SELF_EXISTS = """SELECT f.v % 5 AS b, COUNT(*) AS n, SUM(f.v) AS s FROM fact f
WHERE f.v < 700
  AND EXISTS (SELECT 1 FROM fact g WHERE g.k = f.k AND g.v <> f.v AND g.v > 500)
  AND NOT EXISTS (SELECT 1 FROM fact h WHERE h.k = f.k AND h.v <> f.v AND h.v < 20)
GROUP BY b ORDER BY b"""
# The same with a filtered join below, as Q21's orders: the EXISTS's build side is not
# narrowed to its keys (a stage built whole), it is read per unit.
SELF_EXISTS_JOINED = """SELECT d.g, COUNT(*) AS n, SUM(f.v) AS s FROM fact f JOIN dim d ON d.k = f.k
WHERE d.x < 30 AND EXISTS (SELECT 1 FROM fact g WHERE g.k = f.k AND g.v <> f.v)
GROUP BY d.g ORDER BY d.g"""


def test_exists_over_the_sampled_table_below_a_filtered_join_is_not_narrowed(cluster, tables):
    t = {"fact": tables["fact"], "dim": tables["dim"]}
    exact(cluster, SELF_EXISTS_JOINED, t)
    plan = cluster.last_online_plan
    assert plan.count("join_type=RightSemi") == 1, plan
    assert plan.count("SplitScanExec:") == 3, plan


@pytest.mark.parametrize("which", ["fact", "fact_random"])
def test_exists_over_the_sampled_table_itself_reads_it_whole_per_unit(cluster, tables, which):
    """TPC-H Q21's shape: an EXISTS and a NOT EXISTS over the sampled table itself, tied by
    an equality and a `<>` that no IN can say, stay a semi and an anti join whose build
    sides read the table whole (only the outer query's rows are sampled). Stored in the key's
    order, each unit reads only its own keys' pages for both; in a random order, both are
    built whole. Exact either way, with NULL keys and keys repeated across pages."""
    t = {"fact": tables[which], "dim": tables["dim"]}
    exact(cluster, SELF_EXISTS, t)
    plan = cluster.last_online_plan
    assert "join_type=RightSemi" in plan and "join_type=RightAnti" in plan, plan
    splits = [line for line in plan.splitlines() if "SplitScanExec:" in line]
    if which == "fact":
        # The sampled scan and the two build sides, read per unit, in the one stage.
        assert len(splits) == 3, plan
        assert plan.count("HashJoinExec: mode=Partitioned") == 2, plan
        assert "Stage 2" not in plan, plan
    else:
        assert len(splits) == 1 and not cut(cluster), plan
    exact_without_unit_builds(cluster, SELF_EXISTS, t)


def test_a_self_join_of_the_sampled_table_is_refused(cluster, tables):
    """Outside an EXISTS, a result row would hold two rows of the sampled table: refused."""
    query = """SELECT f.v % 5 AS b, COUNT(*) AS n FROM fact f JOIN fact g ON f.k = g.k
    GROUP BY b ORDER BY b"""
    with pytest.raises(ValueError, match="joins with itself"):
        next(cluster.online(query, tables={"fact": tables["fact"]}, progress=False))


def test_a_left_self_join_the_plan_builds_on_is_refused_or_exact(cluster, tables):
    """A LEFT JOIN of the sampled table with itself: the right copy is read whole. Where
    DataFusion builds on the (filtered, so smaller-looking) sampled copy and it cannot be
    turned, the query is refused with the reason, never streamed from a build side (whose
    unmatched rows would come only after every split)."""
    t = {"fact": tables["fact"]}
    query = """SELECT f.v % 5 AS b, COUNT(g.v) AS n, COUNT(*) AS r FROM fact f
    LEFT JOIN fact g ON f.k = g.k AND f.v < g.v WHERE f.v < 10 GROUP BY b ORDER BY b"""
    for rounds in (2, 3):  # 2: as many splits as the probe side's partitions
        try:
            results = list(cluster.online(query, rounds=rounds, seed=5, tables=t, progress=False))
        except ValueError as e:
            assert "build side of a join" in str(e) or "hash-joined" in str(e), e
            continue
        exact(cluster, query, t)
        assert results[-1].final


def test_a_build_side_stage_is_inlined_and_no_longer_run(cluster, tmp_path):
    """A build side over 128 Ki rows is a stage of its own (computed once, gathered): cut per
    unit, its plan moves into the units' stage and the stage is not run."""
    rng = np.random.default_rng(11)
    keys = 200_000
    k = np.sort(rng.integers(0, keys, 600_000))
    fact = pa.table({"k": k, "v": rng.integers(0, 1000, len(k))})
    dim = pa.table({"k": np.arange(keys), "g": np.arange(keys) % 5, "x": np.arange(keys) % 100})
    t = {
        "fact": write(fact, tmp_path / "fact.parquet", 100_000, 64),
        "dim": write(dim, tmp_path / "dim.parquet", 50_000, 64),
    }
    query = """SELECT d.g, SUM(f.v) AS s, COUNT(*) AS n FROM fact f JOIN dim d ON f.k = d.k
    WHERE d.x < 50 GROUP BY d.g ORDER BY d.g"""
    before = exact_without_unit_builds(cluster, query, t)
    assert before.count("Stage ") == 2 and "gather into 1" in before, before
    exact(cluster, query, t)
    assert cut(cluster)
    assert cluster.last_online_plan.count("Stage ") == 1, cluster.last_online_plan


def test_a_build_side_hashed_inside_its_stage_is_turned_and_read_per_unit(cluster, tmp_path):
    """TPC-H Q10's shape: the table in the fact's key order (`mid`, filtered) is the build side
    of another table's join (`other`, larger) inside the stage the fact builds on, and is a
    gathered stage itself. That join is turned around (`other` hashed whole, `mid` read per
    unit), both stages move into the units' stage, and the answer is exact."""
    rng = np.random.default_rng(17)
    keys = 200_000
    k = np.sort(rng.integers(0, keys, 600_000))
    fact = pa.table({"k": k, "v": rng.integers(0, 1000, len(k))})
    mid = pa.table(
        {"k": np.arange(keys), "c": rng.integers(0, 300_000, keys), "x": np.arange(keys) % 100}
    )
    other = pa.table({"c": np.arange(300_000), "g": np.arange(300_000) % 7})
    t = {
        "fact": write(fact, tmp_path / "fact.parquet", 100_000, 64),
        "mid": write(mid, tmp_path / "mid.parquet", 50_000, 64),
        "other": write(other, tmp_path / "other.parquet", 100_000, 64),
    }
    query = """SELECT o.g, SUM(f.v) AS s, COUNT(*) AS n FROM other o, mid m, fact f
    WHERE o.c = m.c AND m.k = f.k AND m.x < 50 GROUP BY o.g ORDER BY o.g"""
    before = exact_without_unit_builds(cluster, query, t)
    assert before.count("Stage ") == 3, before
    exact(cluster, query, t)
    plan = cluster.last_online_plan
    assert cut(cluster), plan
    assert plan.count("Stage ") == 1, plan
    # The parts of mid stream through other's join, other hashed whole.
    lines = plan.splitlines()
    parts = next(i for i, line in enumerate(lines) if "parts (the rows each split" in line)
    assert "mid.parquet" in lines[parts], plan
    assert any("mode=CollectLeft" in line for line in lines[:parts]), plan


def test_string_keys_over_several_files_and_row_group_statistics(cluster, tmp_path):
    """String keys; each table in two files; dim without a page index (its row groups'
    statistics say which rows a unit can meet)."""
    rng = np.random.default_rng(13)
    k = np.sort(rng.integers(0, 30_000, 400_000))
    fact = pa.table({"k": [f"key{x:06d}" for x in k], "v": rng.integers(0, 1000, len(k))})
    dk = np.arange(0, 30_000, 2)
    dim = pa.table({"k": [f"key{x:06d}" for x in dk], "g": dk % 3})
    for name, table in (("fact", fact), ("dim", dim)):
        (tmp_path / name).mkdir()
        half = table.num_rows // 2
        for i, part in enumerate((table.slice(0, half), table.slice(half))):
            path = tmp_path / name / f"part-{i}.parquet"
            if name == "fact":
                write(part, path, 50_000, 32)
            else:
                pq.write_table(part, path, row_group_size=200, write_page_index=False)
    t = {"fact": str(tmp_path / "fact"), "dim": str(tmp_path / "dim")}
    query = """SELECT d.g, SUM(f.v) AS s, COUNT(*) AS n FROM fact f JOIN dim d ON f.k = d.k
    GROUP BY d.g ORDER BY d.g"""
    exact(cluster, query, t)
    assert cut(cluster), cluster.last_online_plan


def test_a_worker_killed_while_units_read_their_build_sides_is_recovered(tables):
    """SIGKILL a worker after the first round: the query runs again (planned again, its
    build sides cut per unit again) on the replaced set, and the final is exact."""
    import signal

    from conftest import alive

    t = {"fact": tables["fact"], "dim": tables["dim"]}
    c = fs.Cluster(workers=3, timeout=120)
    pids = c.worker_pids
    try:
        results = []
        for r in c.online(INNER, rounds=8, seed=9, tables=t, progress=False):
            results.append(r)
            if r.round == 0:
                os.kill(pids[1], signal.SIGKILL)
        assert cut(c), c.last_online_plan
        assert [r.round for r in results] == list(range(results[-1].rounds))
        assert c.recovery()["rerun_jobs"] == 1, "the kill landed during the query"
        got = results[-1].estimates
        got = got.select(value_columns(got.columns)).to_arrow()
        con = duckdb.connect()
        for name, path in t.items():
            con.sql(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{path}')")
        assert tpch.compare(con.sql(INNER).to_arrow_table(), got, ordered=True) is None
        replacements = c.worker_pids
    finally:
        c.close()
    assert not any(alive(p) for p in pids + replacements)
