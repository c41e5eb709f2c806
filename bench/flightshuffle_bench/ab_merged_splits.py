"""A/B in one cluster (the source of docs/online/ab-merged-splits-*.json; usage:
`python scripts/ab_merged_splits.py SF QUERIES REPEAT [OUT.json]`): splits of merged row groups (SPLIT_ROWS as built) vs one row group per
split (SPLIT_ROWS = 0), alternating; per query: fastest and median streaming, first estimate,
time-to-5%, SQL."""

import json
import statistics
import sys
import time

import flightshuffle.online as ol
from flightshuffle import Cluster

from flightshuffle_bench import tpch
from flightshuffle_bench.onlinebench import first_within

sf = float(sys.argv[1])
qs = [int(x) for x in sys.argv[2].split(",")]
reps = int(sys.argv[3])
built = ol.SPLIT_ROWS
modes = {"one_row_group": 0, "merged": built}
report = {"sf": sf, "reps": reps, "split_rows": built, "queries": []}
with Cluster(workers=2, memory_budget="4GiB") as c:
    for name, path in tpch.table_paths(f"data/tpch-sf{sf:g}").items():
        c.register_parquet(name, path)
    for q in qs:
        query, _ = tpch.query(q, sf)
        c.sql(query)
        list(c.online(query, rounds=10, seed=1, progress=False))
        res = {m: [] for m in modes}
        sql = []
        for rep in range(reps):
            t = time.perf_counter()
            c.sql(query)
            sql.append(time.perf_counter() - t)
            for m in list(modes) if rep % 2 else list(modes)[::-1]:
                ol.SPLIT_ROWS = modes[m]
                t = time.perf_counter()
                h = list(c.online(query, rounds=10, seed=1, progress=False))
                tot = time.perf_counter() - t
                final = h[-1]
                close = first_within(h)
                res[m].append(
                    {
                        "total": tot,
                        "first": h[0].elapsed,
                        "within": close.elapsed,
                        "maps": final.maps_total,
                        "rounds": len(h),
                    }
                )
        ol.SPLIT_ROWS = built
        row = {"query": q, "sql_min": min(sql), "sql_median": statistics.median(sql)}
        for m, v in res.items():
            tots = [x["total"] for x in v]
            row[m] = {
                "maps": v[0]["maps"],
                "rounds": v[0]["rounds"],
                "total_min": min(tots),
                "total_median": statistics.median(tots),
                "first_median": statistics.median(x["first"] for x in v),
                "within_median": statistics.median(x["within"] for x in v),
                "streaming_over_sql_min": min(tots) / min(sql),
                "streaming_over_sql_median": statistics.median(tots) / statistics.median(sql),
            }
        report["queries"].append(row)
        print(
            f"q{q} sql {row['sql_min']:.3f}/{row['sql_median']:.3f} "
            + " | ".join(
                f"{m}: maps {r['maps']} rounds {r['rounds']} total {r['total_min']:.3f}/{r['total_median']:.3f} ratio {r['streaming_over_sql_min']:.3f}/{r['streaming_over_sql_median']:.3f} first {r['first_median']:.3f} within {r['within_median']:.3f}"
                for m, r in ((m, row[m]) for m in modes)
            ),
            flush=True,
        )
if len(sys.argv) > 4:
    with open(sys.argv[4], "w") as f:
        json.dump(report, f, indent=1)
