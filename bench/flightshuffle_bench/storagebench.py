"""``flightshuffle-bench storage-bench``: the same shuffle (M maps into R = M partitions) on the
in-memory Flight path, durable through a shared directory (``file://``) and durable through an
S3-compatible server, through the store directly and in two levels, with parity, in one run;
then a worker killed after the map side under each (``--modes`` picks some). Prints
JSON: seconds (best of ``--repeat``), the ratio to the Flight path, requests per shuffle as
counted, and the S3 request cost per TB of shuffled data at list prices for this layout (one
object per map, ranged reads) beside a layout of one object per (map, reducer) read by LIST
plus whole-object GETs (Sail's, 2026-07).

The S3 server is s3s-fs (a Rust server over a local directory, built by
``scripts/s3s-fs.sh``) started on loopback, or moto's in a thread of this process with
``--s3-server moto`` (moto serves about 0.5 GB/s from Python: its figures are the server's
limit, not the protocol's), or any endpoint with ``--s3-endpoint``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from flightshuffle_bench.emit import emit

# S3 Standard list prices (us-east-1), dollars per 1,000 requests.
PUT_PER_1K = 0.005
GET_PER_1K = 0.0004
LIST_PER_1K = 0.005


def frame(rows: int) -> Any:
    import polars as pl

    return pl.DataFrame(
        {
            "key": pl.int_range(0, rows, eager=True) * 7919 % 1_000_003,
            "v": pl.int_range(0, rows, eager=True),
            "s": pl.Series([f"payload-{i % 1000:04d}" for i in range(rows)]),
        }
    )


def checksum(parts: list[Any]) -> tuple[int, int]:
    import polars as pl

    df = pl.concat([pl.from_arrow(p) for p in parts])
    return df.height, int(df.hash_rows(seed=7).sum()) % 2**64


def request_cost_per_tb(puts: float, gets: float, lists: float, data_bytes: int) -> float:
    dollars = puts * PUT_PER_1K / 1000 + gets * GET_PER_1K / 1000 + lists * LIST_PER_1K / 1000
    return dollars * (1e12 / max(1, data_bytes))


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def run_mode(args: argparse.Namespace, df: Any, maps: int, storage: dict[str, Any]) -> dict:
    """One cluster with ``storage`` (its extra ``Cluster`` arguments): the shuffle timed, its
    requests counted, then a worker killed once its maps committed."""
    from flightshuffle import Cluster

    want = checksum([df.to_arrow()])
    data_bytes = int(df.estimated_size())
    map_bytes = max(1, data_bytes // maps)
    out: dict[str, Any] = {}
    kwargs = {"memory_budget": args.memory_budget, **storage}
    with Cluster(workers=args.workers, **kwargs) as c:
        best = float("inf")
        for _ in range(args.repeat):
            before = c.storage_stats()
            t = time.monotonic()
            result = c.shuffle(df, by="key", partitions=maps, map_bytes=map_bytes)
            parts = list(result)
            best = min(best, time.monotonic() - t)
            requests = delta(c.storage_stats(), before)
            mapped = result.wait_mapped()
            out["maps"] = mapped["maps"]
            if "strategy_choice" in mapped:
                out["choice"] = mapped["strategy_choice"]
            assert checksum(parts) == want, "output multiset differs"
        out["seconds"] = best
        out["requests_per_shuffle"] = requests
        out["tiered_segments"] = sum(w["tiered_segments"] for w in c.stats())
        # A worker killed once the map side committed: time to read every partition.
        before_rec, before_req = c.recovery(), c.storage_stats()
        t = time.monotonic()
        result = c.shuffle(df, by="key", partitions=maps, map_bytes=map_bytes)
        result.wait_mapped()
        first = next(result)
        os.kill(c.worker_pids[1], signal.SIGKILL)
        parts = [first, *result]
        took = time.monotonic() - t
        assert checksum(parts) == want, "output multiset differs after the kill"
        rec = c.recovery()
        out["after_kill"] = {
            "seconds": took,
            "recomputed_maps": rec["recomputed_maps"] - before_rec["recomputed_maps"],
            "restored_blocks": rec["restored_blocks"] - before_rec["restored_blocks"],
            "rebuilt_blocks": rec["rebuilt_blocks"] - before_rec["rebuilt_blocks"],
            "rerun_jobs": rec["rerun_jobs"] - before_rec["rerun_jobs"],
            "bytes_read_from_store": delta(c.storage_stats(), before_req)["bytes_read"],
        }
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str, root: str) -> tuple[str, Any]:
    """Start an S3 server on loopback; returns its endpoint and a stop function."""
    if kind == "moto":
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        return f"http://{host}:{port}", moto.stop
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "scripts", "s3s-fs.sh")
    binary = subprocess.run(["bash", script], check=True, capture_output=True, text=True)
    port = free_port()
    proc = subprocess.Popen(
        [binary.stdout.strip(), "--host", "127.0.0.1", "--port", str(port)]
        + ["--access-key", "bench", "--secret-key", "bench-secret", root],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("s3s-fs did not start") from None
            time.sleep(0.1)

    def stop() -> None:
        proc.kill()
        proc.wait()

    return f"http://127.0.0.1:{port}", stop


def run(args: argparse.Namespace) -> int:
    df = frame(args.rows)
    data_bytes = int(df.estimated_size())
    stop = None
    endpoint = args.s3_endpoint
    server_root = tempfile.TemporaryDirectory(prefix="fs-bench-s3-")
    if endpoint is None:
        endpoint, stop = start_server(args.s3_server, server_root.name)
    s3_options = {
        "aws_endpoint": endpoint,
        "aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
        "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "bench-secret"),
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=s3_options["aws_access_key_id"],
        aws_secret_access_key=s3_options["aws_secret_access_key"],
        region_name="us-east-1",
    ).create_bucket(Bucket="fs-bench")
    report: dict[str, Any] = {
        "rows": args.rows,
        "data_bytes": data_bytes,
        "workers": args.workers,
        "repeat": args.repeat,
        "s3_server": args.s3_endpoint or args.s3_server,
        "shapes": {},
    }
    try:
        for maps in args.maps:
            with tempfile.TemporaryDirectory(prefix="fs-bench-store-") as shared:
                modes = {
                    "flight_in_memory": {},
                    "flight_spilling": {"memory_budget": args.spill_budget},
                    "durable_file": {"storage": f"file://{shared}"},
                    "durable_s3": {"storage": "s3://fs-bench/b", "storage_options": s3_options},
                    # Spill past a 0-byte disk budget goes to S3 (not durable).
                    "tiered_s3": {
                        "memory_budget": args.spill_budget,
                        "storage": "s3://fs-bench/t",
                        "storage_options": s3_options,
                        "durable": False,
                        "disk_budget": 0,
                    },
                    # Seer's direct exchange: readers read every map's object by range.
                    "through_s3": {
                        "strategy": "store",
                        "storage": "s3://fs-bench/s",
                        "storage_options": s3_options,
                    },
                    # Seer's two-level exchange: a second level combines each column of
                    # partitions of a group of map objects into one object first.
                    "through_s3_two_level": {
                        "strategy": "store-two-level",
                        "storage": "s3://fs-bench/g",
                        "storage_options": s3_options,
                    },
                    # Recovery by parity (one shard per stripe): the lost worker's blocks
                    # rebuilt, nothing re-run.
                    "flight_parity": {"parity": 1},
                    # `auto` on a durable cluster: weighs Flight and both store exchanges.
                    "auto_s3": {
                        "strategy": "auto",
                        "storage": "s3://fs-bench/a",
                        "storage_options": s3_options,
                    },
                    "flight_push": {"strategy": "push"},
                    "durable_s3_push": {
                        "strategy": "push",
                        "storage": "s3://fs-bench/p",
                        "storage_options": s3_options,
                    },
                }
                shape: dict[str, Any] = {}
                for name, storage in modes.items():
                    if args.modes and name not in args.modes and name != "flight_in_memory":
                        continue
                    print(f"M = R = {maps}: {name}", file=sys.stderr)
                    shape[name] = run_mode(args, df, maps, storage)
            base = shape["flight_in_memory"]["seconds"]
            for r in shape.values():
                r["ratio_to_flight"] = r["seconds"] / base
            m = shape["flight_in_memory"]["maps"]
            costs: dict[str, float] = {}
            for name in ("durable_s3", "through_s3", "through_s3_two_level"):
                if name in shape:
                    r = shape[name]["requests_per_shuffle"]
                    costs[name] = request_cost_per_tb(r["puts"], r["gets"], r["lists"], data_bytes)
            shape["s3_request_cost_per_tb"] = {
                "as_counted": costs,
                # Reads after a loss: at most one ranged GET per (map, lost reducer range).
                "this_layout_read_all_by_range": request_cost_per_tb(0, m * maps, 0, data_bytes),
                "object_per_map_and_reducer_with_list": request_cost_per_tb(
                    m * maps, m * maps, m * maps, data_bytes
                ),
            }
            report["shapes"][str(maps)] = shape
    finally:
        if stop is not None:
            stop()
        server_root.cleanup()
    emit(report, args.json)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "storage-bench",
        help="a shuffle in memory, durable through file:// and through S3, and after a kill (JSON)",
    )
    s.add_argument("--rows", type=int, default=2_000_000)
    s.add_argument("--maps", type=int, nargs="+", default=[50, 250], help="M = R values")
    s.add_argument("--workers", type=int, default=3)
    s.add_argument("--memory-budget", default="2GiB")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument(
        "--spill-budget", default="16MiB", help="memory budget of the spilling Flight run"
    )
    s.add_argument(
        "--s3-server",
        choices=["s3s-fs", "moto"],
        default="s3s-fs",
        help="the S3 server started on loopback (default s3s-fs, a Rust server)",
    )
    s.add_argument("--s3-endpoint", help="an S3-compatible endpoint instead of starting one")
    s.add_argument(
        "--modes",
        nargs="+",
        help="only these modes (besides flight_in_memory, the baseline); default: all",
    )
    s.add_argument("--json", help="also write the JSON to this file")
    s.set_defaults(run=run)
