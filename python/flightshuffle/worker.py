"""``python -m flightshuffle.worker``: one worker process (block store + Flight server)."""

from __future__ import annotations

import sys

from flightshuffle._native import run_worker


def main() -> None:
    try:
        run_worker(["flightshuffle-worker", *sys.argv[1:]])
    except KeyboardInterrupt:
        pass
    except Exception as e:  # noqa: BLE001 - report any startup failure plainly
        print(f"flightshuffle worker: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
