"""The ``flightshuffle`` command line."""

from __future__ import annotations

import argparse
import sys

from flightshuffle import ShuffleError, parse_bytes, worker_command
from flightshuffle._native import shuffle_bench


def _bench(args: argparse.Namespace) -> int:
    report = shuffle_bench(
        args.rows,
        args.workers,
        args.partitions,
        parse_bytes(args.memory_budget),
        args.maps,
        args.batch_rows,
        args.seed,
        args.compression,
        worker_command(),
    )
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flightshuffle", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "shuffle-bench",
        help="shuffle generated lineitem-like rows on a local cluster, check and time it",
    )
    b.add_argument("--rows", type=int, default=10_000_000)
    b.add_argument("--workers", type=int, default=4)
    b.add_argument("--partitions", type=int, default=16)
    b.add_argument(
        "--memory-budget",
        default="2GiB",
        help="block store budget per worker (bytes or e.g. 256MiB); beyond it blocks spill",
    )
    b.add_argument("--maps", type=int, default=0, help="map tasks (0 = 4 per worker)")
    b.add_argument("--batch-rows", type=int, default=65_536)
    b.add_argument("--seed", type=int, default=42)
    b.add_argument("--compression", default="auto", choices=["auto", "none", "lz4", "zstd"])
    b.set_defaults(run=_bench)
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except (ShuffleError, ValueError) as e:
        print(f"flightshuffle: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
