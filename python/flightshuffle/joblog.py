"""The event log of a job run from Python (online aggregation): with
``Cluster(event_log=DIR)``, one ``online-*.jsonl`` file per job holding its start, the
driver's task events while it runs, an ``online_round`` per round (the fraction of the input
read, the groups, the widest interval relative to its estimate) and its end; the same format
as a query's log, so ``flightshuffle report`` and ``Cluster.last_report()`` render it."""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any


def widest_interval(estimates: Any) -> float | None:
    """The largest half-width of an interval relative to its estimate, over every group and
    aggregate of a round's estimates (a Polars frame with ``name``, ``name_low``,
    ``name_high`` columns); None where there is no interval."""
    widest = None
    for name in estimates.columns:
        low, high = f"{name}_low", f"{name}_high"
        if low not in estimates.columns or high not in estimates.columns:
            continue
        for est, lo, hi in zip(
            estimates[name].to_list(),
            estimates[low].to_list(),
            estimates[high].to_list(),
            strict=True,
        ):
            if est is None or lo is None or hi is None or est == 0:
                continue
            rel = (hi - lo) / 2 / abs(est)
            if math.isfinite(rel) and (widest is None or rel > widest):
                widest = rel
    return widest


class JobLog:
    """An open job log (does nothing without ``event_log=``)."""

    def __init__(self, native: Any, what: str, workers: int) -> None:
        name = f"online-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}.jsonl"
        start = {"job": "online", "sql": what, "workers": workers, "pid": os.getpid()}
        self.native = native
        self.path = native.job_log_begin(name, json.dumps(start))
        self.started = time.perf_counter()

    def end(self, ok: bool, error: str | None = None, rows: int = 0) -> None:
        if self.path is None:
            return
        fields: dict[str, Any] = {"ok": ok}
        if ok:
            fields |= {"rows": rows, "seconds": time.perf_counter() - self.started}
        else:
            fields["error"] = error
        self.native.job_log_end(json.dumps(fields))
        self.path = None

    def rounds(self, results: Iterator[Any]) -> Iterator[Any]:
        """``results`` (online rounds), each logged as it is handed out; the end is logged
        when they end, fail or are left unread."""
        rows, i = 0, -1
        try:
            for i, r in enumerate(results):
                rows = r.estimates.height
                if self.path is not None:
                    event = {
                        "round": i,
                        "fraction": float(r.progress),
                        "groups": rows,
                        "widest_interval": widest_interval(r.estimates),
                        "final": bool(r.final),
                    }
                    self.native.job_log_event("online_round", json.dumps(event))
                yield r
        except GeneratorExit:
            self.end(False, f"left unread after round {i}")
            raise
        except BaseException as e:
            self.end(False, str(e))
            raise
        self.end(True, rows=rows)
