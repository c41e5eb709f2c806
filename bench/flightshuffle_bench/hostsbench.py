"""``flightshuffle-bench hosts``: shuffles across simulated hosts (network namespaces, each
link capped with tc tbf, see :mod:`.simhosts`), against the bound the links set.

Three hosts each run one ``flightshuffle worker`` started by hand (a static cluster); the Rust
shuffle bench dials them from the machine's own namespace, generates lineitem-like rows on the
workers, shuffles them by key into R partitions reduced on the workers (nothing crosses to
the driver) and checks the output multiset. Per point: the strategy, M = R, compression and
TLS, seconds, and ``link_ratio`` = the links' bound / seconds, where the bound is the time
each host needs to send its share of the uncompressed bytes that must cross hosts over its
link ((N - 1) / N of its 1 / N of the data): 1.0 means the links ran full; above 1.0 only with
compression (fewer bytes cross than the bound assumes). ``auto`` is compared with the best
fixed strategy at the same point. An uncapped run of each point is the reference the machine
itself sets (2 cores run three workers and the generator here). Prints JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from flightshuffle_bench import simhosts
from flightshuffle_bench.binaries import shuffle_binary
from flightshuffle_bench.emit import emit

STRATEGIES = ("pull", "merged", "push", "two-level", "auto")


def _certs(directory: str, hosts: simhosts.SimHosts) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "flightshuffle.cli", "certs", directory,
         *(a for ip in hosts.ips for a in ("--host", ip))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def _run(
    addresses: list[str], files: dict[str, str], rows: int, mr: int, strategy: str, tls: bool
) -> dict[str, Any]:
    cmd = [
        shuffle_binary(), "--rows", str(rows), "--partitions", str(mr), "--maps", str(mr),
        "--strategy", strategy, "--addresses", ",".join(addresses),
        "--token-file", files["token_file"],
        *(["--tls-ca", files["ca"]] if tls else ["--tls", "off"]),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip()[-2000:])
    return json.loads(run.stdout)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    why = simhosts.unavailable()
    if why is not None:
        raise SystemExit(f"flightshuffle-bench hosts: {why}")
    points: list[dict[str, Any]] = []
    configs: list[tuple[str | None, str, bool, tuple[str, ...], list[int]]] = []
    if not args.no_shuffles:
        # (rate, compression, tls, strategies, M = R values); the last rate also without
        # compression and without TLS, and the machine's own limit uncapped.
        chosen = tuple(args.strategies.split(","))
        configs += [(rate, "auto", True, chosen, args.mr) for rate in args.rate]
        if not args.no_variants:
            configs += [
                (args.rate[-1], "none", True, ("pull", "push", "auto"), args.mr[-1:]),
                (args.rate[-1], "auto", False, ("pull", "push", "auto"), args.mr[-1:]),
                (None, "auto", True, chosen, args.mr[-1:]),
            ]
    for rate, compression, tls, strategies, mrs in configs:
        with (
            simhosts.SimHosts(args.hosts, rate=rate) as hosts,
            tempfile.TemporaryDirectory(prefix="fs-hosts-") as tmp,
        ):
            files = _certs(f"{tmp}/certs", hosts)
            flags = ["--compression", compression, "--memory-budget", str(args.memory_budget)]
            if not tls:
                files_tls: list[str] = ["--insecure"]
            else:
                files_tls = []
            addresses = [
                hosts.start_worker(i, files, f"{tmp}/spill{i}", args=[*flags, *files_tls])
                for i in range(hosts.n)
            ]
            if not tls:  # plaintext workers serve no certificate
                addresses = _restart_plain(hosts, files, tmp, flags)
            for mr in mrs:
                for strategy in strategies:
                    for rep in range(args.repeat):
                        r = _run(addresses, files, args.rows, mr, strategy, tls)
                        n = hosts.n
                        cross = r["bytes"] / n * (n - 1) / n
                        bound = cross / simhosts.rate_bytes(rate) if rate else None
                        point = {
                            "rate": rate or "uncapped",
                            "compression": compression,
                            "tls": tls,
                            "strategy": strategy,
                            "choice": r.get("strategy_choice"),
                            "m_r": mr,
                            "repeat": rep,
                            "rows": r["rows"],
                            "bytes": r["bytes"],
                            "seconds": r["seconds"],
                            "link_bound_seconds": bound,
                            "link_ratio": None if bound is None else bound / r["seconds"],
                            "throughput_mb_s": r["bytes"] / r["seconds"] / 1e6,
                            "calibration": r.get("calibration"),
                            "checked": r["checked"]["equal"],
                        }
                        points.append(point)
                        print(json.dumps(point), file=sys.stderr, flush=True)
    report: dict[str, Any] = {"hosts": args.hosts, "rows": args.rows, "points": points}
    report["summary"] = summarize(points)
    if args.tpch_sf:
        report["tpch"] = tpch_on_hosts(args)
    return report


def tpch_on_hosts(args: argparse.Namespace) -> dict[str, Any]:
    """TPC-H at ``args.tpch_sf`` on a static cluster of the simulated hosts (TLS, compression
    auto: LZ4 across hosts) against single-process DataFusion in the driver's process, on the
    same files, each query's minimum of ``args.repeat`` runs; answers checked against DuckDB."""
    from flightshuffle import Cluster

    from flightshuffle_bench import tpch

    root = tpch.ensure_data(args.tpch_sf, args.tpch_data, progress=False)
    duck = tpch.duckdb_connect(root)
    with (
        simhosts.SimHosts(args.hosts, rate=args.rate[0]) as hosts,
        tempfile.TemporaryDirectory(prefix="fs-hosts-") as tmp,
    ):
        files = _certs(f"{tmp}/certs", hosts)
        flags = ["--memory-budget", str(args.memory_budget)]
        addresses = [
            hosts.start_worker(i, files, f"{tmp}/spill{i}", args=flags) for i in range(hosts.n)
        ]
        with open(files["token_file"]) as f:
            token = f.read().strip()
        rows = []
        with Cluster(addresses=addresses, token=token, tls={"ca": files["ca"]}) as c:
            for name, path in tpch.table_paths(root).items():
                c.register_parquet(name, path)
            for q in range(1, 23):
                sql, ordered = tpch.query(q, args.tpch_sf)
                dist, single = [], []
                for _ in range(args.repeat):
                    t = time.monotonic()
                    got = c.sql(sql)
                    dist.append(time.monotonic() - t)
                    single.append(c.sql_single_process(sql)[1])
                diff = tpch.compare(duck.sql(sql).to_arrow_table(), got, ordered)
                rows.append(
                    {"query": q, "distributed_s": min(dist), "single_process_s": min(single),
                     "ratio": min(dist) / min(single), "right": diff is None}
                )  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            calibration = c.calibration()
    total = sum(r["distributed_s"] for r in rows)
    single_total = sum(r["single_process_s"] for r in rows)
    return {
        "sf": args.tpch_sf, "rate": args.rate[0], "hosts": args.hosts, "queries": rows,
        "total_distributed_s": total, "total_single_process_s": single_total,
        "ratio": total / single_total, "all_right": all(r["right"] for r in rows),
        "calibration": calibration,
    }  # fmt: skip


def _restart_plain(
    hosts: simhosts.SimHosts, files: dict[str, str], tmp: str, flags: list[str]
) -> list[str]:
    """Workers without TLS (``--insecure``, no certificate flags) in place of the TLS ones."""
    for p in hosts.procs:
        p.kill()
        p.wait()
    hosts.procs.clear()
    time.sleep(0.5)
    out = []
    for i in range(hosts.n):
        cmd = [
            sys.executable, "-m", "flightshuffle.worker", "--id", f"host{i}",
            "--listen", f"{hosts.ips[i]}:7001", "--spill-dir", f"{tmp}/plain{i}",
            "--token-file", files["token_file"], "--insecure", *flags,
        ]  # fmt: skip
        proc = hosts.run(i, cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("FLIGHTSHUFFLE_WORKER_READY"):
            raise RuntimeError(f"plaintext worker {i} did not start")
        out.append(line.split()[1])
    return out


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median seconds per (rate, compression, tls, m_r, strategy); auto against the best."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for p in points:
        key = (p["rate"], p["compression"], p["tls"], p["m_r"], p["strategy"])
        groups.setdefault(key, []).append(p)
    rows = []
    for key, ps in groups.items():
        secs = sorted(p["seconds"] for p in ps)
        med = secs[len(secs) // 2]
        bound = ps[0]["link_bound_seconds"]
        rows.append(
            {
                "rate": key[0], "compression": key[1], "tls": key[2], "m_r": key[3],
                "strategy": key[4], "median_seconds": med,
                "link_ratio": None if bound is None else bound / med,
                "choice": ps[0]["choice"],
            }
        )  # fmt: skip
    for r in rows:
        if r["strategy"] != "auto":
            continue
        fixed = [
            x["median_seconds"]
            for x in rows
            if x["strategy"] != "auto"
            and (x["rate"], x["compression"], x["tls"], x["m_r"])
            == (r["rate"], r["compression"], r["tls"], r["m_r"])
        ]
        if fixed:
            r["auto_over_best_fixed"] = r["median_seconds"] / min(fixed)
    return rows


def add_parser(sub: Any) -> None:
    p = sub.add_parser("hosts", help="shuffles across simulated hosts with capped links")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument(
        "--rate", nargs="+", default=["1gbit", "100mbit"], help="each host's link (tc tbf rate)"
    )
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--mr", type=int, nargs="+", default=[50, 250], help="M = R values")
    p.add_argument("--memory-budget", type=int, default=2 << 30)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--tpch-sf", type=float, default=0.0, help="also TPC-H at this SF (0: no)")
    p.add_argument("--tpch-data", default="data/tpch-sf1", help="where the TPC-H Parquet files are")
    p.add_argument("--no-shuffles", action="store_true", help="only the TPC-H part")
    p.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated, for the main points"
    )
    p.add_argument(
        "--no-variants",
        action="store_true",
        help="skip the runs without compression, without TLS and uncapped",
    )
    p.add_argument("-o", "--output", help="also write the JSON here")
    p.set_defaults(run=lambda a: emit(measure(a), a.output))
