"""A/B of the manifest check on partitions read on the workers (SQL stage inputs): the 22 TPC-H
queries on 2 workers, with FLIGHTSHUFFLE_VERIFY_READS on and off in turn, arms alternating
(one cluster per run in a subprocess: the setting is read once per process).

    python bench/verify_reads_tpch_ab.py SF ROUNDS  >  result.json
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import flightshuffle as fs
from flightshuffle_bench import tpch
sf = float(sys.argv[1])
root = os.path.join(os.path.expanduser("~"), ".cache", "flightshuffle", f"tpch-sf{sf:g}")
paths = tpch.table_paths(tpch.ensure_data(sf, root, progress=False))
with fs.Cluster(workers=2, timeout=600) as c:
    for name, path in paths.items():
        c.register_parquet(name, path)
    start = time.perf_counter()
    for n in range(1, 23):
        c.sql(tpch.query(n, sf)[0])
    print(json.dumps(time.perf_counter() - start))
"""


def main() -> None:
    sf, rounds = sys.argv[1], int(sys.argv[2])
    out: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
            env = dict(os.environ, FLIGHTSHUFFLE_VERIFY_READS=arm)
            got = subprocess.run(
                [sys.executable, "-c", CHILD, sf],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            out[arm].append(json.loads(got.stdout.strip().splitlines()[-1]))
    on, off = statistics.median(out["on"]), statistics.median(out["off"])
    print(
        json.dumps(
            {
                "sf": float(sf),
                "workers": 2,
                "queries": 22,
                "total_s_per_run": out,
                "median_on": on,
                "median_off": off,
                "ratio_on_off": on / off,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
