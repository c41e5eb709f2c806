"""TPC-H helpers for the benchmarks and tests: data generation (``tpchgen-cli``, the command of
the Rust ``tpchgen`` generator), the 22 queries (the texts in the repository's ``tpch/queries``,
shared with the Rust ``tpch`` crate), DuckDB reference answers and answer comparison (floats to
1e-6 relative; row order only where the query orders)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa

__all__ = [
    "TABLES",
    "compare",
    "duckdb_connect",
    "ensure_data",
    "query",
    "query_numbers",
    "scale_factor",
]

Q1_LIKE = """SELECT l_returnflag, l_linestatus,
  SUM(l_quantity) AS sum_qty,
  SUM(l_extendedprice) AS sum_base_price,
  SUM(l_extendedprice * (1 - l_discount)) AS sum_disc_price,
  SUM(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS sum_charge,
  AVG(l_quantity) AS avg_qty,
  AVG(l_extendedprice) AS avg_price,
  AVG(l_discount) AS avg_disc,
  COUNT(*) AS count_order
FROM lineitem
WHERE l_shipdate <= DATE '1998-12-01' - INTERVAL '90' DAY
GROUP BY l_returnflag, l_linestatus
ORDER BY l_returnflag, l_linestatus"""

TABLES: list[str] = [
    "lineitem",
    "orders",
    "partsupp",
    "part",
    "customer",
    "supplier",
    "nation",
    "region",
]

# The query texts, in the checkout (this package is not installed apart from it).
QUERIES = Path(__file__).resolve().parents[2] / "tpch" / "queries"


def query(n: int, sf: float) -> tuple[str, bool]:
    """The SQL of query ``n`` at scale factor ``sf`` and whether its result order is fixed by
    its ORDER BY. Q11's fraction is 0.0001 / SF, as the specification says."""
    if not 1 <= n <= 22:
        raise ValueError(f"no TPC-H query {n}")
    text = (QUERIES / f"q{n:02}.sql").read_text().strip().rstrip(";")
    if n == 11:
        text = text.replace("* 0.0001", f"* {0.0001 / sf}")
    return text, "order by" in text.lower()


def query_numbers(text: str) -> list[int]:
    """``--queries 1,3,18`` as numbers, each 1-22 (an argparse type: a bad list is refused
    before any data is generated or a cluster started)."""
    try:
        numbers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes comma-separated TPC-H query numbers such as 1,3,18, not {text!r}"
        ) from None
    bad = [n for n in numbers if not 1 <= n <= 22]
    if bad or not numbers:
        raise argparse.ArgumentTypeError(f"TPC-H has queries 1 to 22, not {bad or text!r}")
    return numbers


def scale_factor(text: str) -> float:
    """``--sf`` as a positive number (an argparse type)."""
    try:
        sf = float(text)
    except ValueError:
        sf = math.nan
    if not sf > 0 or math.isinf(sf):
        raise argparse.ArgumentTypeError(
            f"the scale factor must be a positive number, not {text!r}"
        )
    return sf


def is_generated(root: str) -> bool:
    return all(
        os.path.isdir(os.path.join(root, t))
        and any(f.endswith(".parquet") for f in os.listdir(os.path.join(root, t)))
        for t in TABLES
    )


def files_for(table: str, sf: float) -> int:
    """Files per table at scale factor ``sf``: several for the large tables so scans split."""
    per_sf, least = {
        "lineitem": (4.0, 4),
        "orders": (2.0, 4),
        "partsupp": (1.0, 2),
        "part": (1.0, 2),
        "customer": (1.0, 2),
    }.get(table, (0.0, 1))
    return max(math.ceil(per_sf * sf), least)


def generate(sf: float, root: str, progress: bool = True) -> None:
    """Write the 8 tables at scale factor ``sf`` as ZSTD Parquet under ``root/<table>/``, each
    table made in a scratch directory and moved into place whole (an interrupted run leaves no
    half table behind)."""
    cli = shutil.which("tpchgen-cli") or str(Path(sys.executable).parent / "tpchgen-cli")
    if not os.path.exists(cli):
        raise RuntimeError("tpchgen-cli is not installed: pip install tpchgen-cli")
    os.makedirs(root, exist_ok=True)
    for table in TABLES:
        final = os.path.join(root, table)
        if os.path.isdir(final) and any(f.endswith(".parquet") for f in os.listdir(final)):
            continue
        scratch = os.path.join(root, f".{table}.tmp-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        if progress:
            print(f"== generating TPC-H {table} at SF {sf:g}", file=sys.stderr)
        cmd = [cli, "parquet", "-s", f"{sf:g}", "-T", table, "-o", scratch, "--no-progress"]
        cmd += ["-q", "-c", "ZSTD(1)", "--row-group-bytes", "32MB"]
        parts = files_for(table, sf)
        if parts > 1:
            cmd += ["--parts", str(parts)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            shutil.rmtree(scratch, ignore_errors=True)
            raise RuntimeError(f"tpchgen-cli failed for {table}: {e.stderr.strip()}") from None
        made = os.path.join(scratch, table)
        if parts == 1:
            os.makedirs(made, exist_ok=True)
            os.rename(
                os.path.join(scratch, f"{table}.parquet"), os.path.join(made, "part-1.parquet")
            )
        shutil.rmtree(final, ignore_errors=True)
        os.rename(made, final)
        shutil.rmtree(scratch, ignore_errors=True)


def ensure_data(sf: float, root: str, progress: bool = True) -> str:
    """Generate TPC-H Parquet files under ``root`` unless they are there already."""
    if not is_generated(root):
        generate(sf, root, progress)
    return root


def table_paths(root: str) -> dict[str, str]:
    return {t: os.path.join(root, t) for t in TABLES}


def duckdb_connect(root: str) -> Any:
    """A DuckDB connection with one view per table over the same Parquet files."""
    import duckdb

    con = duckdb.connect()
    for t, path in table_paths(root).items():
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{path}/*.parquet')")
    return con


def _norm(v: Any) -> Any:
    if isinstance(v, Decimal):
        return float(v)
    return v


def _rows(t: pa.Table) -> list[tuple[Any, ...]]:
    cols = [[_norm(v) for v in c.to_pylist()] for c in t.columns]
    return list(zip(*cols, strict=True)) if cols else []


def _same(a: Any, b: Any, abs_tol: float = 1e-9) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=abs_tol)
    return a == b


def _same_row(a: tuple[Any, ...], b: tuple[Any, ...], tols: list[float] | None = None) -> bool:
    tols = tols or [1e-9] * len(a)
    return len(a) == len(b) and all(_same(x, y, t) for x, y, t in zip(a, b, tols, strict=False))


def _tolerances(*tables: pa.Table) -> list[float]:
    """Per column: a decimal of scale s is exact only to 10^-s (e.g. AVG of a DECIMAL(15,2)
    is DECIMAL(..., 6) in DataFusion but DOUBLE in DuckDB)."""
    tols = [1e-9] * tables[0].num_columns
    for t in tables:
        for i, f in enumerate(t.schema):
            if pa.types.is_decimal(f.type):
                tols[i] = max(tols[i], 10.0**-f.type.scale)
    return tols


def _key(row: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in row)


def _same_multiset(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    return all(
        _same_row(x, y) for x, y in zip(sorted(a, key=_key), sorted(b, key=_key), strict=True)
    )


def compare(expected: pa.Table, got: pa.Table, ordered: bool) -> str | None:
    """None when ``got`` matches ``expected``, else what differs. Rows tied on the ORDER BY
    keys may come in either order (a short run of positions holding the same rows)."""
    if expected.num_columns != got.num_columns:
        return f"{expected.num_columns} columns expected, {got.num_columns} returned"
    e, g = _rows(expected), _rows(got)
    tols = _tolerances(expected, got)
    if len(e) != len(g):
        return f"{len(e)} rows expected, {len(g)} returned"
    if not ordered:
        e, g = sorted(e, key=_key), sorted(g, key=_key)
    i = 0
    while i < len(e):
        if _same_row(e[i], g[i], tols):
            i += 1
            continue
        run = next(
            (
                j
                for j in range(i + 2, min(len(e), i + 64) + 1)
                if ordered and _same_multiset(e[i:j], g[i:j])
            ),
            None,
        )
        if run is None:
            return f"row {i} differs: expected {e[i]}, got {g[i]}"
        i = run
    return None
