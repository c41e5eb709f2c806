#!/usr/bin/env bash
# The main job: build the release extension, start a local cluster of worker processes,
# shuffle generated lineitem-like rows, check the output multiset, print JSON with times.
# Extra arguments go to `flightshuffle shuffle-bench` (defaults: 10M rows, 4 workers, R=16).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "== building the release extension (output shown only on failure)"
quiet maturin develop --release
flightshuffle shuffle-bench "$@"
