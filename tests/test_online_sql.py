"""Online aggregation of distributed SQL with the native map side: TPC-H shapes with joins
(Q3, Q5, Q10) and without (Q1, Q6) at SF0.1 on 2 real workers. Finals equal DuckDB's exact
answers; intervals shrink; 95% intervals cover the truth after ~10% of the fact table."""

from __future__ import annotations

import itertools
import os

import flightshuffle as fs
import polars as pl
import pyarrow as pa
import pytest
from conftest import TPCH_SF
from flightshuffle.estimates import value_columns
from flightshuffle_bench import tpch

SF = TPCH_SF


def output(est: pl.DataFrame) -> pa.Table:
    """The estimates without their intervals: the query's own columns."""
    cols = value_columns(est.columns)
    return est.select(cols).to_arrow()


# The TPC-H queries online aggregation runs from their unmodified text: Q7-Q9 through their
# derived table, Q7 and Q8 reading nation twice, Q8 and Q14 a ratio of two sums, Q11 and Q18
# with their subquery run exactly first, Q4's EXISTS a semi join, Q17's
# correlated subquery run once per part into a table it joins, Q22's NOT EXISTS an anti join,
# Q16's COUNT(DISTINCT) from per-value statistics, Q21's EXISTS and NOT EXISTS over
# lineitem itself a semi and an anti join whose build sides read it whole, Q13's derived
# table of one row per customer with orders' counts per customer run exactly first.
ONLINE_TPCH = [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 21, 22]
# Those whose sampled table is not lineitem (a small one: fewer rounds): customer.
SMALL_SAMPLED = {13, 22}
# The table sampled where it is not lineitem (in its path). Where DataFusion builds on the
# largest table (filtered), the join is turned around only when building on the other side
# costs less than scanning it: not for Q12 (lineitem against orders, sampled); for Q14
# (lineitem against part) it is. Q4 samples orders: its EXISTS over lineitem is the build side.
SAMPLED = {
    4: "/orders/",
    11: "/partsupp/",
    12: "/orders/",
    13: "/customer/",
    16: "/partsupp/",
    22: "/customer/",
}
# Those without group keys (one fold partition in all).
NO_KEYS = {6, 14, 17, 19}


@pytest.mark.parametrize("n", ONLINE_TPCH)
def test_tpch_shape_final_equals_duckdb_and_intervals_shrink(tpch_cluster, tpch_duckdb, n):
    query, ordered = tpch.query(n, SF)
    results = list(tpch_cluster.online(query, rounds=5, seed=n, progress=False))
    # An early first round (one split per worker), then 5 of the splits' fifths; fewer when
    # the table sampled is small (Q22 samples customer).
    rounds = results[-1].rounds
    assert len(results) == rounds and results[-1].final
    assert rounds == 6 or (n in SMALL_SAMPLED and rounds >= 2), rounds
    assert [r.round for r in results] == list(range(rounds))
    assert all(a.progress < b.progress for a, b in itertools.pairwise(results))
    assert results[-1].progress == pytest.approx(1.0)
    want = tpch_duckdb.sql(query).to_arrow_table()
    got = output(results[-1].estimates)
    assert got.column_names == want.column_names
    problem = tpch.compare(want, got, ordered)
    assert problem is None, f"q{n}: {problem}"
    final = results[-1].estimates
    for c in [c for c in final.columns if c.endswith("_low")]:
        hi = c.removesuffix("_low") + "_high"
        assert (final[c] == final[hi]).all(), "the final interval has width 0"
    plan = tpch_cluster.last_online_plan
    assert "SplitScanExec" in plan or "DataSourceExec" in plan
    if "Folds" in plan:
        # Streamed: the fact stage reads splits, into one fold partition per worker (one in
        # all without group keys).
        assert "SplitScanExec" in plan, plan
        assert f"fold partitions: {1 if n in NO_KEYS else 2};" in plan, plan
        # The largest table streams, even where DataFusion would build on it (Q14's lineitem,
        # filtered to one month, looks smaller than part): the join is turned around.
        split_scan = next(line for line in plan.splitlines() if "SplitScanExec" in line)
        assert SAMPLED.get(n, "/lineitem/") in split_scan, plan


def test_count_distinct_folds_send_counts_per_group(tpch_cluster, tpch_duckdb, tpch_data):
    """Each fold partition of a COUNT(DISTINCT) sends, every round, its values seen and seen
    once per group (a row per group and partition), not its state per group and value; the
    final counts add up to DuckDB's exact COUNT(DISTINCT)."""
    from flightshuffle import sql_plan as sp
    from flightshuffle.dataset import parquet_files
    from flightshuffle.units import FIRST_WAVE_ROWS, fact_units

    query = (
        "SELECT l_returnflag, COUNT(DISTINCT l_partkey) AS n FROM lineitem GROUP BY l_returnflag"
    )
    plan = sp.plan_sql(query, "datafusion", tpch_cluster._never_null)
    path = tpch.table_paths(tpch_data)["lineitem"]
    units, per_task = fact_units(
        parquet_files(path), 0, 3, tpch_cluster.workers, 4, FIRST_WAVE_ROWS
    )
    native, _ = tpch_cluster.native.online_sql(
        plan.stats,
        [("lineitem", path, "v")],
        units,
        4,
        None,
        plan.terms,
        per_task,
        sp.distinct_counts(plan),
    )
    tables = []
    try:
        while (item := native.next_partial()) is not None:
            tables.append(item[1])
    finally:
        native.close()
    assert len(tables) >= 2
    for t in tables:
        assert t.column_names[-2:] == ["__d", "__f1"], t.schema
        assert t.num_rows <= 3 * tpch_cluster.workers  # 3 flags, a row per fold partition
    final = pl.from_arrow(tables[-1]).rename({tables[-1].column_names[0]: "f"})
    got = dict(final.group_by("f").agg(pl.col("__d").sum()).iter_rows())
    want = dict(tpch_duckdb.sql(query).fetchall())
    assert got == want


@pytest.mark.parametrize(
    "where",
    ["l_orderkey = 1", "l_orderkey < 0", "l_orderkey > 0"],
    ids=["one-pair", "no-rows", "all"],
)
def test_count_distinct_with_empty_fold_partitions_is_exact(tpch_cluster, tpch_duckdb, where):
    """A grouped COUNT(DISTINCT) whose (group, value) pairs leave a fold partition empty (one
    pair in all, or none): every round answers, the final equals DuckDB's."""
    query = (
        f"SELECT l_returnflag, COUNT(DISTINCT l_linestatus) AS n FROM lineitem WHERE {where} "
        "GROUP BY l_returnflag ORDER BY l_returnflag"
    )
    results = list(tpch_cluster.online(query, rounds=3, seed=2, progress=False))
    assert results[-1].final
    want = tpch_duckdb.sql(query).to_arrow_table()
    assert tpch.compare(want, output(results[-1].estimates), True) is None


def test_the_tables_a_query_keeps_for_its_subqueries_go_with_it(tpch_cluster, tpch_duckdb):
    """Q17's per-part averages are a table the query joins: registered while it streams,
    unregistered and its file removed once it ends (or is closed early)."""
    import glob
    import os

    def kept() -> list[str]:
        return [n for n in tpch_cluster._tables if n.startswith("__in_")]

    files = os.path.join(tpch_cluster.spill_root, "datasets", "__in_*")
    query, ordered = tpch.query(17, SF)
    stream = tpch_cluster.online(query, rounds=3, seed=1, progress=False)
    first = next(stream)
    assert len(kept()) == 1 and len(glob.glob(files)) == 1
    assert not first.final
    stream.close()
    assert kept() == [] and glob.glob(files) == []
    results = list(tpch_cluster.online(query, rounds=3, seed=2, progress=False))
    assert kept() == [] and glob.glob(files) == []
    want = tpch_duckdb.sql(query).to_arrow_table()
    assert tpch.compare(want, output(results[-1].estimates), ordered) is None


def width(est: pl.DataFrame, names: list[str]) -> float:
    return sum(float(((est[f"{n}_high"] - est[f"{n}_low"]) / est[n].abs()).mean()) for n in names)


def test_intervals_shrink_round_over_round_with_joins(tpch_cluster):
    query, _ = tpch.query(5, SF)
    results = list(tpch_cluster.online(query, rounds=5, seed=11, progress=False))
    widths = [width(r.estimates, ["revenue"]) for r in results]
    assert widths[0] > widths[2] > widths[4] > widths[5] == 0.0, widths


def coverage(
    tpch_cluster, tpch_duckdb, query: str, keys: list[str], exact_query: str | None = None
) -> float:
    """Share of (group, aggregate) pairs, among estimates not flagged unreliable, whose 95%
    interval after the first round (the first wave: 10-30% of lineitem at SF0.1, about half
    with joins, whose first wave reads up to a row group per worker) holds the
    exact answer, over 20 seeds."""
    exact = pl.from_arrow(tpch_duckdb.sql(exact_query or query).to_arrow_table())
    names = [c for c in exact.columns if c not in keys]
    covered = total = 0
    for seed in range(20):
        stream = tpch_cluster.online(query, rounds=10, seed=seed, progress=False)
        first = next(stream)
        stream.close()
        assert first.maps_done == 2 and 0.05 < first.progress < 0.55, first.progress
        j = first.estimates.join(exact, on=keys, how="inner", suffix="_exact")
        for name in names:
            truth = j[f"{name}_exact"].cast(pl.Float64)
            ok = (j[f"{name}_low"] <= truth) & (truth <= j[f"{name}_high"])
            reliable = j[f"{name}_reliable"]
            covered += int((ok & reliable).fill_null(False).sum())
            total += int(reliable.sum())
    assert total > 0
    return covered / total


def test_95_percent_intervals_cover_the_truth_on_a_randomly_ordered_table(
    tpch_cluster, tpch_duckdb, tmp_path
):
    """lineitem's rows in a random order (12 row groups), Q1: the intervals of the first
    round hold the exact answer for at least 88% of (group, aggregate) pairs over 20 seeds
    (100 seeds: docs/online/index.md#coverage-of-the-intervals)."""
    import pyarrow.parquet as pq

    rows = tpch_duckdb.sql("SELECT * FROM lineitem ORDER BY hash(l_orderkey * 8 + l_linenumber)")
    table = rows.to_arrow_table()
    pq.write_table(table, tmp_path / "random.parquet", row_group_size=-(-table.num_rows // 12))
    tpch_cluster.register_parquet("lineitem_random", str(tmp_path / "random.parquet"))
    query, _ = tpch.query(1, SF)
    random_query = query.replace("lineitem", "lineitem_random")
    share = coverage(
        tpch_cluster, tpch_duckdb, random_query, ["l_returnflag", "l_linestatus"], query
    )
    assert share >= 0.88, f"coverage {share:.3f}"


def test_95_percent_intervals_cover_the_truth_on_lineitem_as_stored(tpch_cluster, tpch_duckdb):
    """lineitem as tpchgen stores it (by order, an order's lines sharing their dates), Q1
    (one table) and Q5 (six tables): the first round's intervals, from the spread between
    units, hold at least 88% of the reliable pairs over 20 seeds (the row-level intervals
    before held 86-88% over 100 seeds for Q1)."""
    for n, keys in [(1, ["l_returnflag", "l_linestatus"]), (5, ["n_name"])]:
        share = coverage(tpch_cluster, tpch_duckdb, tpch.query(n, SF)[0], keys)
        assert share >= 0.88, f"q{n}: coverage {share:.3f}"


def test_having_and_order_by_an_aggregate_apply_to_the_estimates(tpch_cluster, tpch_duckdb):
    query = (
        "SELECT n_name, count(*) AS lines, sum(l_quantity) AS qty FROM lineitem, supplier, nation "
        "WHERE l_suppkey = s_suppkey AND s_nationkey = n_nationkey "
        "GROUP BY n_name HAVING sum(l_quantity) > 600000 AND avg(l_discount) < 0.06 "
        "ORDER BY qty DESC LIMIT 5"
    )
    results = list(tpch_cluster.online(query, rounds=4, seed=2, progress=False))
    want = tpch_duckdb.sql(query).to_arrow_table()
    got = output(results[-1].estimates)
    assert got.column_names == ["n_name", "lines", "qty"], "the HAVING-only AVG is not shown"
    assert 0 < want.num_rows <= 5
    assert tpch.compare(want, got, True) is None
    # Each round says whether a group's HAVING holds whatever the values in its intervals;
    # the final's intervals are points, so every group there passes for certain.
    for r in results:
        assert r.estimates.columns[-1] == "having_certain"
    assert results[-1].estimates["having_certain"].to_list() == [True] * want.num_rows


def test_online_sql_over_arrow_tables_and_polars(tpch_cluster):
    facts = pl.DataFrame({"k": [i % 7 for i in range(50_000)], "x": list(range(50_000))})
    dims = pl.DataFrame({"k": list(range(7)), "name": [f"g{i}" for i in range(7)]})
    query = "SELECT name, sum(x) AS s, count(*) AS n FROM facts JOIN dims ON facts.k = dims.k GROUP BY name"
    results = list(
        tpch_cluster.online(query, tables={"facts": facts, "dims": dims}, rounds=3, progress=False)
    )
    got = results[-1].estimates.sort("name")
    want = facts.join(dims, on="k").group_by("name").agg(s=pl.col("x").sum(), n=pl.len())
    want = want.sort("name")
    assert got["name"].to_list() == want["name"].to_list()
    assert got["s"].to_list() == [float(v) for v in want["s"]]
    assert got["n"].to_list() == [float(v) for v in want["n"]]


def test_online_sql_errors_are_clear(tpch_cluster):
    bad = {
        "SELECT n_name, sum(l_quantity) - sum(l_tax) FROM lineitem, supplier, nation "
        "WHERE l_suppkey = s_suppkey AND s_nationkey = n_nationkey GROUP BY n_name": "over aggregates",
        "SELECT sum(l_quantity) / (2 * sum(l_tax)) FROM lineitem": "ratio of two sums",
        "SELECT f, sum(n) FROM (SELECT l_returnflag AS f, count(*) AS n FROM lineitem "
        "GROUP BY l_returnflag) AS t GROUP BY f": "subqueries",
        "SELECT sum(l_quantity) FROM lineitem, part WHERE p_partkey = l_partkey AND "
        "l_quantity < (SELECT count(*) FROM partsupp WHERE ps_partkey = p_partkey)": "correlated",
        "SELECT l_returnflag, count(*) FROM lineitem WHERE l_quantity > 49 OR EXISTS "
        "(SELECT 1 FROM orders WHERE o_orderkey = l_orderkey AND o_totalprice > 1000) "
        "GROUP BY l_returnflag": "EXISTS",
        "SELECT a.l_returnflag, sum(a.l_tax) FROM lineitem a JOIN lineitem b "
        "ON a.l_orderkey = b.l_orderkey GROUP BY a.l_returnflag": "joins with itself",
        "SELECT o_orderpriority, count(*) FROM orders WHERE o_orderkey NOT IN "
        "(SELECT l_orderkey FROM lineitem) GROUP BY o_orderpriority": "at most 10000",
        "SELECT n_name, count(*) FROM nation RIGHT JOIN supplier ON s_nationkey = n_nationkey "
        "GROUP BY n_name": "inner joins and LEFT JOINs",
        "SELECT n_name, count(*) FROM nation FULL JOIN supplier ON s_nationkey = n_nationkey "
        "GROUP BY n_name": "inner joins and LEFT JOINs",
        "SELECT sum(x) FROM nowhere": "unknown table",
        "SELECT n_name, sum(l_quantity) FROM lineitem, nation GROUP BY n_name ORDER BY nope": "ORDER BY",
    }
    for q, words in bad.items():
        with pytest.raises(ValueError, match=words):
            next(tpch_cluster.online(q, progress=False))
    # The cluster still answers; a query over a small table runs whole: one exact result.
    r = list(tpch_cluster.online("SELECT count(*) AS n FROM region", rounds=3, progress=False))
    assert len(r) == 1 and r[0].final and r[0].estimates["n"].to_list() == [5.0]


def test_duckdb_map_side_refuses_joins_clearly(tpch_cluster):
    query, _ = tpch.query(3, SF)
    with pytest.raises(ValueError, match="engine='datafusion'"):
        next(tpch_cluster.online(query, engine="duckdb", progress=False))


@pytest.mark.parametrize("group_by", ["extract(year FROM o_orderdate)", "y", "1"])
def test_group_by_an_expression_its_alias_or_its_position(tpch_cluster, tpch_duckdb, group_by):
    query = (
        "SELECT extract(year FROM o_orderdate) AS y, sum(o_totalprice) AS s, "
        "min(o_orderdate) AS first FROM orders JOIN customer ON o_custkey = c_custkey "
        f"GROUP BY {group_by} ORDER BY y"
    )
    results = list(tpch_cluster.online(query, rounds=3, seed=1, progress=False))
    want = tpch_duckdb.sql(query).to_arrow_table()
    assert tpch.compare(want, output(results[-1].estimates), True) is None


@pytest.mark.parametrize("order_by", ["1 DESC", "2", "3 DESC, 1", "count(*) DESC, 1"])
def test_order_by_a_position(tpch_cluster, tpch_duckdb, order_by):
    """ORDER BY may name a selected column by its position, as GROUP BY may."""
    query = (
        "SELECT o_orderpriority, sum(o_totalprice) AS s, count(*) FROM orders "
        f"GROUP BY 1 ORDER BY {order_by}"
    )
    results = list(tpch_cluster.online(query, rounds=3, seed=1, progress=False))
    want = tpch_duckdb.sql(query).to_arrow_table()
    assert tpch.compare(want, output(results[-1].estimates), True) is None


def test_statistics_query_casts_the_operands_not_each_result():
    """The statistics query evaluates SUM/AVG arguments in DOUBLE from their operands
    (decimal products cast row by row cost Q1 1.6x the query itself), except through ``/``,
    whose integer form would become float division; a lone literal is still cast."""
    from flightshuffle.sql_plan import plan_sql

    query = (
        "SELECT k, SUM(a * (1 - b)), AVG(-(c + 2)), SUM(d / 2), SUM(CASE WHEN e THEN f END), "
        "SUM(1), SUM(2 * 3) FROM t GROUP BY k"
    )
    stats = plan_sql(query, "duckdb").stats
    assert "CAST(a AS DOUBLE) * (1 - CAST(b AS DOUBLE))" in stats
    assert "-(CAST(c AS DOUBLE) + 2)" in stats
    assert "CAST(d / 2 AS DOUBLE)" in stats
    assert "CAST(CASE WHEN e THEN f END AS DOUBLE)" in stats
    assert "CAST(1 AS DOUBLE)" in stats
    assert "CAST(2 * 3 AS DOUBLE)" in stats
    # DataFusion: the same operands through fs_to_double (CAST's result, faster for
    # decimals); literals alone are still cast.
    stats = plan_sql(query, "datafusion").stats
    assert "FS_TO_DOUBLE(A) * (1 - FS_TO_DOUBLE(B))" in stats.upper()
    assert "FS_TO_DOUBLE(D / 2)" in stats.upper()
    assert "CAST(1 AS DOUBLE)" in stats and "CAST(2 * 3 AS DOUBLE)" in stats


def test_closing_the_cluster_under_a_running_online_query_is_quiet(tpch_data, capfd):
    """A stream left open when its cluster closes: the workers going away are not reported
    as lost workers (they were stopped on purpose)."""
    with fs.Cluster(workers=2, timeout=120) as c:
        c.register_parquet("lineitem", tpch.table_paths(tpch_data)["lineitem"])
        stream = iter(c.online(tpch.query(1, TPCH_SF)[0], rounds=10, progress=False))
        next(stream)
    err = capfd.readouterr().err
    assert "worker lost" not in err, err


@pytest.mark.parametrize(
    "query",
    [
        (
            "SELECT o_custkey, avg(l_quantity) AS q FROM lineitem, orders "
            "WHERE l_orderkey = o_orderkey GROUP BY o_custkey ORDER BY q, o_custkey LIMIT 7"
        ),
        (
            "SELECT l_partkey, count(*) AS n FROM lineitem GROUP BY l_partkey "
            "ORDER BY n DESC, l_partkey LIMIT 5"
        ),
        (
            "SELECT l_suppkey, min(l_shipdate) AS d, sum(l_tax) AS t FROM lineitem GROUP BY l_suppkey "
            "ORDER BY d, l_suppkey LIMIT 4"
        ),
        (
            "SELECT l_suppkey, sum(l_quantity) AS s FROM lineitem GROUP BY l_suppkey "
            "ORDER BY l_suppkey DESC LIMIT 3"
        ),
        (
            "SELECT l_suppkey, sum(l_discount) AS s FROM lineitem GROUP BY l_suppkey "
            "ORDER BY s DESC LIMIT 0"
        ),
    ],
)
def test_order_by_limit_sends_only_the_candidates_and_stays_exact(
    tpch_cluster, tpch_duckdb, query, monkeypatch
):
    """With ORDER BY ... LIMIT k the workers send only the groups that can be among the
    first k (ties included): far fewer rows than there are groups, and the final is exact
    (many ties here: counts, AVG of integers, dates)."""
    from flightshuffle import online

    sent: list[int] = []
    results_of = online.results

    def counting(native, *args, **kwargs):
        class Counted:
            def next_partial(self):
                item = native.next_partial()
                if item is not None:
                    sent.append(item[1].num_rows)
                return item

            def close(self):
                native.close()

        return results_of(Counted(), *args, **kwargs)

    monkeypatch.setattr(online, "results", counting)
    results = list(tpch_cluster.online(query, rounds=4, seed=3, progress=False))
    want = tpch_duckdb.sql(query).to_arrow_table()
    assert tpch.compare(want, output(results[-1].estimates), True) is None
    groups = tpch_duckdb.sql(f"SELECT count(*) FROM ({query.split(' ORDER BY ')[0]})").fetchall()[
        0
    ][0]
    assert len(sent) == len(results) and max(sent) < groups / 4, (sent, groups)


def test_counts_of_arguments_that_cannot_be_null_are_one_count():
    """COUNT of an argument over required columns only is COUNT(*), computed once; a column
    that may hold nulls, TRY_CAST and CASE keep their own count."""
    from flightshuffle.sql_plan import plan_sql

    required = lambda tables: {"a", "b"}
    stats = plan_sql(
        "SELECT k, AVG(a), SUM(a * (1 - b)), AVG(CAST(b AS DOUBLE)), AVG(c), SUM(a + c), "
        "AVG(TRY_CAST(a AS INT)), AVG(CASE WHEN a > 1 THEN b END), COUNT(*) FROM t GROUP BY k",
        "datafusion",
        required,
    ).stats
    assert stats.count("COUNT(*)") == 1, stats
    assert stats.count("COUNT(") == 5, stats  # c, a + c, TRY_CAST, CASE, and the one COUNT(*)
    assert plan_sql("SELECT k, AVG(a) FROM t GROUP BY k", "datafusion").stats.count("COUNT(*)") == 0


def test_nulls_in_a_nullable_column_are_not_counted(tpch_cluster, tmp_path):
    """A Parquet table with a required and a nullable column: AVG and COUNT of each are exact
    (the required one's count is shared, the nullable one's is its own)."""
    import pyarrow.parquet as pq

    n = 20_000
    schema = pa.schema(
        [
            pa.field("k", pa.int64(), False),
            pa.field("a", pa.float64(), False),
            pa.field("b", pa.float64(), True),
        ]
    )
    data = pa.table(
        {
            "k": [i % 5 for i in range(n)],
            "a": [float(i % 13) for i in range(n)],
            "b": [None if i % 3 == 0 else float(i % 7) for i in range(n)],
        },
        schema=schema,
    )
    path = tmp_path / "t.parquet"
    pq.write_table(data, path, row_group_size=1000)
    query = "SELECT k, avg(a) AS aa, count(a) AS ca, avg(b) AS ab, count(b) AS cb FROM t GROUP BY k ORDER BY k"
    final = list(tpch_cluster.online(query, tables={"t": str(path)}, rounds=3, progress=False))[-1]
    want = (
        pl.from_arrow(data)
        .group_by("k")
        .agg(
            aa=pl.col("a").mean(),
            ca=pl.col("a").count(),
            ab=pl.col("b").mean(),
            cb=pl.col("b").count(),
        )
        .sort("k")
    )
    got = final.estimates
    for c in ("aa", "ca", "ab", "cb"):
        assert got[c].to_list() == pytest.approx([float(v) for v in want[c]]), c


def test_a_table_rewritten_in_place_is_read_again(tpch_cluster, tmp_path):
    """The online context keeps its tables registered between queries; a file rewritten
    under the same path (new rows, a new column) is registered again, not read stale."""
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"k": [1, 2, 2] * 1000, "x": [1.0, 2.0, 3.0] * 1000}), path)
    query = "SELECT k, sum(x) AS s FROM t GROUP BY k ORDER BY k"
    first = list(tpch_cluster.online(query, tables={"t": str(path)}, rounds=2, progress=False))[-1]
    assert first.estimates["s"].to_list() == [1000.0, 5000.0]
    pq.write_table(
        pa.table({"k": [1, 3] * 1000, "y": ["a", "b"] * 1000, "x": [10.0, 20.0] * 1000}), path
    )
    again = list(tpch_cluster.online(query, tables={"t": str(path)}, rounds=2, progress=False))[-1]
    assert again.estimates["k"].to_list() == [1, 3]
    assert again.estimates["s"].to_list() == [10000.0, 20000.0]
    by_y = "SELECT y, sum(x) AS s FROM t GROUP BY y ORDER BY y"
    new = list(tpch_cluster.online(by_y, tables={"t": str(path)}, rounds=2, progress=False))[-1]
    assert new.estimates["y"].to_list() == ["a", "b"]


def test_a_column_is_never_null_only_where_every_file_requires_it(tmp_path):
    """A table reads a column that some of its files lack as null there: only a column
    present and required in every file of every table that has it counts as never null."""
    import pyarrow.parquet as pq
    from flightshuffle import footers

    def write(name: str, fields: list[tuple[str, bool]]) -> str:
        schema = pa.schema([pa.field(n, pa.int64(), nullable) for n, nullable in fields])
        table = pa.table({n: [1, 2] for n, _ in fields}, schema=schema)
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(table, path)
        return path

    a1 = write("a1", [("a", False), ("b", False), ("c", False)])
    a2 = write("a2", [("a", False), ("b", True)])  # no c; b nullable here
    other = write("o", [("a", False), ("d", False), ("e", True)])
    assert footers.never_null([[a1, a2], [other]]) == {"a", "d"}
    assert footers.never_null([[a1]]) == {"a", "b", "c"}


def test_count_rewrite_follows_identifier_case_and_qualifiers():
    """Unquoted identifiers fold to lower case as in DataFusion; a qualifier that names no
    table of the query may be a struct field, whose nulls are unknown."""
    from flightshuffle.sql_plan import plan_sql

    required = lambda tables: {"price"}
    stats = plan_sql("SELECT k, AVG(Price), AVG(t.price) FROM t GROUP BY k", "datafusion", required)
    assert stats.stats.count("COUNT(*)") == 1 and stats.stats.count("COUNT(") == 1
    quoted = plan_sql('SELECT k, AVG("Price") FROM t GROUP BY k', "datafusion", required).stats
    assert 'COUNT("__x0")' in quoted
    field = plan_sql("SELECT k, AVG(s.price) FROM t GROUP BY k", "datafusion", required).stats
    assert 'COUNT("__x0")' in field


def test_online_bound_counts_draws_within_and_the_whole_table_is_exact(tpch_data, tmp_path):
    """`flightshuffle online-bound`: the whole table scaled by 1 is the exact answer, and the
    share of draws within 5% is reported per sample size."""
    import argparse
    import json

    import polars as pl
    from flightshuffle_bench import samplebound

    lineitem = pl.read_parquet(tpch.table_paths(tpch_data)["lineitem"], columns=samplebound.COLUMNS)
    exact = samplebound.q1(lineitem, 1.0)
    assert samplebound.within(exact, exact, 0.0)
    assert not samplebound.within(samplebound.q1(lineitem.head(1000), 1.0), exact, 0.05)
    out = tmp_path / "bound.json"
    args = argparse.Namespace(
        sf=TPCH_SF, data=tpch_data, workers=2, rows="1024,65536", trials=5, within=0.05, seed=0
    )
    args.json = str(out)
    assert samplebound.run(args) == 0
    sizes = json.loads(out.read_text())["sizes"]
    assert [s["rows_per_split"] for s in sizes] == [1024, 65536]
    assert all(0 <= s["p_within_stored_order"] <= 1 for s in sizes)
    assert sizes[0]["p_within_stored_order"] < 1  # 2 K rows of 600 K: Q1's smallest group misses


def test_fact_units_cut_row_groups_into_units_and_read_every_row_once(tmp_path):
    """The fact table's units: row ranges within one row group, of at least MIN_UNIT_ROWS
    rows (unless the row group is smaller), at least TARGET_UNITS of them where the rows
    allow; the first wave's tasks (one per worker) read units up to `head_rows` rows (a row
    group's without), the others about equal runs, at least `rounds` tasks, and every task
    reads at least one unit; over all units every row of every file is read exactly once,
    in an order fixed by the seed."""
    import bisect

    import pyarrow.parquet as pq
    from flightshuffle import units as un

    sizes = {"a": (150_000, 30_000), "b": (40_000, 40_000), "c": (3_000_000, 262_144)}
    files, bounds = [], {}
    for name, (rows, group) in sizes.items():
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(pa.table({"x": pa.array(range(rows), pa.int32())}), path, group)
        md = pq.ParquetFile(path).metadata
        ends = list(
            itertools.accumulate(md.row_group(i).num_rows for i in range(md.num_row_groups))
        )
        files.append(path)
        bounds[path] = [0, *ends]

    def groups_read(u: tuple) -> int:
        b = bounds[u[0]]
        return bisect.bisect_left(b, u[3] + u[4]) - bisect.bisect_right(b, u[3]) + 1

    total = sum(r for r, _ in sizes.values())
    cases = itertools.product(range(3), range(4), (0, 2, 10, 30), (0, 1000), (None, 65_536))
    for seed, first, rounds, want, head in cases:
        units, per_task = un.fact_units(files, want, seed, first, rounds, head)
        assert (units, per_task) == un.fact_units(files, want, seed, first, rounds, head)
        assert sum(per_task) == len(units) and all(k >= 1 for k in per_task)
        assert len(units) >= min(max(un.TARGET_UNITS, want), total // un.MIN_UNIT_ROWS)
        assert all(groups_read(u) == 1 for u in units)
        assert all(u[4] >= min(un.MIN_UNIT_ROWS, 40_000) // 2 for u in units)
        at = 0
        for i, k in enumerate(per_task):
            rows = sum(u[4] for u in units[at : at + k])
            if i < first and k > 1:
                assert rows <= (head or 262_144), (i, k, rows)
            at += k
        assert len(per_task) >= min(len(units), first + max(rounds, 1))
        for path, (rows, _) in zip(files, sizes.values(), strict=True):
            ranges = sorted((u[3], u[4]) for u in units if u[0] == os.path.abspath(path))
            ends = [0] + [start + n for start, n in ranges]
            assert [start for start, _ in ranges] == ends[:-1] and ends[-1] == rows


@pytest.mark.parametrize("n, cut", [(1, True), (6, True), (3, False)])
def test_a_one_table_query_cuts_its_first_wave_and_stays_exact(tpch_cluster, tpch_duckdb, n, cut):
    """lineitem at SF0.1: 4 files of one row group each, cut into units of at least 8,192
    rows. A query over one table reads at most FIRST_WAVE_ROWS rows in each worker's first
    task; a query with joins up to a row group's. Every unit is its own partition of the
    fact stage, with its totals kept apart; both end exact."""
    from flightshuffle import units as un
    from flightshuffle.dataset import parquet_files

    query, ordered = tpch.query(n, SF)
    results = list(tpch_cluster.online(query, rounds=2, seed=3, min_splits=1, progress=False))
    files = parquet_files(tpch_cluster._tables["lineitem"])
    units, per_task = un.fact_units(files, 20, 3, 2, 2, un.FIRST_WAVE_ROWS if cut else None)
    assert results[-1].maps_total == len(per_task)
    assert f"SplitScanExec: {len(units)} splits" in tpch_cluster.last_online_plan
    assert "SplitTotalsExec" in tpch_cluster.last_online_plan
    rows = tpch_duckdb.sql("SELECT count(*) FROM lineitem").fetchall()[0][0]
    # The first round: the first two commits, first-wave tasks (only those run at first).
    assert results[0].progress <= 2 * (un.FIRST_WAVE_ROWS if cut else 150_753) / rows
    problem = tpch.compare(
        tpch_duckdb.sql(query).to_arrow_table(), output(results[-1].estimates), ordered
    )
    assert problem is None, f"q{n}: {problem}"


@pytest.mark.parametrize("n", [1, 3])
def test_splits_of_merged_row_groups_stay_exact(tpch_cluster, tpch_duckdb, tpch_data, tmp_path, n):
    """lineitem as one file of 30 row groups of 20,000 rows: units of a row group or part of
    one, several per map task; the rounds asked for all come, and the final equals
    DuckDB's."""
    import pyarrow.parquet as pq

    original = tpch.table_paths(tpch_data)["lineitem"]
    path = str(tmp_path / "lineitem.parquet")
    pq.write_table(pq.read_table(original), path, row_group_size=20_000)
    query, ordered = tpch.query(n, SF)
    try:
        results = list(
            tpch_cluster.online(query, tables={"lineitem": path}, rounds=3, seed=2, progress=False)
        )
    finally:
        tpch_cluster.register_parquet("lineitem", original)
    assert len(results) == 4 and results[-1].final
    assert 2 + 3 <= results[-1].maps_total < 30
    units = int(tpch_cluster.last_online_plan.split("SplitScanExec: ")[1].split(" ")[0])
    assert units >= 2 * results[-1].maps_total, "several units per map task"
    problem = tpch.compare(
        tpch_duckdb.sql(query).to_arrow_table(), output(results[-1].estimates), ordered
    )
    assert problem is None, f"q{n}: {problem}"


def test_count_distinct_estimates_from_per_value_statistics():
    """GEE from per-value counts: ``d`` values seen, ``f1`` of them in one row, a fraction q
    read: estimate d + (1/√q − 1)·f1 within [d, d + (1/q − 1)·f1], flagged until the final,
    which is d (NULL values not counted; a group of NULLs only counts 0)."""
    from flightshuffle.estimates import DISTINCT_VALUE, Sample, distinct_estimates

    state = pa.table(
        {
            "g": ["a", "a", "a", "b", "c"],
            DISTINCT_VALUE: [1, 2, None, 7, None],
            "__c0": [1, 3, 2, 1, 4],
        }
    )
    quarter = Sample(units=1, total_units=4, rows=25, total_rows=100, row_squares=625.0)
    est = distinct_estimates(state, ["g"], "n", quarter).sort_by("g").to_pydict()
    assert est["g"] == ["a", "b", "c"]
    assert est["n"] == [2 + (2 - 1) * 1, 1 + (2 - 1) * 1, 0]
    assert est["n_low"] == [2, 1, 0] and est["n_high"] == [2 + 3, 1 + 3, 0]
    assert est["n_reliable"] == [False] * 3
    whole = Sample(units=4, total_units=4, rows=100, total_rows=100, row_squares=2500.0)
    final = distinct_estimates(state, ["g"], "n", whole).sort_by("g").to_pydict()
    assert final["n"] == final["n_low"] == final["n_high"] == [2, 1, 0]
    assert final["n_reliable"] == [True] * 3
    no_keys = distinct_estimates(state.drop_columns(["g"]), [], "n", whole).to_pydict()
    assert no_keys["n"] == [3]
    # A value of a type Polars does not take (decimal256): only its validity is used.
    wide = state.set_column(
        1, DISTINCT_VALUE, pa.array([1, 2, None, 7, None], pa.int64()).cast(pa.decimal256(40, 2))
    )
    assert distinct_estimates(wide, ["g"], "n", whole).sort_by("g").column("n").to_pylist() == [
        2,
        1,
        0,
    ]


def test_a_group_key_named_like_the_distinct_value_column(tpch_cluster, tpch_duckdb):
    """A review case: a key named ``__dv`` was taken for COUNT(DISTINCT)'s value column."""
    query = "SELECT l_returnflag AS __dv, sum(l_quantity) AS s FROM lineitem GROUP BY l_returnflag"
    results = list(tpch_cluster.online(query, rounds=2, seed=1, progress=False))
    assert (
        tpch.compare(tpch_duckdb.sql(query).to_arrow_table(), output(results[-1].estimates), False)
        is None
    )


def test_count_distinct_is_the_only_aggregate():
    from flightshuffle.sql_plan import plan_sql

    for sql in (
        (
            "SELECT l_returnflag, count(DISTINCT l_partkey), sum(l_tax) FROM lineitem "
            "GROUP BY l_returnflag"
        ),
        (
            "SELECT l_returnflag, count(DISTINCT l_partkey) FROM lineitem GROUP BY l_returnflag "
            "HAVING count(DISTINCT l_partkey) > 3"
        ),
    ):
        with pytest.raises(ValueError, match="only aggregate"):
            plan_sql(sql, "datafusion")
