"""Online aggregation cuts a broadcast build side down to the keys a join below it on the
fact table's path already allows (``engines/datafusion/src/build_keys.rs``, TPC-H Q9's
``partsupp`` by its green ``part`` keys). Real workers, real Parquet; the final answer equals
DuckDB's, and the cut shows in the plan as a semi join under that build side."""

from __future__ import annotations

import duckdb
import flightshuffle as fs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flightshuffle.estimates import value_columns
from flightshuffle_bench import tpch

PARTS = 30_000
SUPPLIERS = 11  # `ps` has PARTS x SUPPLIERS rows: over the 256 Ki a build side needs


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("build_keys")
    rng = np.random.default_rng(3)
    n = 2_000_000
    fact = pa.table(
        {
            "k": rng.integers(0, PARTS, n),
            "s": rng.integers(0, SUPPLIERS, n),
            "v": rng.integers(0, 100, n),
        }
    )
    keys = np.arange(PARTS)
    part = pa.table({"k": keys, "green": (keys * 7919) % 20 == 0})  # 5% of the parts
    ps = pa.table(
        {
            "k": np.repeat(keys, SUPPLIERS),
            "s": np.tile(np.arange(SUPPLIERS), PARTS),
            "cost": rng.integers(1, 50, PARTS * SUPPLIERS),
        }
    )
    out = {}
    for name, t in (("fact", fact), ("part", part), ("ps", ps)):
        path = root / f"{name}.parquet"
        pq.write_table(t, path, row_group_size=200_000)
        out[name] = str(path)
    return out


QUERY = """SELECT f.s % 3 AS b, COUNT(*) AS n, SUM(f.v * ps.cost) AS total
FROM part p, fact f, ps
WHERE p.k = f.k AND p.green AND ps.k = f.k AND ps.s = f.s
GROUP BY b ORDER BY b"""
# The upper join an anti join (NOT EXISTS over `ps`): its build side cut the same way.
ANTI = """SELECT f.s % 3 AS b, COUNT(*) AS n, SUM(f.v) AS total
FROM part p, fact f
WHERE p.k = f.k AND p.green
  AND NOT EXISTS (SELECT 1 FROM ps WHERE ps.k = f.k AND ps.s = f.s AND ps.cost > 2)
GROUP BY b ORDER BY b"""


@pytest.mark.parametrize("query", [QUERY, ANTI], ids=["inner", "anti"])
@pytest.mark.parametrize("narrow", [True, False])
def test_a_build_side_is_cut_to_the_keys_a_lower_join_allows(tables, narrow, query):
    with fs.Cluster(workers=2) as c:
        c.sql(f"SET flightshuffle.narrow_builds = {str(narrow).lower()}")
        results = list(c.online(query, rounds=3, seed=4, tables=tables, progress=False))
        plan = c.last_online_plan
    assert results[-1].final
    got = results[-1].estimates
    got = got.select(value_columns(got.columns)).to_arrow()
    con = duckdb.connect()
    for name, path in tables.items():
        con.sql(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{path}')")
    want = con.sql(query).to_arrow_table()
    assert tpch.compare(want, got, ordered=True) is None
    if not narrow:
        assert "join_type=RightSemi" not in plan, plan
        return
    # `ps` (330 K rows) is built only for the green parts: a semi join with `part`'s keys.
    semi = [line for line in plan.splitlines() if "join_type=RightSemi" in line]
    assert len(semi) == 1 and "ps.parquet" in plan, plan
    below = plan[plan.index(semi[0]) :]
    assert "ps.parquet" in below.split("Stage ")[0], plan
