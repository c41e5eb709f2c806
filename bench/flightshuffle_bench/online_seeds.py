"""Q1 (or QUERY) online over seeds 1..N on one cluster, as online-bench measures one seed; the
source of docs/online/q1-sf1-w2-seeds.json. Usage: `python scripts/online_seeds.py SF N [QUERY]`."""

import json
import statistics
import sys
import time

from flightshuffle import Cluster

from flightshuffle_bench import tpch
from flightshuffle_bench.onlinebench import first_within

sf = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
seeds = range(1, int(sys.argv[2]) + 1 if len(sys.argv) > 2 else 11)
q = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rep = 3
root = f"data/tpch-sf{sf:g}"
out = []
with Cluster(workers=2, memory_budget="4GiB") as c:
    for name, path in tpch.table_paths(root).items():
        c.register_parquet(name, path)
    query, _ = tpch.query(q, sf)
    c.sql(query)
    list(c.online(query, rounds=10, seed=1, progress=False))
    for s in seeds:
        sq, runs = [], []
        for _ in range(rep):
            t = time.perf_counter()
            c.sql(query)
            sq.append(time.perf_counter() - t)
            t = time.perf_counter()
            h = list(c.online(query, rounds=10, seed=s, progress=False))
            runs.append((time.perf_counter() - t, h))
        tot, h = min(runs, key=lambda r: r[0])
        final = h[-1]
        close = first_within(h)
        r = {
            "seed": s,
            "first": h[0].elapsed,
            "first_prog": h[0].progress,
            "within": close.elapsed,
            "within_prog": close.progress,
            "sql": min(sq),
            "total": tot,
            "maps": final.maps_total,
            "ratio": close.elapsed / min(sq),
        }
        out.append(r)
        print(
            json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
            flush=True,
        )
med = lambda k: statistics.median(r[k] for r in out)
print(
    json.dumps(
        {
            "first_med": med("first"),
            "ratio_med": med("ratio"),
            "ratio_range": [min(r["ratio"] for r in out), max(r["ratio"] for r in out)],
            "total_over_sql_med": statistics.median(r["total"] / r["sql"] for r in out),
        }
    )
)
