"""An online SQL query planned into its statistics query (:func:`plan_sql`): per group, the
totals of each aggregate's argument a unit's rows give (count, sum, extreme), computed once
per distinct statistic, plus the products of a unit's totals the intervals need
(``SplitTotalsExec``'s terms); and how the folded statistics map back to the aggregates
(:func:`expand_stats`, :func:`emit_top`). The query's text is rewritten first
(:mod:`flightshuffle.rewrite`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from flightshuffle.estimates import DISTINCT_VALUE, NEEDS, PRODUCTS, UNITS, AggRef
from flightshuffle.rewrite import (
    inline_derived,
    kept_join,
    parse,
    ratio,
    scaled_aggregate,
    within,
)


@dataclass
class SqlPlan:
    table: str
    """The first table of FROM (the only one for the DuckDB map side)."""
    tables: list[str]
    """Every table the query reads, once per time it is read."""
    samplable: list[str]
    """The tables each result row holds one row of: not those a semi or anti join or a LEFT
    JOIN reads whole."""
    keys: list[str]
    aggs: list[AggRef]
    stats: str
    """The statistics query: per group, one column per distinct statistic (``stat_columns``)."""
    stat_columns: list[str]
    stat_of: dict[str, str]
    """Each aggregate's statistic ``__{stat}{j}`` -> the statistics query's column."""
    columns: list[str]
    order: list[tuple[str, bool]]
    limit: int | None
    having: str | None = None
    """A filter over the estimates (aggregates replaced by their output names)."""
    having_certain: str | None = None
    """TRUE where ``having`` holds for every value in the estimates' intervals, FALSE where
    it holds for none, NULL where the intervals straddle it (see :func:`certain_condition`)."""
    distinct: str | None = None
    """The name of a COUNT(DISTINCT x), the query's one aggregate: the statistics are then
    per group and value of ``x`` (the last key, ``__dv``), see
    :func:`flightshuffle.estimates.distinct_estimates`."""
    hidden: list[str] | None = None
    """Aggregates only HAVING uses: estimated, then dropped from the output."""
    selected: list[str] | None = None
    """Output columns in SELECT order (each aggregate followed by its interval)."""
    query: str = ""
    """The query's text (for its event log)."""
    terms: list[tuple[int, int]] = field(default_factory=list)
    """The products each unit appends to its statistics (``SplitTotalsExec``'s terms)."""
    term_of: dict[str, int] = field(default_factory=dict)
    """Each product column (:func:`product_columns`) -> its term."""


_SQL_KINDS = {"Sum": "sum", "Avg": "mean", "Count": "count", "Min": "min", "Max": "max"}


# DataFusion's CAST to DOUBLE with the same results, faster for decimals (registered by
# flightshuffle in every session, engines/datafusion/src/double.rs). Plans are cached: a
# change here reaches queries asked before only after ``_plan_sql.cache_clear()``.
TO_DOUBLE: str | None = "fs_to_double"


def as_double(e: Any, nested: bool = False, cast: str | None = None) -> Any:
    """``CAST(e AS DOUBLE)`` with the cast pushed down through ``+``, ``-``, ``*``, unary minus
    and parentheses to the operands: decimal arithmetic is done in DOUBLE instead of being
    cast row by row afterwards. TPC-H Q1's statistics query, single-process DataFusion at SF1:
    0.53 s with the casts outside, 0.35 s with them on the columns (Q1 itself 0.34 s). Not
    through ``/`` (integer division would become float division), functions or CASE: those
    are cast whole. Numeric literals inside the arithmetic stay as they are. With ``cast``,
    an operand that is not a literal is cast by that function instead (``fs_to_double``,
    DataFusion's ``CAST`` to DOUBLE, faster for decimals)."""
    from sqlglot import exp

    def double(x: Any) -> Any:
        if cast is None or not list(x.find_all(exp.Column)):
            return exp.Cast(this=x.copy(), to=exp.DataType.build("DOUBLE"))
        return exp.Anonymous(this=cast, expressions=[x.copy()])

    if not nested and not list(e.find_all(exp.Column)):
        # Literals only (SUM(1 + 1)): nothing to push the cast to.
        return double(e)
    if isinstance(e, exp.Paren):
        return exp.Paren(this=as_double(e.this, nested, cast))
    if isinstance(e, exp.Neg):
        return exp.Neg(this=as_double(e.this, nested, cast))
    if isinstance(e, (exp.Add, exp.Sub, exp.Mul)):
        return type(e)(
            this=as_double(e.this, True, cast), expression=as_double(e.expression, True, cast)
        )
    if nested and isinstance(e, exp.Literal) and e.is_number:
        return e.copy()
    return double(e)


def _never_null(e: Any, required: frozenset[str], tables: frozenset[str]) -> bool:
    """True when ``e`` is arithmetic (``+ - *``, casts, parentheses) over literals and
    columns in ``required`` only: it is never null. A column qualified by anything but one of
    the query's ``tables`` (or their aliases) may be a struct field: not known."""
    from sqlglot import exp

    if isinstance(e, exp.Column):
        if e.table and e.table not in tables:
            return False
        # DataFusion folds unquoted identifiers to lower case.
        return (e.name if e.this.quoted else e.name.lower()) in required
    if isinstance(e, exp.Literal):
        return True
    if isinstance(e, (exp.Paren, exp.Neg)) or (
        isinstance(e, exp.Cast) and not isinstance(e, exp.TryCast)
    ):
        return _never_null(e.this, required, tables)
    if isinstance(e, (exp.Add, exp.Sub, exp.Mul)):
        return _never_null(e.left, required, tables) and _never_null(e.right, required, tables)
    return False


def plan_sql(
    query: str, engine: str, never_null: Callable[[list[str]], set[str]] | None = None
) -> SqlPlan:
    """Rewrite ``SELECT keys, AGG(x) ... FROM tables [JOIN ...] [WHERE ...] GROUP BY keys
    [HAVING ...] [ORDER BY] [LIMIT]`` into the per-split statistics query. ``never_null``
    names the columns of the query's tables that hold no null: the count of an argument
    computed from those alone is ``COUNT(*)``, shared by all such aggregates (TPC-H Q1
    counts once instead of six times). Plans are kept: a query asked again is not rewritten
    again (15 ms for TPC-H Q10, on the way to its first split)."""
    from sqlglot import exp

    tree = parse(query, engine)
    tables = [t.name for t in tree.find_all(exp.Table)]
    # After an outer join a column of a table that holds no null can be NULL: none is known.
    outer = any(j.args.get("side") for j in tree.find_all(exp.Join))
    required = frozenset(never_null(tables) if never_null and not outer else ())
    return _plan_sql(query, engine, required)


@functools.lru_cache(maxsize=256)
def _plan_sql(query: str, engine: str, required: frozenset[str]) -> SqlPlan:
    import sqlglot
    from sqlglot import exp

    dialect = "duckdb" if engine == "duckdb" else None
    tree = inline_derived(parse(query, engine))

    def unsupported(what: str) -> ValueError:
        return ValueError(
            "online aggregation supports SELECT <group keys>, SUM/COUNT/AVG/MIN/MAX(<expr>) "
            "or SUM(<expr>) / SUM(<expr>) FROM <tables or one derived table> [JOIN ...] "
            f"[WHERE ...] GROUP BY <keys> [HAVING ...] [ORDER BY ...] [LIMIT n]; {what}"
        )

    def sql(e: exp.Expression) -> str:
        return e.sql(dialect=dialect)

    if not isinstance(tree, exp.Select):
        raise unsupported(f"got a {type(tree).__name__}")
    for arg in ("qualify", "windows", "distinct", "with_"):
        if tree.args.get(arg):
            raise unsupported(f"{arg.rstrip('_').upper()} is not supported")
    # [NOT] EXISTS tied by an equality stays for DataFusion: a semi or anti join
    # (rewrite.kept_join).
    kept = [e for e in tree.find_all(exp.Exists) if kept_join(e, tree)]
    if any(
        s is not tree and not any(within(s, a) for a in kept) for s in tree.find_all(exp.Select)
    ):
        raise unsupported("subqueries are not supported")
    # A LEFT JOIN's table is read whole, as its build side: each row of the tables before it
    # stays one result row, or several (its matches), or one with NULLs, decided by that
    # row and the whole table, so those rows can be sampled.
    whole = []
    for j in tree.args.get("joins") or []:
        kind = (j.args.get("kind") or "").upper()
        side = (j.args.get("side") or "").upper()
        if side == "LEFT" and kind in ("", "OUTER"):
            whole.append(j.this)
            continue
        if side or kind not in ("", "INNER", "CROSS"):
            raise unsupported(
                f"{sql(j).split(' ON ')[0].strip()}: only inner joins and LEFT JOINs keep "
                "every result row tied to one row of the fact table, which the estimates scale"
            )
    if engine == "duckdb" and kept:
        raise unsupported(
            "[NOT] EXISTS needs engine='datafusion' (DuckDB reads one table per split)"
        )
    if engine == "duckdb" and tree.args.get("joins"):
        raise unsupported("joins need engine='datafusion' (DuckDB reads one table per split)")
    source = tree.args.get("from_") or tree.args.get("from")
    if source is None:
        raise unsupported("there is no FROM clause")
    tables = [t.name for t in tree.find_all(exp.Table)]
    # The tables a result row holds one row of (those of a semi or anti join's subquery are read
    # whole, as its build side).
    samplable = [
        t.name
        for t in tree.find_all(exp.Table)
        if not any(within(t, a) for a in kept) and not any(t is w for w in whole)
    ]
    if not isinstance(source.this, exp.Table) or any(
        not isinstance(j.this, exp.Table) for j in tree.args.get("joins") or []
    ):
        raise unsupported("FROM and JOIN must name tables (no subqueries)")
    table = source.this.name
    named = frozenset(n for t in tree.find_all(exp.Table) for n in (t.name, t.alias_or_name))
    to_double = TO_DOUBLE if engine == "datafusion" else None
    group = list(tree.args["group"].expressions) if tree.args.get("group") else []
    # GROUP BY may name a selected column by its alias or its position.
    items = [(i.alias_or_name, i.this if isinstance(i, exp.Alias) else i) for i in tree.expressions]
    aliases = {alias: sql(e) for alias, e in items if alias}

    def group_key(g: exp.Expression) -> str:
        if isinstance(g, exp.Literal) and g.is_int and 1 <= int(g.name) <= len(items):
            return sql(items[int(g.name) - 1][1])
        if isinstance(g, exp.Column) and not g.table and g.name in aliases:
            return aliases[g.name]
        return sql(g)

    group_sql = [group_key(g) for g in group]
    keys: list[str] = []
    key_exprs: list[str] = []
    aggs: list[AggRef] = []
    # Each distinct statistic is computed once (DataFusion would merge duplicates anyway, and
    # the folded columns are matched by position).
    stat_items: dict[str, str] = {}
    stat_of: dict[str, str] = {}
    # Inner projection: each distinct argument evaluated once per row (cast to DOUBLE for the
    # sums; as is for MIN/MAX), then aggregated by the outer query.
    evaluated: dict[str, str] = {}

    def column(text: str) -> str:
        return f'"{evaluated.setdefault(text, f"__x{len(evaluated)}")}"'

    def add_agg(node: exp.Expression, name: str) -> None:
        kind = _SQL_KINDS.get(type(node).__name__)
        if kind is None or isinstance(node.this, exp.Distinct) or node.args.get("distinct"):
            raise unsupported(f"{sql(node)} is not a plain SUM/COUNT/AVG/MIN/MAX")
        star = isinstance(node.this, exp.Star)
        if kind == "count" and star:
            kind = "len"
        j = len(aggs)
        aggs.append(AggRef(name, kind))
        arg = "" if star else sql(node.this)
        if arg and list(node.this.find_all(exp.AggFunc)):
            raise unsupported(f"{sql(node)} nests aggregates")
        for stat in NEEDS[kind]:
            if stat == "m":
                expr = f"{kind.upper()}({column(f'({arg})')})"
            elif kind == "len" or (stat == "c" and _never_null(node.this, required, named)):
                expr = "COUNT(*)"
            else:
                x = column(sql(as_double(node.this, cast=to_double)))
                expr = {"c": f"COUNT({x})", "s": f"SUM({x})"}[stat]
            col = stat_items.setdefault(expr, f"__u{len(stat_items)}")
            stat_of[f"__{stat}{j}"] = col

    def add_ratio(num: exp.Expression, den: exp.Expression, name: str) -> None:
        # Estimated as an AVG is: ``s`` the numerator's sum, ``c`` the denominator's.
        j = len(aggs)
        aggs.append(AggRef(name, "ratio"))
        for stat, e in (("s", num), ("c", den)):
            if list(e.find_all(exp.AggFunc)):
                raise unsupported(f"{sql(e)} nests aggregates")
            x = column(sql(as_double(e, cast=to_double)))
            col = stat_items.setdefault(f"SUM({x})", f"__u{len(stat_items)}")
            stat_of[f"__{stat}{j}"] = col
            if stat == "s":  # the numerator's values: none gives NULL, as in SQL
                col = stat_items.setdefault(f"COUNT({x})", f"__u{len(stat_items)}")
                stat_of[f"__n{j}"] = col

    outputs: dict[str, str] = {}
    selected: list[str] = []
    distinct: list[tuple[str, str]] = []  # (name, the value's expression)
    for item in tree.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        # Unnamed: the text, function names in lower case (as DuckDB names `sum(x)`).
        # (`COUNT(*)`'s alias_or_name is its star, which names every column.)
        name = item.alias_or_name if item.alias_or_name != "*" else ""
        name = name or inner.sql(dialect=dialect, normalize_functions="lower")
        if not list(inner.find_all(exp.AggFunc)):
            if sql(inner) not in group_sql:
                raise unsupported(f"{sql(inner)} is neither an aggregate nor a GROUP BY key")
            keys.append(name)
            key_exprs.append(sql(inner))
            selected.append(name)
            continue
        selected += [name, f"{name}_low", f"{name}_high", f"{name}_reliable"]
        parts = ratio(inner)
        if parts is not None:
            add_ratio(*parts, name)
            outputs[sql(inner)] = name
            continue
        if isinstance(inner, exp.Count) and isinstance(inner.this, exp.Distinct):
            values = inner.this.expressions
            if len(values) != 1 or list(values[0].find_all(exp.AggFunc)):
                raise unsupported(f"{sql(inner)}: COUNT(DISTINCT) of one expression")
            distinct.append((name, sql(values[0])))
            aggs.append(AggRef(name, "len"))
            stat_of["__c0"] = stat_items.setdefault("COUNT(*)", f"__u{len(stat_items)}")
            outputs[sql(inner)] = name
            continue
        one = scaled_aggregate(inner)
        if one is not None:
            outputs[sql(inner)] = name
            inner = one
        if not isinstance(inner, exp.AggFunc):
            raise unsupported(
                f"{sql(inner)} computes over aggregates: of those only a ratio of two sums, "
                "SUM(a) / SUM(b), either times a number, and a SUM or AVG times or over a "
                "number have an interval here; select the "
                "aggregates and compute it from the estimates"
            )
        add_agg(inner, name)
        outputs[sql(inner)] = name
    if not aggs:
        raise unsupported("there is no aggregate")
    if distinct and any(k.startswith("__") for k in keys):
        raise unsupported("with COUNT(DISTINCT), group keys may not be named __...")
    if distinct and engine == "duckdb":
        raise unsupported("COUNT(DISTINCT) needs engine='datafusion'")
    if distinct and (len(aggs) > 1 or tree.args.get("having") is not None):
        raise unsupported(
            "COUNT(DISTINCT) must be the query's only aggregate, without HAVING (its "
            "statistics are per value, not per group)"
        )
    for g in group_sql:
        if g not in key_exprs:
            raise unsupported(f"GROUP BY key {g} must be selected")
    # HAVING: a filter over the estimates; aggregates it names that are not selected are
    # estimated too, under hidden names.
    having = having_certain = None
    hidden: list[str] = []
    if tree.args.get("having") is not None:
        cond = tree.args["having"].this.copy()
        for node in list(cond.find_all(exp.AggFunc)):
            text = sql(node)
            if text not in outputs:
                outputs[text] = f"__having{len(hidden)}"
                hidden.append(outputs[text])
                add_agg(node, outputs[text])
            node.replace(exp.column(outputs[text], quoted=True))
        having = cond.sql(dialect="duckdb")
        names = {a.name for a in aggs}
        having_certain = certain_condition(cond, names).sql(dialect="duckdb")
        selected.append(HAVING_CERTAIN)
    projected = [f'{e} AS "{k}"' for e, k in zip(key_exprs, keys, strict=True)]
    projected += [f'{text} AS "{c}"' for text, c in evaluated.items()]
    shown_keys = list(keys)
    if distinct:
        # Per group and value: a value's count over the units read says whether it was
        # seen once (see estimates.distinct_estimates).
        projected.append(f'{distinct[0][1]} AS "{DISTINCT_VALUE}"')
        keys = keys + [DISTINCT_VALUE]
    inner_tree = tree.copy()
    for arg in ("group", "order", "limit", "having", "offset"):
        inner_tree.set(arg, None)
    inner_tree.set(
        "expressions", [sqlglot.parse_one(p, read=dialect) for p in projected or ["1 AS __one"]]
    )
    inner_sql = sql(inner_tree)
    outer_keys = [f'"{k}"' for k in keys]
    items = [f'{e} AS "{c}"' for e, c in stat_items.items()]
    stats = f"SELECT {', '.join(outer_keys + items)} FROM ({inner_sql}) AS __split"
    if keys:
        stats += f" GROUP BY {', '.join(outer_keys)}"
    keys, stats_keys = shown_keys, keys
    order: list[tuple[str, bool]] = []
    if tree.args.get("order"):
        names = keys + [a.name for a in aggs]
        for o in tree.args["order"].expressions:
            by = o.this
            # ORDER BY may name a selected column by its position.
            selects = tree.expressions
            if isinstance(by, exp.Literal) and by.is_int and 1 <= int(by.name) <= len(selects):
                by = selects[int(by.name) - 1]
            target = by.alias_or_name
            if isinstance(by, exp.AggFunc) and sql(by) in outputs:
                target = outputs[sql(by)]
            if target not in names:
                raise unsupported(f"ORDER BY {sql(o.this)} must name a selected column")
            order.append((target, bool(o.args.get("desc"))))
    limit = None
    if tree.args.get("limit") is not None:
        limit = int(tree.args["limit"].expression.name)
    columns = sorted({c.name for c in tree.find_all(exp.Column)})
    terms, term_of = _terms(aggs, list(stat_items.values()), stat_of)
    return SqlPlan(
        table,
        tables,
        samplable,
        stats_keys,
        aggs,
        stats,
        list(stat_items.values()),
        stat_of,
        columns,
        order,
        limit,
        having=having,
        having_certain=having_certain,
        distinct=distinct[0][0] if distinct else None,
        hidden=hidden,
        selected=selected,
        query=query,
        terms=terms,
        term_of=term_of,
    )


# Factors of a term that are not statistics (see split_totals.rs).
SIZE, ONE = 2**32 - 1, 2**32 - 2


def _terms(
    aggs: list[AggRef], stat_columns: list[str], stat_of: dict[str, str]
) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The products of a unit's totals the intervals need, each once: factor pairs (a
    statistic's column index, or SIZE), and each product column's term."""
    terms: list[tuple[int, int]] = []
    term_of: dict[str, int] = {}

    def factor(f: str, j: int) -> int:
        return SIZE if f == "m" else stat_columns.index(stat_of[f"__{f}{j}"])

    def add(name: str, pair: tuple[int, int]) -> None:
        pair = (min(pair), max(pair))
        if pair not in terms:
            terms.append(pair)
        term_of[name] = terms.index(pair)

    for j, a in enumerate(aggs):
        for p in PRODUCTS[a.kind]:
            add(f"__{p}{j}", (factor(p[0], j), factor(p[1], j)))
    add(UNITS, (ONE, ONE))
    return terms, term_of


def expand_stats(table: pa.Table, plan: SqlPlan) -> pa.Table:
    """Folded statistics (keys, the statistics query's columns, then the terms' sums, by
    position) as the per-aggregate columns ``__{stat}{j}`` and product columns that
    :func:`combine` and :func:`estimate` read. A statistics query run whole (one final
    result) has no terms."""
    stats = len(plan.keys) + len(plan.stat_columns)
    terms = [f"__term{k}" for k in range(len(plan.terms))]
    if table.num_columns not in (stats, stats + len(terms)):
        raise RuntimeError(
            f"online aggregation: the folded statistics have {table.num_columns} columns, "
            f"expected {stats + len(terms)}"
        )
    with_terms = table.num_columns > stats
    table = table.rename_columns(plan.keys + plan.stat_columns + (terms if with_terms else []))
    cols = {k: table.column(k) for k in plan.keys}
    cols |= {s: table.column(c) for s, c in plan.stat_of.items()}
    if with_terms:
        cols |= {name: table.column(terms[k]) for name, k in plan.term_of.items()}
    return pa.table(cols)


def distinct_counts(plan: SqlPlan) -> tuple[int, int, int] | None:
    """For a COUNT(DISTINCT): how many group keys the folded statistics start with, the
    value's column and its rows' column, so that each fold sends the counts per group
    (:data:`flightshuffle.estimates.DISTINCT_COUNTS`) instead of its state per group and
    value; None otherwise."""
    if not plan.distinct:
        return None
    width = len(plan.keys)  # the group keys, then the value
    return (width - 1, width - 1, width + plan.stat_columns.index(plan.stat_of["__c0"]))


def emit_top(plan: SqlPlan) -> tuple[int, int | None, bool, bool, int] | None:
    """For ``ORDER BY x ... LIMIT k`` without HAVING: which folded column orders the
    estimates by ``x`` (column, divisor for an AVG, a null SUM counted as 0), descending, and
    k; the workers then send only the groups that can be among the first k of every round.
    None when every group is needed (no LIMIT, a HAVING filter over the estimates)."""
    if plan.limit is None or plan.having or not plan.order or plan.distinct:
        return None
    name, desc = plan.order[0]
    width = len(plan.keys)
    if name in plan.keys:
        return (plan.keys.index(name), None, False, desc, plan.limit)
    j = next((i for i, a in enumerate(plan.aggs) if a.name == name), None)
    if j is None:
        return None

    def at(stat: str) -> int:
        return width + plan.stat_columns.index(plan.stat_of[f"__{stat}{j}"])

    kind = plan.aggs[j].kind
    if kind == "sum":
        return (at("s"), None, True, desc, plan.limit)
    if kind == "mean":
        return (at("s"), at("c"), True, desc, plan.limit)
    if kind == "ratio":
        # Denominators may be negative or zero: every group is sent.
        return None
    if kind in ("count", "len"):
        return (at("c"), None, False, desc, plan.limit)
    if kind in ("min", "max"):
        return (at("m"), None, False, desc, plan.limit)
    return None


HAVING_CERTAIN = "having_certain"
"""The output column saying whether a group's HAVING holds whatever the true values within
the intervals are (true), or only at the estimates (false)."""


def certain_condition(cond: Any, aggregates: set[str]) -> Any:
    """``cond`` (a HAVING over the estimates' columns) in three-valued logic over their
    intervals: each comparison reading aggregates is TRUE when it holds at every corner of
    their intervals (each aggregate at its ``_low`` or ``_high``), FALSE when at none, NULL
    otherwise or when an interval is missing or flagged unreliable; AND, OR and NOT then
    combine these as SQL does. Exact for comparisons whose sides are monotone in each aggregate
    (sums and differences of aggregates, keys and constants, times or over a constant); ``=``
    and ``<>``, and any other use of an aggregate (``ABS``, a product of two aggregates), are
    certain only once every interval it reads has zero width."""
    from sqlglot import exp

    monotone = (exp.GT, exp.GTE, exp.LT, exp.LTE)

    def refs(e: exp.Expression) -> list[str]:
        return sorted({c.name for c in e.find_all(exp.Column) if c.name in aggregates})

    def at(e: exp.Expression, corner: dict[str, str]) -> exp.Expression:
        def swap(n: exp.Expression) -> exp.Expression:
            if isinstance(n, exp.Column) and n.name in corner:
                return exp.column(n.name + corner[n.name], quoted=True)
            return n

        return e.copy().transform(swap)

    def col(name: str) -> exp.Expression:
        return exp.column(name, quoted=True)

    def usable(names: list[str]) -> exp.Expression:
        return exp.and_(*(col(f"{n}_reliable") for n in names))

    def linear(e: exp.Expression) -> bool:
        # Sums and differences of aggregates, keys and constants, times or over a constant:
        # monotone in each aggregate, so its extremes over the intervals are at corners.
        if isinstance(e, (exp.Column, exp.Literal)):
            return True
        if isinstance(e, (exp.Paren, exp.Neg)):
            return linear(e.this)
        if isinstance(e, (exp.Add, exp.Sub)):
            return linear(e.this) and linear(e.expression)
        if isinstance(e, exp.Mul):
            one_side = not refs(e.this) or not refs(e.expression)
            return one_side and linear(e.this) and linear(e.expression)
        if isinstance(e, exp.Div):
            return not refs(e.expression) and linear(e.this) and linear(e.expression)
        return False

    def atom(e: exp.Expression) -> exp.Expression:
        names = refs(e)
        sides = (e.this, e.expression) if isinstance(e, monotone) else ()
        if sides and all(linear(x) for x in sides) and len(names) <= 4:
            corners = [
                at(e, dict(zip(names, pick, strict=True)))
                for pick in itertools.product(("_low", "_high"), repeat=len(names))
            ]
            held = exp.and_(*corners)
            missed = exp.not_(exp.or_(*corners))
            return exp.Case(
                ifs=[
                    exp.If(this=exp.not_(usable(names)), true=exp.null()),
                    exp.If(this=held, true=exp.true()),
                    exp.If(this=missed, true=exp.false()),
                ]
            )
        # Not monotone: certain once every interval it reads is a point.
        points = exp.and_(
            *(exp.EQ(this=col(f"{n}_low"), expression=col(f"{n}_high")) for n in names)
        )
        return exp.Case(ifs=[exp.If(this=exp.and_(usable(names), points), true=at(e, {}))])

    def walk(e: exp.Expression) -> exp.Expression:
        if not refs(e):
            return e.copy()
        if isinstance(e, exp.Paren):
            return exp.Paren(this=walk(e.this))
        if isinstance(e, exp.Not):
            return exp.not_(walk(e.this))
        if isinstance(e, (exp.And, exp.Or)):
            return type(e)(this=walk(e.this), expression=walk(e.expression))
        if isinstance(e, exp.Between):
            low = exp.GTE(this=e.this.copy(), expression=e.args["low"].copy())
            high = exp.LTE(this=e.this.copy(), expression=e.args["high"].copy())
            return exp.Paren(this=exp.and_(walk(low), walk(high)))
        return atom(e)

    return walk(cond)
