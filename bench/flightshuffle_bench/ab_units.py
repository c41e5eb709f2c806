"""A/B in one cluster (the source of docs/online/ab-units-*.json; usage:
`python -m flightshuffle_bench.ab_units SF QUERIES REPEAT [OUT.json [TARGETS]]`): the fact
table cut into TARGET_UNITS units (TARGETS, default "1,256": 1 is one unit per row group,
256 as built, several units per map task), alternating; per query: fastest and median
streaming, first estimate, time-to-5%, and distributed SQL."""

import json
import statistics
import sys
import time

import flightshuffle.units as un
from flightshuffle import Cluster

from flightshuffle_bench import tpch
from flightshuffle_bench.onlinebench import first_within

sf = float(sys.argv[1])
qs = [int(x) for x in sys.argv[2].split(",")]
reps = int(sys.argv[3])
built = un.TARGET_UNITS
targets = sys.argv[5].split(",") if len(sys.argv) > 5 else ["1", str(built)]
modes = {f"target_{t}": int(t) for t in targets}
report = {"sf": sf, "reps": reps, "target_units": built, "queries": []}
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
            for m in list(modes) if rep % 2 else list(modes)[::-1]:  # alternating
                un.TARGET_UNITS = modes[m]
                t = time.perf_counter()
                h = list(c.online(query, rounds=10, seed=1, progress=False))
                tot = time.perf_counter() - t
                close = first_within(h)
                res[m].append(
                    {
                        "total": tot,
                        "first": h[0].elapsed,
                        "within": close.elapsed,
                        "maps": h[-1].maps_total,
                        "units": int(c.last_online_plan.split("SplitScanExec: ")[1].split()[0]),
                    }
                )
        un.TARGET_UNITS = built
        row = {"query": q, "sql_min": min(sql), "sql_median": statistics.median(sql)}
        for m, v in res.items():
            tots = [x["total"] for x in v]
            row[m] = {
                "maps": v[0]["maps"],
                "units": v[0]["units"],
                "total_min": min(tots),
                "total_median": statistics.median(tots),
                "first_median": statistics.median(x["first"] for x in v),
                "within_median": statistics.median(x["within"] for x in v),
            }
        print(json.dumps(row), file=sys.stderr)
        report["queries"].append(row)
text = json.dumps(report, indent=2)
print(text)
if len(sys.argv) > 4:
    with open(sys.argv[4], "w") as f:
        f.write(text + "\n")
