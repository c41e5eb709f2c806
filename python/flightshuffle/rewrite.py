"""Rewrites of an online query's text before it is planned (``sql_plan.plan_sql``):

* a derived table that only computes columns is read as the query it stands for
  (:func:`inline_derived`);
* ``[k *] SUM(a) / SUM(b)`` is recognised as a ratio of two sums (:func:`ratio`);
* uncorrelated subqueries in WHERE and HAVING run exactly first, on the cluster, and are
  replaced by their values (:func:`resolve_subqueries`): the rest of the query streams.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pyarrow as pa

# An IN subquery is replaced by the list of its values up to this many.
MAX_IN_VALUES = 10_000


def inline_derived(tree: Any) -> Any:
    """``SELECT ... FROM (SELECT <exprs> AS <names> FROM ... WHERE ...) AS t [WHERE ...] GROUP
    BY ...`` (TPC-H Q7, Q8, Q9) as the one query it stands for: the derived table's names
    replaced by its expressions, its FROM, joins and WHERE taken over. Anything else (a derived
    table that aggregates, filters on its own aggregates, is joined) is returned as it is."""
    from sqlglot import exp

    source = tree.args.get("from_") or tree.args.get("from")
    if not isinstance(tree, exp.Select) or source is None:
        return tree
    derived = source.this
    if not isinstance(derived, exp.Subquery) or tree.args.get("joins"):
        return tree
    alias_columns = derived.args.get("alias") and derived.args["alias"].columns
    inner = derived.this
    if (
        alias_columns
        or not isinstance(inner, exp.Select)
        or any(
            inner.args.get(a)
            for a in (
                "group",
                "having",
                "distinct",
                "limit",
                "order",
                "qualify",
                "windows",
                "with_",
            )
        )
    ):
        return tree  # (names from the alias's column list are not mapped: refused later)
    # Subqueries of its WHERE move with it, untouched (they read its tables, not its names).
    where_of_inner = inner.args.get("where")
    if any(
        s is not inner and not within(s, where_of_inner) for s in inner.find_all(exp.Select)
    ) or any(not within(a, where_of_inner) for a in inner.find_all(exp.AggFunc)):
        return tree
    # A subquery of the outer query would see the derived table's names replaced too.
    if any(s is not tree and not within(s, inner) for s in tree.find_all(exp.Select)):
        return tree
    alias = derived.alias_or_name

    def key(name: str, quoted: bool) -> str:
        # Unquoted identifiers match whatever their case (DataFusion and DuckDB fold them).
        return name if quoted else name.lower()

    names = {}
    for e in inner.expressions:
        ident = e.args["alias"] if isinstance(e, exp.Alias) else e.args.get("this")
        quoted = bool(getattr(ident, "quoted", False))
        names[key(e.alias_or_name, quoted)] = e.this if isinstance(e, exp.Alias) else e
    outputs = {key(i.alias_or_name, False) for i in tree.expressions if i.alias_or_name}

    def derived_column(node: Any, order: bool = False) -> bool:
        if not isinstance(node, exp.Column) or node.table not in ("", alias):
            return False
        k = key(node.name, node.this.quoted)
        # ORDER BY names the outer query's output columns first.
        return k in names and not (order and not node.table and key(node.name, False) in outputs)

    def put(node: Any, order: bool = False) -> Any:
        if derived_column(node, order):
            body = names[key(node.name, node.this.quoted)].copy()
            return exp.Paren(this=body) if isinstance(body, (exp.Binary, exp.Case)) else body
        return node

    out = tree.copy()
    items = []
    for item in out.expressions:
        body = (item.this if isinstance(item, exp.Alias) else item).transform(put)
        if isinstance(item, exp.Alias):
            ident = item.args["alias"].copy()
        elif isinstance(item, exp.Column):
            ident = item.this.copy()
        else:  # unnamed: the name it had (function names in lower case, as DuckDB's)
            ident = exp.to_identifier(item.sql(normalize_functions="lower"), quoted=True)
        items.append(exp.Alias(this=body, alias=ident))
    out.set("expressions", items)
    for arg in ("group", "having"):
        if out.args.get(arg) is not None:
            out.set(arg, out.args[arg].transform(put))
    if out.args.get("order") is not None:
        out.set("order", out.args["order"].transform(lambda n: put(n, order=True)))
    where = inner.args.get("where")
    if out.args.get("where") is not None:
        cond = out.args["where"].this.transform(put)
        where = exp.Where(this=exp.and_(where.this, cond) if where else cond)
    out.set("where", where.copy() if where else None)
    out.set(
        "from_" if "from_" in out.args else "from",
        (inner.args.get("from_") or inner.args.get("from")).copy(),
    )
    out.set("joins", [j.copy() for j in inner.args.get("joins") or []] or None)
    return out


def scaled_aggregate(e: Any) -> Any | None:
    """``SUM(x) * k``, ``k * SUM(x)`` (a numeric literal ``k``) or ``SUM(x) / k`` (``k``
    written with a decimal point, TPC-H Q17's ``SUM(l_extendedprice) / 7.0``), also AVG, as
    the one aggregate ``SUM(x * k)`` or ``SUM(CAST(x AS DOUBLE) / k)``; None for anything
    else (an integer divisor: ``SUM(int) / 7`` divides integers once, not each row)."""
    from sqlglot import exp

    def strip(x: Any) -> Any:
        while isinstance(x, exp.Paren):
            x = x.this
        return x

    e = strip(e)
    if not isinstance(e, (exp.Mul, exp.Div)):
        return None
    a, b = strip(e.this), strip(e.expression)
    if isinstance(e, exp.Mul) and isinstance(a, exp.Literal):
        a, b = b, a
    if not (isinstance(a, (exp.Sum, exp.Avg)) and isinstance(b, exp.Literal) and b.is_number):
        return None
    if isinstance(a.this, exp.Distinct):
        return None
    if isinstance(e, exp.Div):
        # SUM(int) / 7 divides integers once, SUM(x / 7) each row: only a divisor written as
        # a decimal (7.0) is taken, and the rows are divided as doubles (no per-row rounding).
        if not b.is_number or b.is_int:
            return None
        arg = exp.Cast(this=a.this.copy(), to=exp.DataType.build("DOUBLE"))
        return type(a)(this=exp.Div(this=arg, expression=b.copy()))
    arg = exp.Paren(this=a.this.copy())
    return type(a)(this=exp.Mul(this=arg, expression=b.copy()))


def within(node: Any, ancestor: Any) -> bool:
    """Whether ``node`` is ``ancestor`` or below it (False for no ancestor)."""
    while ancestor is not None and node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def ratio(e: Any) -> tuple[Any, Any] | None:
    """``SUM(a) / SUM(b)``, either sum or the quotient times a numeric literal ``k`` (TPC-H
    Q8, Q14: ``100.00 * SUM(a) / SUM(b)``): the sums' arguments, ``k`` moved into the
    numerator; None for anything else."""
    from sqlglot import exp

    def strip(x: Any) -> Any:
        while isinstance(x, exp.Paren):
            x = x.this
        return x

    def literal(x: Any) -> bool:
        return isinstance(x, exp.Literal) and x.is_number

    def scaled(x: Any, inner: type) -> tuple[Any, Any] | None:
        """``x`` as (k or None, an ``inner`` node)."""
        x = strip(x)
        if isinstance(x, inner):
            return None, x
        if isinstance(x, exp.Mul):
            a, b = strip(x.this), strip(x.expression)
            if literal(a) and isinstance(b, inner):
                return a, b
            if literal(b) and isinstance(a, inner):
                return b, a
        return None

    whole = scaled(e, exp.Div)
    if whole is None:
        return None
    k, div = whole
    num, den = scaled(div.this, exp.Sum), scaled(div.expression, exp.Sum)
    if num is None or den is None or den[0] is not None:
        return None
    sums = (num[1], den[1])
    if any(x.args.get("distinct") or isinstance(x.this, exp.Distinct) for x in sums):
        return None
    top = sums[0].this.copy()
    for factor in (f for f in (num[0], k) if f is not None):
        top = exp.Mul(this=factor.copy(), expression=exp.Paren(this=top))
    return top, sums[1].this.copy()


def _literal(value: Any, t: pa.DataType) -> Any:
    """A value of an Arrow column of type ``t`` as a SQL literal of the same type."""
    from sqlglot import exp

    if value is None:
        return exp.Null()
    if pa.types.is_boolean(t):
        return exp.true() if value else exp.false()
    if pa.types.is_integer(t):
        return exp.Literal.number(int(value))
    if pa.types.is_floating(t) and math.isfinite(value):
        return exp.Literal.number(repr(float(value)))
    if pa.types.is_decimal(t):
        to = exp.DataType.build(f"DECIMAL({t.precision}, {t.scale})")
        return exp.Cast(this=exp.Literal.string(str(value)), to=to)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return exp.Literal.string(value)
    if pa.types.is_date(t):
        return exp.Cast(this=exp.Literal.string(value.isoformat()), to=exp.DataType.build("DATE"))
    raise ValueError(f"a subquery's value {value!r} of type {t} cannot be written into the query")


def _conjunct(node: Any, where: Any) -> bool:
    """Whether ``node`` is one of the ANDed conditions of ``where`` (not under OR or NOT)."""
    from sqlglot import exp

    p = node.parent
    while p is not where:
        if p is None or not isinstance(p, (exp.And, exp.Paren)):
            return False
        p = p.parent
    return True


def _selecting(select: Any, column: Any) -> str:
    """``select`` reading only ``column``, no rows (``LIMIT 0``): a probe that runs when the
    column is one ``select``'s tables have."""
    from sqlglot import exp

    probe = select.copy()
    probe.set("expressions", [column.copy()])
    probe.set("limit", exp.Limit(expression=exp.Literal.number(0)))
    return probe.sql()


def _conditions(select: Any) -> list:
    """The ANDed conditions of ``select``'s WHERE."""
    from sqlglot import exp

    conds = select.args["where"].this
    return list(conds.flatten()) if isinstance(conds, exp.And) else [conds]


def _column_equality(c: Any) -> bool:
    """Whether ``c`` is ``column = column``."""
    from sqlglot import exp

    return isinstance(c, exp.EQ) and all(isinstance(x, exp.Column) for x in (c.this, c.expression))


def _as_in(exists: Any, runs: Callable[[str], bool]) -> Any | None:
    """``EXISTS (SELECT ... FROM ... WHERE inner = outer AND <rest>)`` as ``outer IN (SELECT
    inner FROM ... WHERE <rest>)`` (the same rows where it is one of the ANDed conditions of a
    WHERE); None when no equality ties one inner column to one outer column. ``runs`` says
    whether a query runs: a column the subquery's own tables do not have is the outer one."""
    from sqlglot import exp

    select = exists.this
    if not isinstance(select, exp.Select) or select.args.get("where") is None:
        return None
    # LIMIT, OFFSET, GROUP BY, HAVING or an aggregate change which rows exist: not an IN.
    if any(select.args.get(a) for a in ("limit", "offset", "group", "having", "qualify")):
        return None
    if any(e.find(exp.AggFunc) for e in select.expressions):
        return None
    conds = _conditions(select)
    bare = select.copy()
    bare.set("where", None)
    for i, c in enumerate(conds):
        if not _column_equality(c):
            continue
        base = select.copy()
        rest = conds[:i] + conds[i + 1 :]
        base.set("where", exp.Where(this=exp.and_(*[r.copy() for r in rest])) if rest else None)
        for inner, outer in ((c.this, c.expression), (c.expression, c.this)):
            if not runs(_selecting(base, inner)):
                continue
            if runs(_selecting(bare, outer)):
                continue  # both sides are the subquery's own columns
            query = base.copy()
            query.set("expressions", [inner.copy()])
            return exp.In(this=outer.copy(), query=exp.Subquery(this=query))
    return None


def kept_join(
    exists: Any, tree: Any, runs: Callable[[str], bool] | None = None, over_outer: bool = False
) -> bool:
    """Whether ``exists`` is ``[NOT] EXISTS (SELECT ... WHERE inner = outer AND ...)``, one of
    the ANDed conditions of ``tree``'s WHERE, kept for DataFusion to plan as a semi or anti
    join that keeps or drops each row of the outer query. The online plan builds on the
    subquery's rows, so the fact table's rows still stream through it; where the subquery's
    table is stored in the fact table's key order, each sampling unit reads only the rows its
    keys can meet (``unit_builds``: TPC-H Q4's ``lineitem`` in ``orders``' order). With
    ``runs``, the equality must tie one of its own columns to one of the outer query's (as
    :func:`_as_in` finds it), and a positive ``EXISTS`` must read none of the outer query's
    tables (such an ``EXISTS`` becomes an ``IN`` run first, whose distinct keys are fewer than
    the rows a semi join builds on), unless ``over_outer``: for an ``EXISTS`` no ``IN`` can
    say (TPC-H Q21's ``l2.l_suppkey <> l1.l_suppkey``), whose tables the online plan reads
    whole, the sampled table too. Other conditions may read the outer query too: a filter of
    the join."""
    from sqlglot import exp

    where = tree.args.get("where")
    negated = isinstance(exists.parent, exp.Not)
    node = exists.parent if negated else exists
    if where is None or not _conjunct(node, where):
        return False
    select = exists.this
    if not isinstance(select, exp.Select) or select.args.get("where") is None:
        return False
    if any(select.args.get(a) for a in ("limit", "offset", "group", "having", "qualify")):
        return False
    # An aggregate without GROUP BY always gives a row: EXISTS is then true throughout.
    if any(e.find(exp.AggFunc) for e in select.expressions):
        return False
    if runs is None:
        return any(_column_equality(c) for c in _conditions(select))
    if not negated and not over_outer:
        outer: set[str] = set()
        for a in ("from_", "from", "joins"):
            parts = tree.args.get(a) or []
            for part in parts if isinstance(parts, list) else [parts]:
                outer |= {t.name for t in part.find_all(exp.Table)}
        if outer & {t.name for t in select.find_all(exp.Table)}:
            return False
    # Tied by an equality of one of its own columns with one of the outer query's.
    bare = select.copy()
    bare.set("where", None)
    return any(
        _column_equality(c)
        and runs(_selecting(bare, c.this)) != runs(_selecting(bare, c.expression))
        for c in _conditions(select)
    )


# Functions whose value may differ between the restriction's run and the outer query's.
_VOLATILE_NAMES = {"now", "random", "rand", "uuid", "gen_random_uuid", "current_timestamp"}


def _volatile(node: Any) -> bool:
    """Whether ``node`` calls a random or clock function (its value differs between runs)."""
    from sqlglot import exp

    kinds = (exp.Rand, exp.Uuid, exp.CurrentTimestamp, exp.CurrentDate, exp.CurrentTime)
    if node.find(*kinds):
        return True
    return any(f.name.lower() in _VOLATILE_NAMES for f in node.find_all(exp.Anonymous))


def _only_kept_keys(
    per_key: Any, keys: list, where: Any, compare: Any, outer_from: Any, runs: Callable
) -> Any:
    """``per_key`` (``SELECT inner AS __key0, ... GROUP BY inner``) restricted to the keys an
    outer row can still have: for each key whose outer column comes from a table the
    subquery does not read, ``inner IN (SELECT outer FROM <that table> WHERE <the outer
    WHERE's ANDed conditions on that table alone>)``. An outer row that fails those
    conditions is dropped whatever its key's value, so its key's row is not needed (TPC-H
    Q17: the average quantity of the 0.1% of parts of one brand and container, not of all
    parts). Unchanged where no such condition exists."""
    from sqlglot import exp

    if outer_from is None:
        return per_key
    ours = {t.name for t in per_key.find_all(exp.Table)}
    conds = [c for c in (where.this.flatten() if isinstance(where.this, exp.And) else [where.this])]
    out = per_key.copy()
    extra = []
    for inner, outer in keys:
        for table in outer_from.find_all(exp.Table):
            if table.name in ours:
                continue
            alone = exp.select(outer.copy()).from_(table.copy())
            if not runs(alone.limit(0).sql()):
                continue  # not this table's column
            own = [
                c
                for c in conds
                if c is not compare
                and not c.find(exp.Subquery, exp.Select, exp.Exists)
                and not _volatile(c)
                and runs(alone.where(c.copy()).limit(0).sql())
            ]
            if own:
                keys_of = alone.where(exp.and_(*[c.copy() for c in own]))
                extra.append(exp.In(this=inner.copy(), query=exp.Subquery(this=keys_of)))
            break
    if not extra:
        return per_key
    old = out.args.get("where")
    out.set("where", exp.Where(this=exp.and_(*([old.this] if old else []), *extra)))
    return out if runs(out.sql() + " LIMIT 0") else per_key


def _per_key(
    sub: Any,
    where: Any,
    runs: Callable[[str], bool],
    run: Callable[[str], pa.Table],
    keep: Callable[[pa.Table], str],
    outer_from: Any = None,
) -> tuple[str, list] | None:
    """A correlated scalar subquery ``(SELECT <aggregates> FROM ... WHERE inner = outer AND
    <rest>)`` compared in one of the ANDed conditions of ``where`` (TPC-H Q17), run once for
    every key, exactly: ``SELECT inner AS __key0, <aggregates> AS __value ... WHERE <rest> GROUP BY
    inner``, kept as a table (its name returned) that the outer query joins on ``outer =
    __key0`` (the conditions returned), the subquery becoming its ``__value``. An outer row whose key
    has no rows there compares with NULL and is dropped, as the join drops it. None when the
    subquery is not of this shape: a value that is not NULL over no rows (COUNT, COALESCE),
    conditions other than the equalities that read the outer query, a comparison not ANDed
    in the WHERE, or key columns of different types on the two sides (``outer_from``: the
    outer query's FROM and joins, to read the outer column's type)."""
    from sqlglot import exp

    select = sub.this
    compare = sub.parent
    if not isinstance(select, exp.Select) or not isinstance(
        compare, (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
    ):
        return None
    if not _conjunct(compare, where) or select.args.get("where") is None:
        return None
    if any(select.args.get(a) for a in ("limit", "offset", "group", "having", "qualify", "joins")):
        return None
    if len(select.expressions) != 1 or select.find(exp.Count) or select.find(exp.Subquery):
        return None
    value = select.expressions[0]
    value = value.this if isinstance(value, exp.Alias) else value
    if not value.find(exp.AggFunc):
        return None
    base = select.copy()
    base.set("where", None)
    keys: list[tuple[Any, Any]] = []  # (inner, outer)
    rest = []
    for c in _conditions(select):
        pair = None
        if _column_equality(c):
            for inner, outer in ((c.this, c.expression), (c.expression, c.this)):
                if runs(_selecting(base, inner)) and not runs(_selecting(base, outer)):
                    pair = (inner, outer)
                    break
        if pair is None:
            rest.append(c)
        else:
            keys.append(pair)
    if not keys:
        return None
    per_key = base.copy()
    per_key.set(
        "expressions",
        [exp.alias_(k.copy(), f"__key{i}") for i, (k, _) in enumerate(keys)]
        + [exp.alias_(value.copy(), "__value")],
    )
    if rest:
        per_key.set("where", exp.Where(this=exp.and_(*[r.copy() for r in rest])))
    per_key.set("group", exp.Group(expressions=[k.copy() for k, _ in keys]))
    if not runs(per_key.sql() + " LIMIT 0"):
        return None  # another condition reads the outer query
    restricted = _only_kept_keys(per_key, keys, where, compare, outer_from, runs)
    # A key with no rows compares with the value over no rows; the join drops its rows, which
    # is the same only when that value is NULL (not so for COUNT, COALESCE(MAX(x), 0), ...).
    empty = base.copy()
    empty.set("expressions", [value.copy()])
    empty.set("where", exp.Where(this=exp.false()))
    try:
        nothing = run(empty.sql())
    except Exception:  # noqa: BLE001 - not runnable alone: not this shape
        return None
    if nothing.num_rows != 1 or nothing.column(0)[0].is_valid:
        return None
    # The join must match what the equality matched: one per-key row per outer key, so the
    # two sides must have one type (an implicit cast can map several keys to one: '1', '01').
    if outer_from is not None:
        for inner, outer in keys:
            try:
                ours = run(_selecting(base, inner)).schema.field(0).type
                same = ours == run(_selecting(outer_from, outer)).schema.field(0).type
            except Exception:  # noqa: BLE001 - types unknown: not this shape
                same = False
            if not same:
                return None
    table = run(restricted.sql())
    name = keep(table)
    ties = [
        exp.EQ(this=outer.copy(), expression=exp.column(f"__key{i}", name))
        for i, (_, outer) in enumerate(keys)
    ]
    return name, ties


def resolve_subqueries(
    tree: Any, run: Callable[[str], pa.Table], keep: Callable[[pa.Table], str] | None = None
) -> Any:
    """``tree`` with each subquery of its WHERE and HAVING that does not read the outer query's
    columns run exactly by ``run`` and replaced by its result: ``x [NOT] IN (SELECT ...)`` by
    the list of values (none: FALSE), a scalar subquery by its value (no row: NULL). An IN
    subquery with more than :data:`MAX_IN_VALUES` values, one of the ANDed conditions of the
    WHERE, becomes a join with a table of its distinct values that ``keep`` stores and names.
    ``[NOT] EXISTS`` tied to the outer query by an equality and ANDed in the WHERE stays for
    DataFusion to plan as a semi or anti join (:func:`kept_join`; TPC-H Q4, Q22); an
    ``EXISTS`` over one of the outer query's tables becomes that ``IN`` (:func:`_as_in`), or
    stays a semi join where no ``IN`` says it (TPC-H Q21). A scalar subquery tied by
    equalities and compared in an ANDed condition of the WHERE runs once for every key into a
    table the query joins (:func:`_per_key`; TPC-H Q17). Anything else that reads the outer
    query's columns does not run on its own: refused, as is a large ``NOT IN``. TPC-H Q4,
    Q11, Q18, Q21 and Q22 stream this way."""
    import pyarrow.compute as pc
    from sqlglot import exp

    clauses = [c for c in ("where", "having") if tree.args.get(c) is not None]
    if not any(tree.args[c].find(exp.Subquery, exp.Select) for c in clauses):
        return tree
    out = tree.copy()

    def exactly(sub: Any) -> pa.Table:
        inner = sub.this if isinstance(sub, exp.Subquery) else sub
        try:
            table = run(inner.sql())
        except Exception as e:
            raise ValueError(
                f"subquery ({inner.sql()[:200]}) cannot run on its own, so it is correlated "
                f"(reads the outer query's columns), which online aggregation does not support: "
                f"{str(e).splitlines()[0][:200]}"
            ) from e
        if table.num_columns != 1:
            raise ValueError(f"subquery ({inner.sql()[:200]}) returns {table.num_columns} columns")
        return table

    def runs(sql: str) -> bool:
        try:
            run(sql)
            return True
        except Exception:  # noqa: BLE001 - a query that does not run is the answer here
            return False

    def own(nodes: Any) -> list:
        """Those of ``nodes`` of this query itself, not of one of its subqueries (which run
        whole) nor cut out of it by an earlier replacement."""
        return [n for n in nodes if n.find_ancestor(exp.Select) is out]

    # The outer query's FROM and joins (to read an outer column's type).
    outer_from = exp.Select(
        **{a: out.args[a].copy() for a in ("from_", "from", "joins") if out.args.get(a)}
    )
    # Join conditions of per-key tables, ANDed into the WHERE once all are replaced (AND
    # copies the tree, which would detach the subqueries still to replace).
    pending_ties: list = []
    for clause in clauses:
        node = out.args[clause]
        for exists in own(node.find_all(exp.Exists)):
            if kept_join(exists, out, runs):
                continue  # planned by DataFusion as a semi or anti join in the fact's stage
            member = _as_in(exists, runs) if clause == "where" and _conjunct(exists, node) else None
            if member is None and kept_join(exists, out, runs, over_outer=True):
                continue  # no IN says it (TPC-H Q21's `<>`): a semi join over an outer table
            if member is None:
                raise ValueError(
                    "EXISTS / NOT EXISTS (a semi or anti join) is supported by online "
                    "aggregation only as an ANDed condition of the WHERE tied to the outer "
                    "query by an equality (EXISTS (SELECT ... WHERE inner = outer AND ...))"
                )
            exists.replace(member)
        for member in own(node.find_all(exp.In)):
            if member.find_ancestor(exp.Select) is not out:
                continue  # cut out with an earlier one
            query = member.args.get("query")
            if query is None:
                continue
            table = exactly(query)
            if table.num_rows > MAX_IN_VALUES:
                if keep is None or clause != "where" or not _conjunct(member, node):
                    raise ValueError(
                        f"IN subquery ({query.sql()[:200]}) returns {table.num_rows} values; "
                        f"online aggregation writes at most {MAX_IN_VALUES} into the query "
                        "(more only for an IN ANDed in the WHERE: a join with its values)"
                    )
                keys = pc.unique(table.column(0).drop_null())
                name = keep(pa.table({"__key": keys}))
                key = exp.column("__key", name)
                member.replace(exp.EQ(this=member.this.copy(), expression=key))
                out.append("joins", exp.Join(this=exp.to_table(name)))
                continue
            t = table.schema.field(0).type
            values = [_literal(v, t) for v in table.column(0).to_pylist()]
            if values:
                member.set("query", None)
                member.set("expressions", values)
            else:
                member.replace(exp.false())
        for sub in own(node.find_all(exp.Subquery)):
            if sub.find_ancestor(exp.Select) is not out:
                continue
            alone = f"SELECT * FROM ({sub.this.sql()}) AS __alone LIMIT 0"
            if keep is not None and clause == "where" and not runs(alone):
                joined = _per_key(sub, node, runs, run, keep, outer_from)
                if joined is not None:
                    name, ties = joined
                    sub.replace(exp.column("__value", name))
                    out.append("joins", exp.Join(this=exp.to_table(name)))
                    pending_ties += ties
                    continue
            table = exactly(sub)
            if table.num_rows > 1:
                raise ValueError(
                    f"scalar subquery ({sub.this.sql()[:200]}) returns {table.num_rows} rows"
                )
            value = table.column(0)[0].as_py() if table.num_rows else None
            sub.replace(_literal(value, table.schema.field(0).type))
    if pending_ties:
        where = out.args["where"]
        where.set("this", exp.and_(where.this, *pending_ties))
    return out


def per_row_derived(tree: Any, run: Callable[[str], pa.Table], keep: Callable | None) -> Any:
    """``SELECT ... FROM (SELECT R.k, AGG(<S's columns>) AS a, ... FROM R LEFT JOIN S ON R.x
    = S.j [AND <S alone>] [WHERE <R alone>] GROUP BY R.k) AS t ...`` (TPC-H Q13), where
    ``R.k`` holds no NULL and no value twice (checked, exactly), as the derived table of one
    row per row of ``R``: ``S``'s aggregates per ``j`` run first, exactly, into a table kept
    by ``keep``, which ``R`` LEFT JOINs on ``x`` (a ``COUNT`` of no rows is 0). The outer
    query then aggregates ``R``'s rows, which stream. ``tree`` itself for any other shape."""
    from sqlglot import exp

    source = tree.args.get("from_") or tree.args.get("from")
    if keep is None or not isinstance(tree, exp.Select) or source is None:
        return tree
    derived = source.this
    if not isinstance(derived, exp.Subquery) or tree.args.get("joins"):
        return tree
    inner = derived.this
    if not isinstance(inner, exp.Select) or any(
        inner.args.get(a)
        for a in ("having", "distinct", "limit", "order", "qualify", "windows", "with_")
    ):
        return tree
    group, joins = inner.args.get("group"), inner.args.get("joins") or []
    r_source = inner.args.get("from_") or inner.args.get("from")
    if group is None or len(group.expressions) != 1 or len(joins) != 1 or r_source is None:
        return tree
    join, key = joins[0], group.expressions[0]
    r, s = r_source.this, join.this
    kind = (join.args.get("kind") or "").upper()
    if (join.args.get("side") or "").upper() != "LEFT" or kind not in ("", "OUTER"):
        return tree
    if join.args.get("using") or (derived.args.get("alias") and derived.args["alias"].columns):
        return tree  # names given by the alias's column list: not read here
    if not all(isinstance(t, exp.Table) for t in (r, s)) or not isinstance(key, exp.Column):
        return tree
    if inner.find(exp.Subquery, exp.Exists) or _volatile(inner):
        return tree

    def type_in(node: Any, table: Any) -> Any:
        """The type of ``node`` read from ``table`` alone; None where it does not run."""
        try:
            return run(exp.select(node.copy()).from_(table.copy()).limit(0).sql()).schema[0].type
        except Exception:  # noqa: BLE001 - not a column of that table alone
            return None

    if type_in(key, r) is None:
        return tree
    on = join.args.get("on")
    conds = list(on.flatten()) if isinstance(on, exp.And) else [on] if on is not None else []
    tie, s_conds = None, []
    for c in conds:
        if tie is None and _column_equality(c):
            for x, j in ((c.this, c.expression), (c.expression, c.this)):
                tx, tj = type_in(x, r), type_in(j, s)
                # One type on both sides: the join matches what the equality matched.
                if tx is not None and tx == tj and type_in(j, r) is None:
                    tie = (x, j)
                    break
            if tie is not None:
                continue
        if type_in(c, s) is None:
            return tree  # a condition reading R: not a filter of S alone
        s_conds.append(c)
    where = inner.args.get("where")
    if tie is None or (where is not None and type_in(where.this, r) is None):
        return tree
    # The selected columns: the key, and aggregates of S's columns alone.
    outputs, aggs = [], []
    for e in inner.expressions:
        body = e.this if isinstance(e, exp.Alias) else e
        if body == key:
            outputs.append(e.copy())
            continue
        kinds = (exp.Count, exp.Sum, exp.Min, exp.Max, exp.Avg)
        if not isinstance(e, exp.Alias) or not isinstance(body, kinds):
            return tree
        # A plain column of S: NULL on the row an R row without a match gets, so that row
        # adds nothing, as no per-key row does (not COUNT(1), COALESCE(o_x, 0), ...).
        if not isinstance(body.this, exp.Column) or type_in(body.this, s) is None:
            return tree
        if type_in(body.this, r) is not None:
            return tree  # a name both tables have
        name = f"__v{len(aggs)}"
        aggs.append(exp.alias_(body.copy(), name))
        value = exp.column(name, "__per_row")
        if isinstance(body, exp.Count):
            value = exp.func("COALESCE", value, exp.Literal.number(0))
        outputs.append(exp.alias_(value, e.args["alias"].copy()))
    if not aggs:
        return tree
    twice = exp.Sub(
        this=exp.Count(this=exp.Star()),
        expression=exp.Count(this=exp.Distinct(expressions=[key.copy()])),
    )
    counted = run(exp.select(twice).from_(r.copy()).sql())
    if counted.num_rows != 1 or counted.column(0)[0].as_py() != 0:
        return tree  # a key repeated or NULL: a group would hold several rows of R
    x, j = tie
    per_key = exp.select(exp.alias_(j.copy(), "__key"), *aggs).from_(s.copy())
    if s_conds:
        per_key = per_key.where(exp.and_(*[c.copy() for c in s_conds]))
    name = keep(run(per_key.group_by(j.copy()).sql()))
    rows = exp.select(*outputs).from_(r.copy())
    rows = rows.join(
        exp.to_table(name).as_("__per_row"),
        on=exp.EQ(this=x.copy(), expression=exp.column("__key", "__per_row")),
        join_type="LEFT",
    )
    if where is not None:
        rows.set("where", where.copy())
    out = tree.copy()
    src = out.args.get("from_") or out.args.get("from")
    alias = derived.args.get("alias")
    src.set("this", exp.Subquery(this=rows, alias=alias.copy() if alias else None))
    return out


@functools.lru_cache(maxsize=256)
def parse(query: str, engine: str) -> Any:
    """The query's syntax tree (shared: callers copy what they change)."""
    import sqlglot

    try:
        return sqlglot.parse_one(query, read="duckdb" if engine == "duckdb" else None)
    except sqlglot.errors.ParseError as e:
        raise ValueError(f"cannot parse the online query: {e}") from e


def resolve(
    query: str,
    engine: str,
    run: Callable[[str], pa.Table],
    keep: Callable[[pa.Table], str] | None = None,
) -> str:
    """``query`` with its uncorrelated subqueries run by ``run`` and replaced by their values
    (:func:`resolve_subqueries`), and a derived table of one row per row of a table read as
    such (:func:`per_row_derived`); unchanged without any."""
    tree = inline_derived(per_row_derived(parse(query, engine), run, keep))
    out = resolve_subqueries(tree, run, keep)
    if out == parse(query, engine):
        return query
    return out.sql(dialect="duckdb" if engine == "duckdb" else None)
