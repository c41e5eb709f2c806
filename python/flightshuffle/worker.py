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


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc malloc's arenas before the worker's threads start. With one arena per thread
    (up to 8 per core) memory freed by one thread stays cached in another's arena: in the
    shuffle bench (10 M rows, 4 workers, 89 MiB budget) peak RSS per worker was 650-675 MiB
    uncapped and 430-450 MiB capped. mimalloc as the extension's allocator peaked at ~1 GiB."""
    with contextlib.suppress(Exception):  # not glibc: nothing to do
        import ctypes

        m_arena_max = -8  # from glibc's malloc.h
        ctypes.CDLL("libc.so.6").mallopt(m_arena_max, arenas)


def main(argv: list[str] | None = None) -> None:
    """Run the worker with ``argv`` (default: this process's arguments) until it is stopped."""
    _limit_malloc_arenas()
    threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
    try:
        run_worker(["flightshuffle-worker", *(sys.argv[1:] if argv is None else argv)])
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - report any startup failure plainly
        print(f"flightshuffle worker: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
