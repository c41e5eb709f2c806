# Sourced by the other scripts: a Python venv with the pinned tools, and a cargo target dir
# outside the clone (so fresh clones rebuild incrementally).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/flightshuffle-target}"
VENV="${FLIGHTSHUFFLE_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
# Run a command with its output kept back unless it fails (pip prints "Requirement already
# satisfied" lines even with -q, for dependency groups and under maturin develop).
quiet() {
  local log
  log="$(mktemp)"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
# pip >= 25.1 reads [dependency-groups] from pyproject.toml.
if ! "$VENV/bin/python" -c 'import sys, importlib.metadata as m; sys.exit(int(m.version("pip").split(".")[0]) < 25)' 2>/dev/null; then
  quiet "$VENV/bin/python" -m pip install --upgrade "pip>=25.1"
fi
quiet "$VENV/bin/python" -m pip install --group dev
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
# Build the extension against this interpreter both under cargo and maturin (no rebuild flip-flop).
export PYO3_PYTHON="$VENV/bin/python"
# The benchmarks and trials (bench/flightshuffle_bench, `flightshuffle-bench`): a package of this
# checkout, never in the wheel, installed editable once per venv and checkout.
if ! "$VENV/bin/python" -c "import sys, flightshuffle_bench as b; sys.exit(not b.__file__.startswith('$ROOT/'))" 2>/dev/null; then
  quiet "$VENV/bin/python" -m pip install --no-deps -e "$ROOT/bench"
fi
