"""``flightshuffle-bench``: the benchmarks and trials of flightshuffle (not shipped in the
wheel): TPC-H against single-process DataFusion and DuckDB, the shuffle bench and the strategy
sweep (through the Rust ``flightshuffle-shuffle-bench`` binary), kill trials, the soak, the
online-aggregation benches and the skew bench."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from flightshuffle import STRATEGIES, Cluster, ShuffleError, parse_bytes, worker_command
from flightshuffle.cli import run_online

from flightshuffle_bench import tpch
from flightshuffle_bench.binaries import shuffle_binary


def shuffle_bench(
    *,
    rows: int,
    workers: int,
    partitions: int,
    memory_budget: int,
    maps: int,
    worker: list[str],
    batch_rows: int = 65_536,
    seed: int = 42,
    compression: str = "auto",
    sequential: bool = False,
    strategy: str = "pull",
    parity: int = 0,
    tls: str = "on",
) -> dict:
    """One run of the shuffle bench; its JSON report."""
    cmd = [shuffle_binary()]
    for name, value in [
        ("rows", rows),
        ("workers", workers),
        ("partitions", partitions),
        ("memory-budget", memory_budget),
        ("maps", maps),
        ("batch-rows", batch_rows),
        ("seed", seed),
        ("compression", compression),
        ("strategy", strategy),
        ("parity", parity),
        ("tls", tls),
    ]:
        cmd += [f"--{name}", str(value)]
    if sequential:
        cmd.append("--sequential")
    run = subprocess.run([*cmd, "--", *worker], check=False, capture_output=True, text=True)
    if run.returncode != 0:
        raise ShuffleError(run.stderr.strip() or f"shuffle bench exited {run.returncode}")
    return json.loads(run.stdout)


def _online(args: argparse.Namespace) -> int:
    """``flightshuffle online`` on generated TPC-H data (a Q1-like query by default)."""
    root = args.data or os.path.join("data", f"tpch-sf{args.sf:g}")
    data = tpch.ensure_data(args.sf, root, progress=True)
    return run_online(args, tpch.table_paths(data), args.sql or tpch.Q1_LIKE)


def _bench(args: argparse.Namespace) -> int:
    report = shuffle_bench(
        rows=args.rows,
        workers=args.workers,
        partitions=args.partitions,
        memory_budget=parse_bytes(args.memory_budget),
        maps=args.maps,
        batch_rows=args.batch_rows,
        seed=args.seed,
        compression=args.compression,
        worker=shlex.split(args.worker_command) if args.worker_command else worker_command(),
        sequential=args.sequential,
        strategy=args.strategy,
        parity=args.parity,
        tls=args.tls,
    )
    print(json.dumps(report, indent=2))
    return 0


def _kill_trials(args: argparse.Namespace) -> int:
    from flightshuffle_bench import killtrials

    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in killtrials.KINDS:
            raise ValueError(f"unknown kind {k!r} in --kinds; choose from {killtrials.KINDS}")
    report = killtrials.run_trials(
        kinds,
        args.trials,
        args.seed,
        lambda m: print(m, file=sys.stderr, flush=True),
        args.memory_budget,
        -1 if args.parity == "all" else int(args.parity),
        args.strategy,
    )
    summary = {k: {x: v for x, v in r.items() if x != "runs"} for k, r in report.items()}
    print(json.dumps(summary, indent=1), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def _soak(args: argparse.Namespace) -> int:
    from flightshuffle_bench import soak

    report = soak.run_soak(
        args.threads,
        args.jobs,
        args.workers,
        args.memory_budget,
        args.shuffle_rows,
        lambda m: print(m, file=sys.stderr, flush=True),
        tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
    )
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if report["exact"] == report["jobs"] and report["workers_replaced"] == 0 else 1


def _sweep(args: argparse.Namespace) -> int:
    """Exoshuffle Figure 4 at this machine's scale: throughput against the number of
    partitions (with ``--maps 0``, M = R at each point), per strategy and per memory budget,
    each point one shuffle-bench run (output checked)."""
    try:
        parts = [int(p) for p in args.partitions.split(",")]
    except ValueError:
        raise ValueError(
            f"--partitions takes comma-separated counts such as 16,64,256, not {args.partitions!r}"
        ) from None
    strategies = args.strategies.split(",")
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r} in --strategies; choose from {STRATEGIES}")
    budgets = args.memory_budget.split(",")
    points = []

    def run(budget: str, partitions: int, maps: int, strategy: str) -> dict:
        return shuffle_bench(
            rows=args.rows,
            workers=args.workers,
            partitions=partitions,
            memory_budget=parse_bytes(budget),
            maps=maps,
            worker=worker_command(),
            sequential=True,  # reducers after the seal for every strategy: the same shape
            strategy=strategy,
        )

    for budget in budgets:
        for partitions in parts:
            maps = args.maps or partitions
            # Repeats go round the strategies (a slow spell of the machine hits them all
            # alike); a strategy slower than --skip-slower x the point's fastest first run is
            # not repeated (it cannot be the best; its one run is reported).
            runs: dict[str, list[dict]] = {s: [] for s in strategies}
            for rep in range(args.repeat):
                first = min((r[0]["seconds"] for r in runs.values() if r), default=None)
                for strategy in strategies:
                    if rep and first and runs[strategy][0]["seconds"] > args.skip_slower * first:
                        continue
                    runs[strategy].append(run(budget, partitions, maps, strategy))
            for strategy in strategies:
                report = min(runs[strategy], key=lambda r: r["seconds"])
                point = {
                    "runs_seconds": [r["seconds"] for r in runs[strategy]],
                    "memory_budget": budget,
                    "maps": maps,
                    "partitions": partitions,
                    "strategy": strategy,
                    "choice": report.get("strategy_choice"),
                    "choices": [r.get("strategy_choice") for r in runs[strategy]],
                    "bytes": report["bytes"],
                    "seconds": report["seconds"],
                    "median_seconds": statistics.median(r["seconds"] for r in runs[strategy]),
                    "throughput_gb_s": report["throughput_gb_s"],
                    "map_seconds": report["map_seconds"],
                    "reduce_seconds": report["reduce_tail_seconds"],
                    "blocks_read": report["blocks"],
                    "map_blocks": report["map_blocks"],
                    "bytes_per_block_read": report["bytes"] // max(1, report["blocks"]),
                    "spilled_bytes": report["spilled_bytes"],
                    "same_pipeline_bound_seconds": report["same_pipeline_bound_seconds"],
                }
                if report.get("calibration"):
                    point["calibration"] = report["calibration"]
                points.append(point)
                print(
                    f"{budget:>6} M={maps:5d} R={partitions:5d} {strategy:9s} "
                    f"{point['seconds']:7.2f} s (map {point['map_seconds']:.2f} + reduce "
                    f"{point['reduce_seconds']:.2f}), {point['blocks_read']} blocks of "
                    f"{point['bytes_per_block_read']} B, runs "
                    + ", ".join(f"{t:.2f}" for t in point["runs_seconds"])
                    + (f" [{point['choice']}]" if point["choice"] else ""),
                    file=sys.stderr,
                    flush=True,
                )
    out = {
        "rows": args.rows,
        "workers": args.workers,
        "maps": args.maps or "= partitions",
        "repeat": args.repeat,
        "memory_budgets": budgets,
        "points": points,
    }
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        _plot_sweep(out, args.plot)
    print(text)
    return 0


def _plot_sweep(sweep: dict, path: str) -> None:
    """Throughput against partitions, one line per strategy, one panel per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sweep["memory_budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        pts = [p for p in sweep["points"] if p["memory_budget"] == budget]
        for strategy in dict.fromkeys(p["strategy"] for p in pts):
            line = sorted(
                (p["partitions"], p["throughput_gb_s"]) for p in pts if p["strategy"] == strategy
            )
            ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=strategy)
        ax.set_xscale("log")
        ax.set_xlabel(
            "partitions R (maps M = R)" if sweep["maps"] == "= partitions" else "partitions R"
        )
        ax.set_ylabel("throughput, GB/s")
        ax.set_title(f"{sweep['rows']:,} rows, {sweep['workers']} workers, budget {budget}/worker")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _tpch(args: argparse.Namespace) -> int:
    root = args.data or os.path.join("data", f"tpch-sf{args.sf:g}")
    t = time.monotonic()
    if not tpch.is_generated(root):
        print(f"generating TPC-H SF{args.sf:g} in {root}", file=sys.stderr)
        tpch.ensure_data(args.sf, root, progress=sys.stderr.isatty())
        print(f"generated in {time.monotonic() - t:.1f} s", file=sys.stderr)
    duck = tpch.duckdb_connect(root) if args.check else None
    runtimes = [r.strip() for r in args.runtime.split(",")]
    unknown = [r for r in runtimes if r not in ("local", "ray")]
    if unknown or not runtimes:
        print(f"--runtime takes local, ray or local,ray, not {args.runtime!r}", file=sys.stderr)
        return 2
    reports, wrong = [], []
    for runtime in runtimes:
        report = _tpch_on(args, runtime, root, duck)
        if report is None:
            return 2
        reports.append(report)
        wrong += [(runtime, r["query"]) for r in report["queries"] if r["answer"].startswith("W")]
    if len(reports) > 1:
        print("runtime  total s  ratio to 1-process DataFusion")
        for r in reports:
            print(f"{r['runtime']:>7} {r['total_cluster_s']:>8.3f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports[0] if len(reports) == 1 else {"runs": reports}, f, indent=2)
    if wrong:
        print(f"wrong answers: {wrong}", file=sys.stderr)
        return 1
    if duck is not None:
        print(f"all answers match DuckDB on the same Parquet files ({', '.join(runtimes)})")
    return 0


def _idle_rss_mib(c: Cluster, wait_s: float = 5.0) -> list[int]:
    """Each worker's RSS once it stops growing (a Python-hosted worker imports Polars and
    pyarrow in the background as it starts), in MiB."""
    last = [w["rss_bytes"] for w in c.stats()]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = [w["rss_bytes"] for w in c.stats()]
        if all(abs(a - b) < 2**20 for a, b in zip(now, last, strict=True)):
            break
        last = now
    return [round(x / 2**20) for x in last]


def _tpch_on(args: argparse.Namespace, runtime: str, root: str, duck: object) -> dict | None:
    """Run the queries on one cluster of ``runtime``; the report (None: a bad --set)."""
    queries = args.queries or list(range(1, 23))
    rows = []
    tls = {"on": True, "off": False, "mutual": "mutual"}[args.tls]
    with Cluster(
        workers=args.workers,
        memory_budget=args.memory_budget,
        strategy=args.strategy,
        tls=tls,
        runtime=runtime,
        ray_address=args.ray_address,
    ) as c:
        for name, path in tpch.table_paths(root).items():
            c.register_parquet(name, path)
        idle_mib = _idle_rss_mib(c)
        for setting in args.set:
            name, sep, value = setting.partition("=")
            if not sep or not name.strip():
                print(f"--set wants NAME=VALUE, got {setting!r}", file=sys.stderr)
                return None
            c.sql(f"SET {name.strip()} = '{value.strip()}'")
        settings = "".join(f", {s}" for s in args.set)
        print(
            f"strategy {args.strategy}, {args.workers} workers on {runtime}, SF{args.sf:g}, "
            f"tls {args.tls}{settings}"
        )
        print(
            f"{'query':>5} {'cluster s':>10} {'1-proc DF s':>11} {'ratio':>6} {'duckdb s':>9} "
            f"{'stages':>6} {'shuffled MB':>12} {'calls':>6}  answer"
        )
        for q in queries:
            sql, ordered = tpch.query(q, args.sf)
            secs = local_s = float("inf")
            for _ in range(max(1, args.repeat)):
                t = time.monotonic()
                got = c.sql(sql)
                secs = min(secs, time.monotonic() - t)
                if args.baseline:
                    local_s = min(local_s, c.sql_single_process(sql)[1])
            if not args.baseline:
                local_s = float("nan")
            stages = c.last_metrics.get("stages", [])
            rpcs = c.last_metrics.get("rpcs", 0)
            shuffled = sum(s["bytes"] for s in stages) / 1e6
            ref_s, verdict = float("nan"), "not checked"
            if duck is not None:
                t = time.monotonic()
                expected = duck.sql(sql).to_arrow_table()
                ref_s = time.monotonic() - t
                diff = tpch.compare(expected, got, ordered)
                verdict = "ok (matches DuckDB)" if diff is None else f"WRONG: {diff}"
            row = {
                "query": q,
                "cluster_s": secs,
                "single_process_datafusion_s": local_s,
                "ratio": secs / local_s,
                "duckdb_s": ref_s,
                "stages": len(stages),
                "shuffled_mb": shuffled,
                "rpcs": rpcs,
                "exchanges": stages,
                "answer": verdict,
            }
            rows.append(row)
            print(
                f"{f'q{q:02d}':>5} {secs:>10.3f} {local_s:>11.3f} {row['ratio']:>6.2f} "
                f"{ref_s:>9.3f} {len(stages):>6} {shuffled:>12.1f} {rpcs:>6}  {verdict}",
                flush=True,
            )
        stats = c.stats()
        peak_mib = [round(w["peak_rss_bytes"] / 2**20) for w in stats]
        memory = [
            {
                "peak_operator_mib": round(w["peak_operator_bytes"] / 2**20),
                "peak_unspillable_mib": round(w["peak_unspillable_bytes"] / 2**20),
                "peak_granted_mib": round(w["peak_granted_bytes"] / 2**20),
                "waited_tasks": w["waited_tasks"],
                "overdraft_tasks": w["overdraft_tasks"],
            }
            for w in stats
        ]
    total = sum(r["cluster_s"] for r in rows)
    total_local = sum(r["single_process_datafusion_s"] for r in rows)
    total_ref = sum(r["duckdb_s"] for r in rows)
    print(
        f"{'total':>5} {total:>10.3f} {total_local:>11.3f} {total / total_local:>6.2f} "
        f"{total_ref:>9.3f}"
    )
    print(f"RSS per worker (MiB): idle {idle_mib}, peak {peak_mib}, budget {args.memory_budget}")
    print(f"memory per worker: {memory}")
    return {
        "runtime": runtime,
        "sf": args.sf,
        "workers": args.workers,
        "strategy": args.strategy,
        "settings": args.set,
        "repeat": args.repeat,
        "queries": rows,
        "total_cluster_s": total,
        "total_single_process_datafusion_s": total_local,
        "ratio": total / total_local,
        "total_duckdb_s": total_ref,
        "memory_budget": args.memory_budget,
        "idle_rss_mib": idle_mib,
        "peak_rss_mib": peak_mib,
        "memory": memory,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flightshuffle-bench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tpch", help="TPC-H on a local cluster: generate, run, check vs DuckDB")
    t.add_argument("--sf", type=tpch.scale_factor, default=1.0)
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--data", help="data directory (default data/tpch-sf<SF>)")
    t.add_argument(
        "--queries",
        type=tpch.query_numbers,
        default=None,
        help="e.g. 1,3,18 (default all 22)",
    )
    t.add_argument("--memory-budget", default="4GiB")
    t.add_argument(
        "--tls", default="on", choices=["on", "off", "mutual"], help="TLS between the processes"
    )
    t.add_argument(
        "--runtime",
        default="local",
        help="where the workers run: local (processes here), ray (Ray actors), or local,ray "
        "(both, one after the other, in the same run)",
    )
    t.add_argument(
        "--ray-address", default=None, help="for ray.init: auto, ray://head:10001 (default local)"
    )
    t.add_argument(
        "--strategy",
        default="pull",
        choices=list(STRATEGIES),
        help="exchange strategy of every query (default pull)",
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a session setting for every query, e.g. flightshuffle.skew_factor=0 (repeatable)",
    )
    t.add_argument(
        "--no-check", dest="check", action="store_false", help="skip the DuckDB answer check"
    )
    t.add_argument("--json", help="also write the results as JSON to this file")
    t.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each query this many times (cluster and baseline) and keep the fastest",
    )
    t.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip timing single-process DataFusion on the same files",
    )
    t.set_defaults(run=_tpch)

    b = sub.add_parser(
        "shuffle",
        help="shuffle generated lineitem-like rows on a local cluster, check and time it",
    )
    b.add_argument("--rows", type=int, default=10_000_000)
    b.add_argument("--workers", type=int, default=4)
    b.add_argument("--partitions", type=int, default=16)
    b.add_argument(
        "--memory-budget",
        default="2GiB",
        help="memory budget per worker (bytes or e.g. 256MiB): tasks, blocks and operators "
        "share it; beyond it blocks spill and tasks wait",
    )
    b.add_argument("--maps", type=int, default=0, help="map tasks (0 = 4 per worker)")
    b.add_argument("--batch-rows", type=int, default=65_536)
    b.add_argument(
        "--parity",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="parity shards per stripe (blocks at their owners, not merged)",
    )
    b.add_argument("--seed", type=int, default=42)
    b.add_argument("--compression", default="auto", choices=["auto", "none", "lz4", "zstd"])
    b.add_argument(
        "--tls", default="on", choices=["on", "off", "mutual"], help="TLS between the processes"
    )
    b.add_argument(
        "--worker-command",
        help="command starting one worker (default: this Python's flightshuffle.worker); e.g. "
        "the Rust flightshuffle-worker binary, to measure a worker without Python",
    )
    b.add_argument(
        "--strategy",
        default="pull",
        choices=list(STRATEGIES),
        help="exchange strategy (all but pull start the reducers after the seal)",
    )
    b.add_argument(
        "--sequential",
        action="store_true",
        help="start the reducers only after the map side is sealed (no overlap), for comparison",
    )
    b.set_defaults(run=_bench)

    w = sub.add_parser(
        "strategy-sweep",
        help="Exoshuffle Fig. 4 at this scale: shuffle time vs partitions, per strategy",
    )
    w.add_argument("--rows", type=int, default=13_000_000, help="about 2 GB of Arrow data")
    w.add_argument("--workers", type=int, default=4)
    w.add_argument("--repeat", type=int, default=1, help="runs per point; the fastest counts")
    w.add_argument(
        "--skip-slower",
        type=float,
        default=1.5,
        help="do not repeat a strategy whose first run took over this many times the fastest",
    )
    w.add_argument("--maps", type=int, default=0, help="map tasks (0: as many as partitions)")
    w.add_argument("--partitions", default="50,100,250,500,1000")
    w.add_argument("--strategies", default=",".join(STRATEGIES))
    w.add_argument(
        "--memory-budget",
        default="2GiB",
        help="per worker; several comma-separated: one panel each",
    )
    w.add_argument("--json", help="also write the points to this file")
    w.add_argument("--plot", help="also draw throughput vs partitions to this PNG")
    w.set_defaults(run=_sweep)

    kt = sub.add_parser(
        "kill-trials",
        help="SIGKILL a random worker at a random moment of SQL, shuffle, dataset, online jobs",
    )
    kt.add_argument("--kinds", default="sql,shuffle,dataset,online")
    kt.add_argument("--trials", type=int, default=20, help="trials per kind")
    kt.add_argument("--seed", type=int, default=1)
    kt.add_argument(
        "--memory-budget", help="per worker (e.g. 32MiB: the shuffles spill, kills land in spills)"
    )
    kt.add_argument(
        "--parity",
        default="0",
        choices=["0", "1", "2", "all"],
        help="the clusters' parity (all: 0 and 1 in turn)",
    )
    kt.add_argument(
        "--strategy",
        default="all",
        choices=["pull", "merged", "push", "two-level", "auto", "all"],
        help="the clusters' strategy (all: each in turn, trial by trial)",
    )
    kt.add_argument("--json", help="also write the report to this file")
    kt.set_defaults(run=_kill_trials)

    so = sub.add_parser(
        "soak",
        help="many threads run SQL, shuffles, datasets and online aggregations at once; "
        "every answer checked; peak RSS per worker",
    )
    so.add_argument("--threads", type=int, default=8)
    so.add_argument("--jobs", type=int, default=4, help="jobs per thread")
    so.add_argument("--workers", type=int, default=2)
    so.add_argument("--memory-budget", default="64MiB")
    so.add_argument("--shuffle-rows", type=int, default=2_000_000)
    so.add_argument(
        "--kinds", default="sql,shuffle,dataset,online", help="job kinds, dealt in turn"
    )
    so.add_argument("--json", help="also write the report to this file")
    so.set_defaults(run=_soak)

    from flightshuffle_bench import skewbench

    skewbench.add_parser(sub)
    from flightshuffle_bench import (
        hostsbench,
        lossbench,
        online_coverage,
        online_having,
        onlinebench,
        overheadbench,
        samplebound,
        shrinkbench,
        storagebench,
        tpcds,
    )

    onlinebench.add_parser(sub)
    online_coverage.add_parser(sub)
    online_having.add_parser(sub)
    samplebound.add_parser(sub)
    storagebench.add_parser(sub)
    overheadbench.add_parser(sub)
    shrinkbench.add_parser(sub)
    tpcds.add_parser(sub)
    hostsbench.add_parser(sub)
    lossbench.add_parser(sub)

    from flightshuffle import cli

    o = sub.add_parser(
        "online", help="flightshuffle online on generated TPC-H data (a Q1-like query by default)"
    )
    o.add_argument("--sql", help="aggregate query (default: a TPC-H Q1-like query)")
    o.add_argument("--sf", type=tpch.scale_factor, default=1.0, help="TPC-H scale factor")
    o.add_argument("--data", help="TPC-H data directory (default data/tpch-sf<SF>)")
    cli.online_arguments(o)
    o.set_defaults(run=_online)
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except (ShuffleError, ValueError, RuntimeError) as e:
        print(f"flightshuffle-bench: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
