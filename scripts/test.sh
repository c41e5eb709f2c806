#!/usr/bin/env bash
# Every test: formatting and lints, Rust unit + integration tests (real worker processes),
# then the Python package built with maturin and its pytest suite (real Polars/DuckDB).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
start=$SECONDS
echo "== layers: no import circles between files"
python3 scripts/check_layers.py
echo "== rust: fmt, clippy, tests"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
echo "== DataFusion's sqllogictest files (a subset), distributed vs single-process"
quiet bash scripts/slt.sh --baseline docs/slt/ci-baseline.json aggregate.slt joins.slt group_by.slt null_aware_anti_join.slt
echo "== python: build (maturin develop), ruff, pytest"
echo "== building the extension (maturin develop; output shown only on failure)"
quiet maturin develop
ruff check python bench tests
ruff format --check python bench tests
mkdocs build --strict --quiet
python -m pytest -q tests
echo "== all tests passed in $((SECONDS - start)) s"
