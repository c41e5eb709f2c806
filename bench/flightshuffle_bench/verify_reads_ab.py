"""A/B of the manifest check on partitions read by the driver: Cluster.shuffle of N rows into
R partitions, read back whole, with FLIGHTSHUFFLE_VERIFY_READS on and off in turn (one
cluster per run: the setting is read once per process, so each arm runs in a subprocess)."""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import time, flightshuffle as fs, pyarrow as pa, pyarrow.compute as pc, json, sys
n, r, m = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ids = pa.array(range(n), pa.int64())
t = pa.table({"id": ids, "k": pc.bit_wise_and(ids, 65535), "x": pc.cast(ids, pa.float64())})
with fs.Cluster(workers=2, timeout=120) as c:
    list(c.shuffle(t, by="k", partitions=r, map_bytes=m))  # warm
    times = []
    for _ in range(3):
        s = time.perf_counter()
        rows = sum(p.num_rows for p in c.shuffle(t, by="k", partitions=r, map_bytes=m))
        times.append(time.perf_counter() - s)
        assert rows == n
print(json.dumps(min(times)))
"""
n, r, m, rounds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
out = {"on": [], "off": []}
for i in range(rounds):
    for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
        env = dict(os.environ, FLIGHTSHUFFLE_VERIFY_READS=arm)
        got = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), str(r), m],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        out[arm].append(json.loads(got.stdout.strip().splitlines()[-1]))
print(
    json.dumps(
        {
            "rows": n,
            "partitions": r,
            "map_bytes": m,
            "fastest_of_3_per_run": out,
            "median_on": statistics.median(out["on"]),
            "median_off": statistics.median(out["off"]),
            "ratio_on_off": statistics.median(out["on"]) / statistics.median(out["off"]),
        },
        indent=1,
    )
)
