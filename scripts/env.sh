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
# pip >= 25.1 reads [dependency-groups] from pyproject.toml.
if ! "$VENV/bin/python" -c 'import sys, importlib.metadata as m; sys.exit(int(m.version("pip").split(".")[0]) < 25)' 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade "pip>=25.1"
fi
# pip prints "Requirement already satisfied" for dependency groups even with -q: keep its output
# only when the install fails.
pip_log="$(mktemp)"
if ! "$VENV/bin/python" -m pip install -q --group dev >"$pip_log" 2>&1; then
  cat "$pip_log" >&2
  rm -f "$pip_log"
  exit 1
fi
rm -f "$pip_log"
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
# Build the extension against this interpreter both under cargo and maturin (no rebuild flip-flop).
export PYO3_PYTHON="$VENV/bin/python"
