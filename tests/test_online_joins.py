"""Online aggregation over LEFT JOINs and derived tables of one row per row of a table
(TPC-H Q13's shape), at SF0.1 on 2 real workers: the LEFT JOIN's table is read whole and
the rows it keeps are sampled; finals equal DuckDB's, NULLs included (a SUM or a ratio of
no value); shapes whose answer would differ are refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from flightshuffle.estimates import value_columns
from flightshuffle_bench import tpch


def output(est) -> pa.Table:
    """The estimates without their intervals: the query's own columns."""
    return est.select(value_columns(est.columns)).to_arrow()


LEFT_JOINS = {
    # TPC-H Q13's join: the largest table on the LEFT JOIN's right is read whole, customer
    # is sampled; COUNT of a column that holds no null in orders still counts its NULLs
    # from customers without orders (not COUNT(*)).
    "customer": "SELECT c_mktsegment, COUNT(o_orderkey) AS n, COUNT(*) AS r, "
    "SUM(o_totalprice) AS s, AVG(c_acctbal) AS a FROM customer LEFT JOIN orders "
    "ON c_custkey = o_custkey AND o_comment NOT LIKE '%special%requests%' "
    "GROUP BY c_mktsegment ORDER BY c_mktsegment",
    # The sampled table on the left, a filtered dimension on the right.
    "lineitem": "SELECT l_returnflag, COUNT(p_partkey) AS n, SUM(l_quantity) AS q, "
    "MAX(p_size) AS m FROM lineitem LEFT OUTER JOIN part ON p_partkey = l_partkey "
    "AND p_size < 5 GROUP BY l_returnflag ORDER BY l_returnflag",
    # An inner join before it and a WHERE after it.
    "customer ": "SELECT n_name, COUNT(o_orderkey) AS n, COUNT(*) AS c FROM customer "
    "JOIN nation ON c_nationkey = n_nationkey LEFT JOIN orders ON o_custkey = c_custkey "
    "AND o_orderpriority = '1-URGENT' WHERE c_acctbal > 0 GROUP BY n_name ORDER BY n_name",
}


@pytest.mark.parametrize("sampled", list(LEFT_JOINS))
def test_left_join_reads_its_table_whole_and_samples_the_rows_it_keeps(
    tpch_cluster, tpch_duckdb, sampled
):
    query = LEFT_JOINS[sampled]
    results = list(tpch_cluster.online(query, rounds=3, seed=2, progress=False))
    assert len(results) >= 2 and results[-1].final
    want = tpch_duckdb.sql(query).to_arrow_table()
    problem = tpch.compare(want, output(results[-1].estimates), True)
    assert problem is None, problem
    plan = tpch_cluster.last_online_plan
    split_scan = next(line for line in plan.splitlines() if "SplitScanExec" in line)
    assert f"/{sampled.strip()}/" in split_scan, plan
    assert "join_type=Right," in plan, plan


PER_ROW = [
    # SUM, MAX and AVG of no matching row are NULL (SUM of only NULLs too), COUNT is 0.
    (
        "SELECT total IS NULL AS none, COUNT(*) AS n, SUM(total) AS s, AVG(mx) AS a, "
        "SUM(k) AS k FROM (SELECT c_custkey, SUM(o_totalprice) AS total, "
        "MAX(o_totalprice) AS mx, COUNT(o_orderkey) AS k FROM customer LEFT JOIN orders "
        "ON o_custkey = c_custkey AND o_orderstatus = 'F' WHERE c_acctbal > 0 "
        "GROUP BY c_custkey) AS t GROUP BY none ORDER BY none"
    ),
    (
        "SELECT l_returnflag, SUM(CASE WHEN l_quantity > 100 THEN l_quantity END) AS s, "
        "COUNT(*) AS n FROM lineitem GROUP BY l_returnflag ORDER BY l_returnflag"
    ),
    # A ratio whose numerator has no value in a group is NULL.
    (
        "SELECT c_mktsegment, SUM(o_totalprice) / SUM(c_acctbal) AS r FROM customer "
        "LEFT JOIN orders ON c_custkey = o_custkey AND o_totalprice < 0 "
        "GROUP BY c_mktsegment ORDER BY c_mktsegment"
    ),
]


@pytest.mark.parametrize("query", PER_ROW, ids=["per-row-derived", "sum-of-nulls", "ratio-nulls"])
def test_a_derived_table_of_one_row_per_row_and_sums_of_no_value(tpch_cluster, tpch_duckdb, query):
    results = list(tpch_cluster.online(query, rounds=3, seed=4, progress=False))
    assert results[-1].final
    want = tpch_duckdb.sql(query).to_arrow_table()
    problem = tpch.compare(want, output(results[-1].estimates), True)
    assert problem is None, problem


NOT_PER_ROW = {
    # Grouped by a key customer repeats, a group holds several customers.
    "repeated-key": "SELECT c_count, COUNT(*) AS n FROM (SELECT c_nationkey, "
    "COUNT(o_orderkey) AS c_count FROM customer LEFT JOIN orders ON c_custkey = o_custkey "
    "GROUP BY c_nationkey) AS t GROUP BY c_count",
    # Aggregates that are not NULL on the row a customer without orders gets (1, 0).
    "count-1": "SELECT c_count, COUNT(*) AS n FROM (SELECT c_custkey, COUNT(1) AS c_count "
    "FROM customer LEFT JOIN orders ON c_custkey = o_custkey GROUP BY c_custkey) AS t "
    "GROUP BY c_count",
    "coalesce": "SELECT s, COUNT(*) AS n FROM (SELECT c_custkey, "
    "SUM(COALESCE(o_totalprice, 0)) AS s FROM customer LEFT JOIN orders "
    "ON c_custkey = o_custkey GROUP BY c_custkey) AS t GROUP BY s",
    # Names from the alias's column list (not mapped by the rewrites).
    "alias-columns": "SELECT n, COUNT(*) AS c FROM (SELECT c_custkey AS k, c_nationkey AS n "
    "FROM customer) AS t(n, k) GROUP BY n",
}


@pytest.mark.parametrize("case", list(NOT_PER_ROW))
def test_derived_tables_not_one_row_per_row_are_refused(tpch_cluster, case):
    """Not rewritten (an answer would differ from SQL's), so refused with the reason."""
    with pytest.raises(ValueError, match="subqueries are not supported|must name tables"):
        next(tpch_cluster.online(NOT_PER_ROW[case], progress=False))
