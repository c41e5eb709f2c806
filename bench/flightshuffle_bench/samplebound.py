"""``flightshuffle-bench online-bound``: how much of TPC-H's lineitem, as stored, an online Q1 must
read before every estimate is within 5% of the exact answer, whatever the engine.

The online path reads the fact table in random splits of contiguous rows (whole row groups).
For each sample size, ``--trials`` times: ``--workers`` contiguous row ranges of that size,
apart and aligned to it, chosen at random (one first split per worker), Q1's estimates from them (sums and counts scaled up, averages as ratios),
and whether each is within ``--within`` of the exact answer. The same for the same number of
rows drawn independently (what a randomly ordered table gives). A time-to-5% ÷ full-query
ratio cannot be lower than the fraction read, even with no fixed cost at all. Prints the
report as JSON (each size's line on stderr as it is measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from flightshuffle_bench import tpch
from flightshuffle_bench.emit import emit

COLUMNS = ["l_returnflag", "l_linestatus", "l_quantity", "l_extendedprice", "l_discount"]
COLUMNS += ["l_tax", "l_shipdate"]


def q1(df: Any, scale: float) -> Any:
    """TPC-H Q1 over ``df``, sums and counts multiplied by ``scale``."""
    import polars as pl

    x = df.filter(pl.col("l_shipdate") <= datetime.date(1998, 9, 2)).with_columns(
        pl.col(c).cast(pl.Float64) for c in ["l_quantity", "l_extendedprice", "l_discount", "l_tax"]
    )
    price = pl.col("l_extendedprice")
    disc = price * (1 - pl.col("l_discount"))
    return x.group_by("l_returnflag", "l_linestatus").agg(
        (pl.col("l_quantity").sum() * scale).alias("sum_qty"),
        (price.sum() * scale).alias("sum_base_price"),
        (disc.sum() * scale).alias("sum_disc_price"),
        ((disc * (1 + pl.col("l_tax"))).sum() * scale).alias("sum_charge"),
        pl.col("l_quantity").mean().alias("avg_qty"),
        price.mean().alias("avg_price"),
        pl.col("l_discount").mean().alias("avg_disc"),
        (pl.len() * scale).alias("count_order"),
    )


def within(est: Any, exact: Any, rel: float) -> bool:
    """Every group of ``exact`` present in ``est`` with every estimate within ``rel``."""
    keys = ["l_returnflag", "l_linestatus"]
    j = exact.join(est, on=keys, how="left", suffix="_e")
    for c in exact.columns:
        if c in keys:
            continue
        e = j[f"{c}_e"]
        if e.null_count() or float(((e - j[c]).abs() / j[c].abs()).max()) > rel:
            return False
    return True


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import polars as pl

    root = tpch.ensure_data(args.sf, args.data or f"data/tpch-sf{args.sf:g}", progress=True)
    table = pl.read_parquet(tpch.table_paths(root)["lineitem"], columns=COLUMNS)
    n = table.height
    exact = q1(table, 1.0)
    rng = np.random.default_rng(args.seed)
    rows = []
    for size in [int(s) for s in args.rows.split(",")]:
        take = size * args.workers
        if take > n:
            continue
        scale = n / take
        ok_stored = ok_random = 0
        for _ in range(args.trials):
            starts = rng.choice(n // size, size=args.workers, replace=False) * size
            ranges = pl.concat([table.slice(int(s), size) for s in starts])
            ok_stored += within(q1(ranges, scale), exact, args.within)
            drawn = table[np.sort(rng.choice(n, size=take, replace=False))]
            ok_random += within(q1(drawn, scale), exact, args.within)
        row = {
            "rows_per_split": size,
            "fraction_read": take / n,
            "p_within_stored_order": ok_stored / args.trials,
            "p_within_random_order": ok_random / args.trials,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"sf": args.sf, "workers": args.workers, "within": args.within, "trials": args.trials}
    report["sizes"] = rows
    emit(report, args.json)
    return 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "online-bound",
        help="how much of lineitem an online TPC-H Q1 must read for estimates within 5%%",
    )
    b.add_argument("--sf", type=tpch.scale_factor, default=1.0)
    b.add_argument("--data", help="TPC-H data directory (default data/tpch-sf<SF>)")
    b.add_argument("--workers", type=int, default=2, help="splits read in the first round")
    # 196608: about the average first-round split at SF1 (24 row groups of up to 262144 rows).
    b.add_argument("--rows", default="16384,32768,65536,131072,196608,262144,524288")
    b.add_argument("--trials", type=int, default=200)
    b.add_argument("--within", type=float, default=0.05)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", help="also write the report here")
    b.set_defaults(run=run)
