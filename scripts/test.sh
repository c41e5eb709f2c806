#!/usr/bin/env bash
# Every test: formatting and lints, Rust unit + integration tests (real worker processes),
# then the Python package built with maturin and its pytest suite (real Polars/DuckDB).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
start=$SECONDS
echo "== layers: no import circles between files"
python3 scripts/check_layers.py
echo "== rust: fmt, then clippy's lints and the tests in one build"
cargo fmt --all -- --check
# Clippy lints the workspace's own crates while they are compiled for the tests, as
# `cargo clippy --workspace --all-targets -- -D warnings` would (clippy-driver wraps rustc for
# the workspace's crates; CLIPPY_ARGS is how cargo-clippy hands it `-D warnings`). `cargo clippy`
# would first compile every dependency once more in check mode: about 11 of a fresh machine's
# minutes. The same settings stay exported for slt.sh and maturin below, so they reuse this build.
export RUSTC_WORKSPACE_WRAPPER
RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo test --workspace --all-targets --no-run
cargo test --workspace
echo "== DataFusion's sqllogictest files (a subset), distributed vs single-process"
quiet bash scripts/slt.sh --baseline docs/slt/ci-baseline.json aggregate.slt joins.slt group_by.slt null_aware_anti_join.slt
# Headless Chromium renders the event-log report in tests/test_report_browser.py (Debian's
# package; skipped with its reason where it cannot be installed: not root, no apt).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== installing chromium (apt-get; once per machine)"
  quiet apt-get update -q || true
  DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -q chromium || echo "(chromium not installed: the browser test is skipped)"
fi
# The Arrow Flight SQL JDBC driver for tests/test_flight_sql.py (skipped where there is no
# JDK or Maven, or the registry does not serve it).
if command -v mvn >/dev/null && command -v javac >/dev/null && \
  [ ! -f "$HOME/.m2/repository/org/apache/arrow/flight-sql-jdbc-driver/18.3.0/flight-sql-jdbc-driver-18.3.0.jar" ]; then
  echo "== fetching the Arrow Flight SQL JDBC driver (mvn; once per machine)"
  quiet mvn -q dependency:get -Dartifact=org.apache.arrow:flight-sql-jdbc-driver:18.3.0 -Dtransitive=false || echo "(not fetched: the JDBC test is skipped)"
fi
echo "== python: build (maturin develop), ruff, pytest"
echo "== building the extension (maturin develop; output shown only on failure)"
quiet maturin develop
ruff check python bench tests
ruff format --check python bench tests
mkdocs build --strict --quiet
python -m pytest -q tests
echo "== all tests passed in $((SECONDS - start)) s"
