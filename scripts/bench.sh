#!/usr/bin/env bash
# The shuffle bench: build the release extension (the Python-hosted workers) and the Rust bench
# driver, start a local cluster of worker processes, shuffle generated lineitem-like rows, check
# the output multiset, print JSON with times.
# Extra arguments go to `flightshuffle-bench shuffle` (defaults: 10M rows, 4 workers, R=16).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "== building the release extension and the bench driver (output shown only on failure)"
quiet maturin develop --release
# The whole workspace: the same features as the extension, so the two share one build.
quiet cargo build --release --workspace --bins
flightshuffle-bench shuffle "$@"
