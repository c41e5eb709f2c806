"""Online intervals that hold on data as it is stored: the sampling unit is a row range of the
fact table, so the variance comes from the spread between units (cluster sampling).

* The native fold's per-unit products, summed over every unit, equal DuckDB's per-unit totals
  computed independently (real workers, real Parquet, tpchgen's lineitem as stored).
* Coverage of the 95% intervals after about 10% of lineitem, as stored and in a random order,
  over 100 random unit orders, from DuckDB's per-unit totals through the estimator the driver
  runs (the real-run coverage over 100 seeds is `flightshuffle-bench online-coverage`).
* Real online runs: estimates flagged while their group was seen in few units, finals exact.
"""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from conftest import TPCH_SF
from flightshuffle import estimates as es
from flightshuffle import sql_plan as sp
from flightshuffle.dataset import parquet_files
from flightshuffle.estimates import value_columns
from flightshuffle.units import FIRST_WAVE_ROWS, fact_units
from flightshuffle_bench import tpch
from hypothesis import given, settings
from hypothesis import strategies as st

SF = TPCH_SF

# A Q1 shape (one table): SUM, COUNT and AVG per group, spread evenly over the table.
Q1 = (
    "SELECT l_returnflag, l_linestatus, SUM(l_quantity) AS qty, COUNT(*) AS n, "
    "AVG(l_discount) AS disc FROM lineitem WHERE l_shipdate <= DATE '1998-09-02' "
    "GROUP BY l_returnflag, l_linestatus"
)
# Per unit, DuckDB's totals of Q1's aggregates: (c, s) per aggregate, in Q1's order.
Q1_UNIT = (
    "SELECT unit, l_returnflag, l_linestatus, count(*) AS c0, sum(l_quantity) AS s0, "
    "count(*) AS c1, count(l_discount) AS c2, sum(l_discount) AS s2 FROM {rows} "
    "WHERE l_shipdate <= DATE '1998-09-02' GROUP BY ALL"
)
# A Q10 shape: groups (customers) whose rows are clustered, a customer's orders in few units.
Q10 = (
    "SELECT c_nationkey, l_returnflag, SUM(l_extendedprice) AS revenue, COUNT(*) AS n "
    "FROM lineitem, orders, customer WHERE l_orderkey = o_orderkey AND o_custkey = c_custkey "
    "AND c_custkey % 50 = 0 GROUP BY c_nationkey, l_returnflag"
)
Q10_UNIT = (
    "SELECT unit, c_nationkey, l_returnflag, count(*) AS c0, sum(l_extendedprice) AS s0, "
    "count(*) AS c1 FROM {rows}, orders, customer WHERE l_orderkey = o_orderkey AND "
    "o_custkey = c_custkey AND c_custkey % 50 = 0 GROUP BY ALL"
)


def unit_rows_sql(tpch_duckdb, units: list[tuple], files: list[str]) -> str:
    """A DuckDB relation of the fact table's rows with their unit's index (``unit``)."""
    ranges = pa.table(
        {
            "path": [u[0] for u in units],
            "first": [u[3] for u in units],
            "last": [u[3] + u[4] for u in units],
            "unit": list(range(len(units))),
        }
    )
    tpch_duckdb.register("__units", ranges)
    listed = ", ".join(f"'{f}'" for f in files)
    return (
        f"(SELECT r.*, u.unit FROM read_parquet([{listed}], filename = true, "
        "file_row_number = true) r JOIN __units u ON r.filename = u.path AND "
        "r.file_row_number >= u.first AND r.file_row_number < u.last) AS lineitem"
    )


def per_unit(tpch_duckdb, sql: str, units, files) -> pl.DataFrame:
    """DuckDB's totals of each unit (``sql`` over ``{rows}``), decimals as doubles."""
    out = pl.from_arrow(
        tpch_duckdb.sql(sql.format(rows=unit_rows_sql(tpch_duckdb, units, files))).to_arrow_table()
    )
    return out.with_columns(pl.col(pl.Decimal).cast(pl.Float64))


def test_the_folds_products_equal_duckdbs_per_unit_totals(tpch_cluster, tpch_duckdb, tpch_data):
    """Run Q1 online to the end on the workers with its terms, and compare the folded sums of
    products (per group: Σ t_a·t_b over units, Σ t·m, units seen) with DuckDB's totals of
    each unit, computed from the same row ranges of the same files."""
    plan = sp.plan_sql(Q1, "datafusion", tpch_cluster._never_null)
    files = parquet_files(tpch.table_paths(tpch_data)["lineitem"])
    units, per_task = fact_units(files, 0, 7, tpch_cluster.workers, 4, FIRST_WAVE_ROWS)
    assert len(units) > 2 * len(per_task), "several units per map task"
    native, _ = tpch_cluster.native.online_sql(
        plan.stats,
        [("lineitem", tpch.table_paths(tpch_data)["lineitem"], "v")],
        units,
        4,
        None,
        plan.terms,
        per_task,
    )
    table = None
    try:
        while (item := native.next_partial()) is not None:
            info, table = item
    finally:
        native.close()
    assert info["final"] and info["units_done"] == len(units)
    assert info["weight_squares"] == pytest.approx(sum(u[4] ** 2 for u in units))
    got = pl.from_arrow(sp.expand_stats(table, plan)).sort("l_returnflag", "l_linestatus")
    want = per_unit(tpch_duckdb, Q1_UNIT, units, files)
    rows = pl.DataFrame({"unit": list(range(len(units))), "m": [float(u[4]) for u in units]})
    want = (
        want.join(rows, on="unit")
        .group_by("l_returnflag", "l_linestatus")
        .agg(
            pl.len().alias(es.UNITS),
            *[
                pl.col(f"{x}{j}").sum().alias(f"__{x}{j}")
                for x, j in [("c", 0), ("s", 0), ("c", 1), ("c", 2), ("s", 2)]
            ],
            (pl.col("s0") ** 2).sum().alias("__ss0"),
            (pl.col("s0") * pl.col("m")).sum().alias("__sm0"),
            (pl.col("c1") ** 2).sum().alias("__cc1"),
            (pl.col("c1") * pl.col("m")).sum().alias("__cm1"),
            (pl.col("s2") ** 2).sum().alias("__ss2"),
            (pl.col("c2") ** 2).sum().alias("__cc2"),
            (pl.col("s2") * pl.col("c2")).sum().alias("__sc2"),
        )
        .sort("l_returnflag", "l_linestatus")
    )
    assert got.height == want.height == 4
    for name in want.columns[2:]:
        a = got[name].cast(pl.Float64).to_numpy()
        b = want[name].cast(pl.Float64).to_numpy()
        assert np.allclose(a, b, rtol=1e-9), (name, a, b)


def simulate(tpch_duckdb, files, unit_sql, exact_sql, keys, aggs, seeds=100, share=0.1):
    """Coverage of the intervals after about ``share`` of the units' rows, over ``seeds``
    random orders of the units, through :func:`estimates.estimate_arrow`: (covered share of
    (group, aggregate) pairs, covered share among those flagged reliable, flagged share)."""
    units, _ = fact_units(files, 0, 0)
    t = per_unit(tpch_duckdb, unit_sql, units, files)
    m = np.array([u[4] for u in units], dtype=float)
    t = t.with_columns(pl.Series("m", m[t["unit"].to_numpy()]))
    exact = pl.from_arrow(tpch_duckdb.sql(exact_sql).to_arrow_table())
    total_rows, big_n = int(m.sum()), len(units)
    covered = reliable_total = reliable_covered = total = 0
    for seed in range(seeds):
        order = list(range(big_n))
        random.Random(seed).shuffle(order)
        read, rows = [], 0
        for u in order:
            if rows >= share * total_rows:
                break
            read.append(u)
            rows += int(m[u])
        part = t.filter(pl.col("unit").is_in(read))
        sums = [pl.len().cast(pl.Float64).alias(es.UNITS)]
        for j, a in enumerate(aggs):
            sums += [
                pl.col(f"{s}{j}").cast(pl.Float64).sum().alias(f"__{s}{j}")
                for s in es.NEEDS[a.kind]
            ]
            for p in es.PRODUCTS[a.kind]:
                x, y = (pl.col("m") if f == "m" else pl.col(f"{f}{j}").cast(pl.Float64) for f in p)
                sums.append((x * y).sum().alias(f"__{p}{j}"))
        state = part.group_by(keys).agg(sums).to_arrow()
        sample = es.Sample(len(read), big_n, rows, total_rows, float((m[read] ** 2).sum()))
        est = pl.from_arrow(es.estimate_arrow(state, keys, aggs, sample))
        j = est.join(exact, on=keys, how="inner", suffix="_exact")
        for a in aggs:
            truth = j[f"{a.name}_exact"].cast(pl.Float64)
            ok = ((j[f"{a.name}_low"] <= truth) & (truth <= j[f"{a.name}_high"])).fill_null(False)
            flag = j[f"{a.name}_reliable"]
            covered += int(ok.sum())
            total += j.height
            reliable_total += int(flag.sum())
            reliable_covered += int((ok & flag).sum())
    return covered / total, reliable_covered / max(reliable_total, 1), 1 - reliable_total / total


Q1_AGGS = [es.AggRef("qty", "sum"), es.AggRef("n", "len"), es.AggRef("disc", "mean")]
Q10_AGGS = [es.AggRef("revenue", "sum"), es.AggRef("n", "len")]


def test_q1_intervals_cover_the_truth_on_lineitem_as_stored_and_in_random_order(
    tpch_duckdb, tpch_data, tmp_path
):
    """lineitem as tpchgen stores it (by order): at least 93% of Q1's (group, aggregate)
    pairs inside their 95% interval after 10% of the rows, over 100 unit orders; the same on
    a copy in a random row order."""
    import pyarrow.parquet as pq

    files = parquet_files(tpch.table_paths(tpch_data)["lineitem"])
    exact = Q1.replace("lineitem", f"read_parquet([{', '.join(repr(f) for f in files)}])")
    keys = ["l_returnflag", "l_linestatus"]
    stored, _, _ = simulate(tpch_duckdb, files, Q1_UNIT, exact, keys, Q1_AGGS)
    assert stored >= 0.93, f"as stored: {stored:.3f}"
    rows = tpch_duckdb.sql(
        f"SELECT * FROM read_parquet([{', '.join(repr(f) for f in files)}]) ORDER BY hash(l_orderkey * 8 + l_linenumber)"
    )
    path = str(tmp_path / "random.parquet")
    pq.write_table(rows.to_arrow_table(), path, row_group_size=100_000)
    shuffled, _, _ = simulate(tpch_duckdb, [path], Q1_UNIT, exact, keys, Q1_AGGS)
    assert shuffled >= 0.93, f"random order: {shuffled:.3f}"


def test_clustered_groups_are_covered_or_flagged(tpch_duckdb, tpch_data):
    """A Q10 shape over a few customers, whose orders each lie in one unit: every estimate
    not flagged unreliable is inside its interval at least 90% of the time."""
    files = parquet_files(tpch.table_paths(tpch_data)["lineitem"])
    keys = ["c_nationkey", "l_returnflag"]
    _, reliable, flagged = simulate(tpch_duckdb, files, Q10_UNIT, Q10, keys, Q10_AGGS)
    assert reliable >= 0.90, f"reliable ones covered: {reliable:.3f} ({flagged:.2f} flagged)"


def test_a_real_run_flags_groups_seen_in_few_units_and_ends_exact(tpch_cluster, tpch_duckdb):
    """Q3 groups by order: each group lies in one unit, so every estimate before the end is
    flagged, and the final is exact with every flag true; Q1's groups are in every unit and
    are reliable from the first round on."""
    query, ordered = tpch.query(3, SF)
    results = list(tpch_cluster.online(query, rounds=4, seed=1, progress=False))
    for r in results[:-1]:
        assert not r.estimates["revenue_reliable"].any(), r.round
    final = results[-1].estimates
    assert final["revenue_reliable"].all()
    assert (final["revenue_low"] == final["revenue"]).all()
    cols = value_columns(final.columns)
    assert (
        tpch.compare(
            tpch_duckdb.sql(query).to_arrow_table(), final.select(cols).to_arrow(), ordered
        )
        is None
    )
    first = next(iter(tpch_cluster.online(tpch.query(1, SF)[0], rounds=4, seed=1, progress=False)))
    flags = [c for c in first.estimates.columns if c.endswith("_reliable")]
    assert first.estimates.select(flags).fill_null(True).to_numpy().all()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 10_000), st.floats(-1e4, 1e4), st.integers(1, 500)),
        min_size=2,
        max_size=40,
    ),
    st.integers(0, 60),
)
def test_the_estimator_equals_the_cluster_sampling_formulas(units, unread):
    """From the folded sums of products, the estimates and intervals equal the textbook
    ones computed from each unit's totals directly: SUM as M·Σs/Σm with the variance of
    s - r·m between units, AVG as Σs/Σc with that of s - R·c, a t quantile, the
    finite-population correction over units."""
    from scipy.stats import t as student

    m = np.array([u[0] for u in units], dtype=float)
    s = np.array([u[1] for u in units])
    c = np.array([u[2] for u in units], dtype=float)
    n, big_n = len(units), len(units) + unread
    total_rows = int(m.sum() * big_n / n)
    state = pa.table(
        {
            "__c0": [c.sum()],
            "__s0": [s.sum()],
            "__ss0": [(s * s).sum()],
            "__sm0": [(s * m).sum()],
            "__c1": [c.sum()],
            "__s1": [s.sum()],
            "__ss1": [(s * s).sum()],
            "__cc1": [(c * c).sum()],
            "__sc1": [(s * c).sum()],
            # A ratio SUM(s) / SUM(c): the same sums as the AVG's.
            "__c2": [c.sum()],
            "__s2": [s.sum()],
            "__ss2": [(s * s).sum()],
            "__cc2": [(c * c).sum()],
            "__sc2": [(s * c).sum()],
            "__n2": [float(m.sum())],  # the numerator's values: every row's
            es.UNITS: [float(n)],
        }
    )
    aggs = [es.AggRef("total", "sum"), es.AggRef("mean", "mean"), es.AggRef("share", "ratio")]
    sample = es.Sample(n, big_n, int(m.sum()), total_rows, float((m * m).sum()))
    got = es.estimate_arrow(state, [], aggs, sample).to_pylist()[0]
    fpc = 1 - n / big_n
    q = student.ppf(0.975, n - 1)
    r = s.sum() / m.sum()
    var = fpc * ((s - r * m) ** 2).sum() / (n - 1) / (n * m.mean() ** 2)
    scale = max(abs(s).max(), 1.0) * total_rows / m.mean()
    want = (total_rows * r, q * total_rows * np.sqrt(var))
    assert got["total"] == pytest.approx(want[0], rel=1e-9, abs=1e-9 * scale)
    half = (got["total_high"] - got["total_low"]) / 2
    assert half == pytest.approx(want[1], rel=1e-4, abs=1e-4 * scale) or fpc == 0
    big_r = s.sum() / c.sum()
    var = fpc * ((s - big_r * c) ** 2).sum() / (n - 1) / (n * c.mean() ** 2)
    assert got["mean"] == pytest.approx(big_r, rel=1e-9, abs=1e-12)
    half = (got["mean_high"] - got["mean_low"]) / 2
    tol = 1e-4 * max(abs(s).max(), 1.0) / c.mean()
    assert half == pytest.approx(q * np.sqrt(var), rel=1e-4, abs=tol) or fpc == 0
    for x in ("", "_low", "_high"):
        assert got[f"share{x}"] == got[f"mean{x}"], "a ratio of sums is estimated as an AVG"

    def spread(x: np.ndarray) -> bool:
        """The total over at least MIN_EFFECTIVE_UNITS units' worth: (Σx)² / Σx²."""
        return bool(
            (x * x).sum() > 0 and x.sum() * x.sum() >= es.MIN_EFFECTIVE_UNITS * (x * x).sum()
        )

    final = n == big_n
    assert got["total_reliable"] == (final or (n >= es.MIN_UNITS and spread(s)))
    assert got["mean_reliable"] == (final or (n >= es.MIN_UNITS and spread(c)))
    assert got["share_reliable"] == (final or (n >= es.MIN_UNITS and spread(s) and spread(c)))
