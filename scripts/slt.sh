#!/usr/bin/env bash
# DataFusion's own sqllogictest files, run through the distributed exchange on a local cluster
# and on single-process DataFusion in the same run (see slt/src/main.rs). The files come from
# the datafusion-sqllogictest package of the DataFusion version we use, fetched once from
# crates.io into ~/.cache/flightshuffle/slt.
#   bash scripts/slt.sh [--release] [flightshuffle-slt options] [FILES...]
# e.g. bash scripts/slt.sh --release --json docs/slt/all.json          (every file)
#      bash scripts/slt.sh --baseline docs/slt/ci-baseline.json aggregate.slt joins.slt
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
version=55.2.0
cache="$HOME/.cache/flightshuffle/slt"
dir="$cache/datafusion-sqllogictest-$version"
if [ ! -d "$dir/test_files" ]; then
  mkdir -p "$cache"
  curl -sSfL "https://static.crates.io/crates/datafusion-sqllogictest/datafusion-sqllogictest-$version.crate" \
    | tar xz -C "$cache"
fi
# The whole workspace, not `-p slt`: the same feature set as `cargo test --workspace`, so the
# DataFusion stack it compiled is reused instead of compiled again for slt alone.
profile=debug
if [ "${1:-}" = "--release" ]; then
  shift
  profile=release
  cargo build --release -q --workspace --bins
else
  cargo build -q --workspace --bins
fi
exec "$CARGO_TARGET_DIR/$profile/flightshuffle-slt" --dir "$dir" "$@"
