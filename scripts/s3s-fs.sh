#!/usr/bin/env bash
# The S3-compatible server the storage benchmark runs against (a Rust server: moto, the tests'
# server, is Python and would be the bottleneck): s3s-fs 0.14.1 (Apache-2.0; the newest
# release that builds with this machine's rustc), built once into ~/.cache and its path printed.
set -euo pipefail
ROOT="${FLIGHTSHUFFLE_TOOLS:-$HOME/.cache/flightshuffle-tools}"
BIN="$ROOT/bin/s3s-fs"
if [ ! -x "$BIN" ]; then
  echo "== building s3s-fs 0.14.1 into $ROOT (once, about 3 min)" >&2
  CARGO_TARGET_DIR="$HOME/.cache/s3s-target" cargo install s3s-fs --version 0.14.1 \
    --features binary --root "$ROOT" --locked --quiet >&2
fi
echo "$BIN"
