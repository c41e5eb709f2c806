"""TPC-DS: data and the 99 query texts from DuckDB's TPC-DS extension, and a runner
(``flightshuffle-bench tpcds``) that runs each query distributed, on single-process DataFusion
and on DuckDB over the same Parquet files, and reports per query right / wrong / error and
times (JSON).

The generator needs ``duckdb==1.5.5`` with the ``duckdb-extension-tpcds`` wheel, which the
project's DuckDB pin cannot share a venv with: it runs in a venv of its own, outside the
checkout (``~/.cache/flightshuffle/venv-tpcds``, or ``$FLIGHTSHUFFLE_TPCDS_VENV``; made on first
use). Reference answers come from
the project's DuckDB on the generated Parquet files (the extension's ``tpcds_answers()`` has
no SF1 answers)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit

GENERATOR_PINS = ["duckdb==1.5.5", "duckdb-extension-tpcds==1.5.5"]

# Runs in the generator venv: dsdgen into an in-memory DuckDB, each table to Parquet, and the
# query texts to files.
GENERATE = r"""
import os, pathlib, sys
import duckdb, duckdb_extension_tpcds
sf, root = float(sys.argv[1]), sys.argv[2]
ext = next(pathlib.Path(duckdb_extension_tpcds.__file__).parent.rglob("tpcds.duckdb_extension"))
con = duckdb.connect()
con.execute(f"LOAD '{ext}'")
con.execute(f"CALL dsdgen(sf={sf})")
os.makedirs(f"{root}/queries", exist_ok=True)
for (table,) in con.execute("SHOW TABLES").fetchall():
    os.makedirs(f"{root}/{table}", exist_ok=True)
    con.execute(f"COPY {table} TO '{root}/{table}/{table}.parquet' (FORMAT parquet)")
for n, text in con.execute("SELECT query_nr, query FROM tpcds_queries()").fetchall():
    pathlib.Path(f"{root}/queries/q{n:02d}.sql").write_text(text)
pathlib.Path(f"{root}/.done").write_text(str(sf))
"""


def generator_python() -> str:
    """The generator venv's Python, made (quietly) on first use."""
    venv = os.environ.get(
        "FLIGHTSHUFFLE_TPCDS_VENV",
        os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", "venv-tpcds"),
    )
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", *GENERATOR_PINS],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return python


def ensure_data(sf: float, root: str) -> str:
    """TPC-DS at scale factor ``sf`` as Parquet under ``root`` (one directory per table) and
    the 99 query texts under ``root/queries``; generated once."""
    done = os.path.join(root, ".done")
    made = None
    if os.path.exists(done):
        with open(done) as f:
            made = float(f.read())
    if made != sf:
        os.makedirs(root, exist_ok=True)
        subprocess.run([generator_python(), "-c", GENERATE, str(sf), root], check=True)
    return root


def tables(root: str) -> dict[str, str]:
    return {
        d: os.path.join(root, d)
        for d in sorted(os.listdir(root))
        if os.path.isdir(os.path.join(root, d)) and d != "queries"
    }


def queries(root: str) -> dict[int, str]:
    qdir = os.path.join(root, "queries")
    return {
        int(f[1:3]): open(os.path.join(qdir, f)).read()
        for f in sorted(os.listdir(qdir))
        if re.fullmatch(r"q\d\d\.sql", f)
    }


def ordered(sql: str) -> bool:
    """Whether the query's outermost statement orders its rows."""
    return bool(re.search(r"order\s+by[^)]*$", sql.strip().rstrip(";"), re.IGNORECASE | re.DOTALL))


def duckdb_connect(root: str) -> Any:
    import duckdb

    con = duckdb.connect()
    for name, path in tables(root).items():
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{path}/*.parquet')")
    return con


def outcome(want: Any, run: Any, is_ordered: bool) -> dict[str, Any]:
    t = time.monotonic()
    try:
        got = run()
    except Exception as e:  # noqa: BLE001 - every error is reported, per query
        return {"result": "error", "error": str(e).splitlines()[0][:300]}
    seconds = time.monotonic() - t
    diff = tpch.compare(want, got, is_ordered)
    return {"result": "right" if diff is None else "wrong", "seconds": seconds} | (
        {"diff": diff[:300]} if diff else {}
    )


def run(args: argparse.Namespace) -> int:
    from flightshuffle import Cluster

    root = ensure_data(args.sf, args.data or os.path.join("data", f"tpcds-sf{args.sf:g}"))
    con = duckdb_connect(root)
    texts = queries(root)
    wanted = [int(q) for q in args.queries.split(",")] if args.queries else sorted(texts)
    report: dict[str, Any] = {"sf": args.sf, "workers": args.workers, "queries": {}}
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:
        for name, path in tables(root).items():
            c.register_parquet(name, path)
        for setting in args.set:
            name, sep, value = setting.partition("=")
            if not sep or not name.strip():
                print(f"--set wants NAME=VALUE, got {setting!r}", file=sys.stderr)
                return 2
            c.sql(f"SET {name.strip()} = '{value.strip()}'")
        report["settings"] = args.set
        for q in wanted:
            sql = texts[q]
            t = time.monotonic()
            want = con.sql(sql).to_arrow_table()
            row: dict[str, Any] = {"duckdb_seconds": time.monotonic() - t}
            is_ordered = ordered(sql)
            row["single"] = outcome(want, lambda sql=sql: c.sql_single_process(sql)[0], is_ordered)
            row["distributed"] = outcome(want, lambda sql=sql: c.sql(sql), is_ordered)
            report["queries"][str(q)] = row
            print(
                f"q{q:02d}: {row['distributed']['result']} / {row['single']['result']}",
                file=sys.stderr,
            )
    rows = report["queries"].values()
    for way in ("single", "distributed"):
        report[f"{way}_counts"] = {
            k: sum(1 for r in rows if r[way]["result"] == k) for k in ("right", "wrong", "error")
        }
    both = [r for r in rows if r["single"]["result"] == r["distributed"]["result"] == "right"]
    dist = sum(r["distributed"]["seconds"] for r in both)
    single = sum(r["single"]["seconds"] for r in both)
    report["both_right"] = len(both)
    report["distributed_over_single"] = dist / single if single else None
    report["worst"] = sorted(
        (
            (q, r["distributed"]["seconds"] / r["single"]["seconds"])
            for q, r in report["queries"].items()
            if r in both and r["single"]["seconds"] > 0
        ),
        key=lambda x: -x[1],
    )[:10]
    emit(report, args.json)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "tpcds",
        help="TPC-DS's 99 queries distributed vs single-process DataFusion vs DuckDB (JSON)",
    )
    s.add_argument("--sf", type=float, default=1.0)
    s.add_argument("--data", help="data directory (default data/tpcds-sf<SF>)")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--memory-budget", default="2GiB")
    s.add_argument("--queries", help="comma-separated query numbers (default: all 99)")
    s.add_argument("--json", help="also write the JSON to this file")
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a session setting for every distributed query, e.g. "
        "flightshuffle.selective_joins_first=false (repeatable)",
    )
    s.set_defaults(run=run)
