"""``python -m flightshuffle.worker``: one worker process (block store + Flight server)."""

from __future__ import annotations

import contextlib
import sys
import threading

from flightshuffle._native import run_worker


def _warm_up() -> None:
    """Import what Python map and fold tasks use (Polars, pyarrow.parquet, the task modules)
    while the worker starts, so the first task does not pay for it."""
    # A failure here is reported by the first task that needs the module.
    with contextlib.suppress(Exception):
        import flightshuffle.online  # noqa: F401 - imports ops, _exec, polars, pyarrow


def main() -> None:
    threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
    try:
        run_worker(["flightshuffle-worker", *sys.argv[1:]])
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - report any startup failure plainly
        print(f"flightshuffle worker: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
