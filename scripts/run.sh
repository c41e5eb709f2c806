#!/usr/bin/env bash
# The main job: build the release extension, start a local cluster of 2 worker processes, run
# the 22 TPC-H queries at SF1 distributed (data generated on first use into data/tpch-sf1),
# check every answer against DuckDB on the same Parquet files, print a table of times.
# Extra arguments go to `flightshuffle-bench tpch` (e.g. --sf 0.1, --workers 3, --queries 1,18).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "== building the release extension (output shown only on failure)"
quiet maturin develop --release
flightshuffle-bench tpch --sf 1 --workers 2 "$@"
