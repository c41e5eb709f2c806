"""HAVING over online estimates: ``having_certain`` says whether a group's HAVING holds for
every value within the intervals (``sql_plan.certain_condition``). Property test: over random
intervals and random HAVING conditions, a group called certain satisfies the condition at
every point of its intervals tried (corners and random points), and one the condition
certainly excludes satisfies it at none; evaluated by Polars SQL, as the online results are."""

from __future__ import annotations

import random

import polars as pl
import sqlglot
from flightshuffle.sql_plan import certain_condition
from hypothesis import given, settings
from hypothesis import strategies as st

AGGS = ("a", "b")


def conditions() -> st.SearchStrategy[str]:
    const = st.integers(-20, 20).map(str)
    term = st.sampled_from(['"a"', '"b"', '"a" + "b"', '"a" - "b"', '2 * "a"', "k"])
    op = st.sampled_from([">", ">=", "<", "<=", "=", "<>"])
    atom = st.one_of(
        st.builds(lambda t, o, c: f"{t} {o} {c}", term, op, const),
        st.builds(
            lambda t, lo, w: f"{t} BETWEEN {lo} AND {int(lo) + w}", term, const, st.integers(0, 9)
        ),
        st.builds(lambda c: f'ABS("a") > {c}', const),
    )
    return st.recursive(
        atom,
        lambda inner: st.one_of(
            st.builds(lambda x, y: f"({x}) AND ({y})", inner, inner),
            st.builds(lambda x, y: f"({x}) OR ({y})", inner, inner),
            st.builds(lambda x: f"NOT ({x})", inner),
        ),
        max_leaves=4,
    )


def interval() -> st.SearchStrategy[tuple[int, int]]:
    return st.tuples(st.integers(-15, 15), st.integers(0, 10)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(
    cond=conditions(),
    rows=st.lists(
        st.tuples(interval(), interval(), st.integers(-5, 5), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_a_certain_having_holds_everywhere_in_the_intervals(cond, rows, seed):
    tree = sqlglot.parse_one(cond, read="duckdb")
    certain = certain_condition(tree, set(AGGS)).sql(dialect="duckdb")
    frame = pl.DataFrame(
        {
            "k": [r[2] for r in rows],
            "a": [r[0][0] for r in rows],
            "a_low": [r[0][0] for r in rows],
            "a_high": [r[0][1] for r in rows],
            "a_reliable": [r[3] for r in rows],
            "b": [r[1][0] for r in rows],
            "b_low": [r[1][0] for r in rows],
            "b_high": [r[1][1] for r in rows],
            "b_reliable": [True for _ in rows],
        }
    )
    verdict = frame.sql(f"SELECT {certain} AS c FROM self")["c"].to_list()
    rng = random.Random(seed)
    for (ai, bi, k, _), v in zip(rows, verdict, strict=True):
        if v is None:
            continue
        points = [(ai[0], bi[0]), (ai[0], bi[1]), (ai[1], bi[0]), (ai[1], bi[1])]
        points += [(rng.randint(*ai), rng.randint(*bi)) for _ in range(8)]
        at = pl.DataFrame({"a": [p[0] for p in points], "b": [p[1] for p in points]})
        at = at.with_columns(k=pl.lit(k))
        held = at.sql(f"SELECT COALESCE({cond}, FALSE) AS h FROM self")["h"].to_list()
        assert all(h == v for h in held), (cond, certain, ai, bi, k, v, held)


def test_an_unreliable_interval_is_never_certain():
    tree = sqlglot.parse_one('"a" > 3', read="duckdb")
    certain = certain_condition(tree, {"a"}).sql(dialect="duckdb")
    frame = pl.DataFrame(
        {"a": [10, 10], "a_low": [9, 9], "a_high": [11, 11], "a_reliable": [True, False]}
    )
    assert frame.sql(f"SELECT {certain} AS c FROM self")["c"].to_list() == [True, None]
