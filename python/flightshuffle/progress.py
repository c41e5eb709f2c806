"""Progress bars in a terminal (on stderr, with tqdm) for SQL queries and shuffles: shown
when stderr is a TTY, or as ``progress=`` says. A query's bar counts its exchanges sealed of
those planned, with the rows, bytes and spill its committed map tasks wrote; a shuffle's
counts partitions read, with their rows."""

from __future__ import annotations

import sys
import threading
from typing import Any, Self

# How often a query's bar asks the driver for its counters (seconds).
POLL_S = 0.25


def showing(progress: bool | None) -> bool:
    """Whether to draw a bar: ``progress`` if given, else whether stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class QueryProgress:
    """A bar for one blocking call on ``native`` (a ``NativeCluster``), updated from the
    driver's counters by a background thread while the call runs."""

    def __init__(self, native: Any, desc: str, show: bool) -> None:
        self._native, self._desc, self._show = native, desc, show
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None

    def __enter__(self) -> Self:
        if not self._show:
            return self
        from tqdm import tqdm

        self._before = self._native.progress()
        self._bar = tqdm(total=0, desc=self._desc, unit="stage", leave=False)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _update(self) -> None:
        now = self._native.progress()
        tasks, rows, size, spill, planned, sealed = (
            a - b for a, b in zip(now, self._before, strict=True)
        )
        bar = self._bar
        bar.total = max(planned, sealed)
        bar.n = sealed
        bar.set_postfix_str(
            f"{tasks} tasks, {rows:,} rows, {_bytes(size)}"
            + (f", spilled {_bytes(spill)}" if spill else ""),
            refresh=False,
        )
        bar.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._update()

    def __exit__(self, *exc: object) -> None:
        if self._bar is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()
        self._bar.close()


class PartitionProgress:
    """A bar over a shuffle's partitions as they are read."""

    def __init__(self, partitions: int, show: bool) -> None:
        self._bar: Any = None
        self._rows = 0
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=partitions, desc="shuffle", unit="partition", leave=False)

    def read(self, rows: int) -> None:
        if self._bar is None:
            return
        self._rows += rows
        self._bar.set_postfix_str(f"{self._rows:,} rows", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.refresh()  # the last count, which tqdm may not have drawn yet
            self._bar.close()
            self._bar = None
