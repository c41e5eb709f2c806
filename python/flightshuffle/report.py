"""An event log (``Cluster(event_log=DIR)``: one JSON object per line, the driver's clock) as
one self-contained HTML page: a timeline of map tasks per worker (one colour per stage, failed
attempts outlined in red) with the recovery events marked on it, per-stage quantiles of task
duration, rows, bytes and spill, and the exchanges. No script and no network access: the page
is HTML and inline SVG only."""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from typing import Any

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"]
RECOVERY = {
    "worker_lost": ("#d62728", "lost"),
    "worker_replaced": ("#2ca02c", "replaced"),
    "maps_recomputed": ("#ff7f0e", "maps recomputed"),
    "blocks_restored": ("#17becf", "restored from the store"),
    "blocks_rebuilt": ("#9467bd", "rebuilt from parity"),
    "query_rerun": ("#8c564b", "query run again"),
}


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of one log, in order; a line that is not a JSON object is a ValueError
    naming it."""
    events = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON event ({err})") from None
            if not isinstance(e, dict) or "t" not in e or "event" not in e:
                raise ValueError(f"{path}:{n}: an event needs 't' and 'event'")
            events.append(e)
    return events


def tasks_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Map attempts: each start paired with its end (an attempt still running at the end of
    the log ends there, marked unfinished)."""
    started: dict[tuple, dict[str, Any]] = {}
    done = []
    end = max((e["t"] for e in events), default=0.0)
    for e in events:
        key = (e.get("shuffle"), e.get("map"), e.get("attempt"), e.get("worker"))
        if e["event"] == "task_start":
            started[key] = e
        elif e["event"] == "task_end" and key in started:
            s = started.pop(key)
            done.append({**e, "start": s["t"], "end": e["t"]})
    for key, s in started.items():
        done.append({**s, "start": s["t"], "end": end, "ok": False, "error": "unfinished"})
    return done


def quantiles(values: list[float]) -> tuple[float, float, float, float]:
    """Minimum, median, 90th percentile and maximum (nearest rank)."""
    if not values:
        return (0.0, 0.0, 0.0, 0.0)
    v = sorted(values)

    def at(q: float) -> float:
        return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]

    return (v[0], at(0.5), at(0.9), v[-1])


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _quantile_cell(kind: str, values: tuple[float, ...]) -> str:
    if kind.startswith("duration"):
        shown = [f"{v:.3f}" for v in values]
    elif kind in ("bytes", "spill"):
        shown = [_fmt_bytes(v) for v in values]
    else:
        shown = [f"{v:.0f}" for v in values]
    return " / ".join(shown)


def timeline_svg(events: list[dict[str, Any]], stage_of: dict[str, int]) -> str:
    """The timeline: a lane per worker (tasks overlapping on a worker stacked), bars coloured
    by stage, recovery events as vertical marks."""
    tasks = tasks_of(events)
    workers = sorted({t["worker"] for t in tasks} | {e["worker"] for e in events if "worker" in e})
    end = max([e["t"] for e in events] + [1e-3])
    width, left, bar, gap = 1000, 90, 12, 2
    scale = (width - left - 10) / end
    lanes: dict[int, list[list[float]]] = defaultdict(list)
    for t in sorted(tasks, key=lambda t: t["start"]):
        rows = lanes[t["worker"]]
        row = next((i for i, r in enumerate(rows) if r[-1] <= t["start"]), None)
        if row is None:
            rows.append([])
            row = len(rows) - 1
        rows[row].append(t["end"])
        t["_row"] = row
    # Recovery labels: a row of its own for a label that would overlap the one before.
    marks = [e for e in events if e["event"] in RECOVERY]
    label_y, ends = [], []
    for e in marks:
        x = left + e["t"] * scale
        text = RECOVERY[e["event"]][1] + (f" {e['worker']}" if "worker" in e else "")
        row = next((i for i, end_x in enumerate(ends) if end_x < x), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = x + 6.5 * len(text) + 8
        label_y.append(14 + 12 * row)
    y0, y = {}, 30 + 12 * max(0, len(ends) - 1)
    for w in workers:
        y0[w] = y
        y += max(1, len(lanes[w])) * (bar + gap) + 10
    height = y + 20
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">'
        )
    ]
    for w in workers:
        out.append(f'<text x="4" y="{y0[w] + bar}">worker {w}</text>')
        out.append(
            f'<line x1="{left}" x2="{width}" y1="{y0[w] - 4}" y2="{y0[w] - 4}" stroke="#ddd"/>'
        )
    for t in tasks:
        x = left + t["start"] * scale
        w = max(1.0, (t["end"] - t["start"]) * scale)
        yy = y0[t["worker"]] + t["_row"] * (bar + gap)
        stage = stage_of.get(t.get("shuffle", ""), 0)
        fill = COLOURS[stage % len(COLOURS)]
        stroke = ' stroke="#d62728" stroke-width="2"' if not t.get("ok") else ""
        what = (
            f"stage {stage}, map {t.get('map')} attempt {t.get('attempt')} on worker "
            f"{t['worker']}: {t['end'] - t['start']:.3f} s"
            + (f", {t.get('rows', 0)} rows, {_fmt_bytes(t.get('bytes', 0))}" if t.get("ok") else "")
            + ("" if t.get("ok") else f", failed: {t.get('error', '')}")
        )
        out.append(
            f'<rect class="task" x="{x:.1f}" y="{yy}" width="{w:.1f}" height="{bar}" '
            f'fill="{fill}"{stroke}><title>{html.escape(what)}</title></rect>'
        )
    for e, ly in zip(marks, label_y, strict=True):
        colour, label = RECOVERY[e["event"]]
        x = left + e["t"] * scale
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event"))
        out.append(
            f'<line class="recovery" x1="{x:.1f}" x2="{x:.1f}" y1="{ly + 4}" y2="{height - 16}" '
            f'stroke="{colour}" stroke-width="2" stroke-dasharray="4 2">'
            f"<title>{html.escape(label + ': ' + detail)}</title></line>"
        )
        who = f" {e['worker']}" if "worker" in e else ""
        out.append(
            f'<text x="{x + 3:.1f}" y="{ly}" fill="{colour}">{html.escape(label + who)}</text>'
        )
    for i in range(6):
        t = end * i / 5
        x = left + t * scale
        anchor = ' text-anchor="end"' if i == 5 else ""
        out.append(f'<text x="{x:.1f}" y="{height - 4}" fill="#666"{anchor}>{t:.2f} s</text>')
    out.append("</svg>")
    return "\n".join(out)


def render(events: list[dict[str, Any]], title: str = "flightshuffle query") -> str:
    """The report page of one log's events."""
    stages = [e for e in events if e["event"] == "stage"]
    stage_of = {s.get("shuffle", ""): int(s.get("stage", 0)) for s in stages}
    start = next((e for e in events if e["event"] == "query_start"), {})
    end = next((e for e in events if e["event"] == "query_end"), {})
    tasks = tasks_of(events)
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in tasks:
        by_stage[t.get("shuffle", "")].append(t)
    esc = html.escape
    rows = []
    for s in stages:
        ts = [t for t in by_stage.get(s.get("shuffle", ""), []) if t.get("ok")]
        q = {
            "duration (s)": quantiles([t["end"] - t["start"] for t in ts]),
            "rows": quantiles([t.get("rows", 0) for t in ts]),
            "bytes": quantiles([t.get("bytes", 0) for t in ts]),
            "spill": quantiles([t.get("spilled_bytes", 0) for t in ts]),
            "duration waiting for memory (s)": quantiles(
                [t.get("admission_wait_s", 0) for t in ts]
            ),
        }
        cells = "".join(f"<td>{_quantile_cell(k, q[k])}</td>" for k in q)
        failed = len(by_stage.get(s.get("shuffle", ""), [])) - len(ts)
        rows.append(
            f"<tr><td>{s.get('stage')}</td><td>{esc(str(s.get('exchange', '')))}</td>"
            f"<td>{s.get('tasks')}</td><td>{failed}</td><td>{s.get('rows')}</td>"
            f"<td>{_fmt_bytes(s.get('bytes', 0))}</td>"
            f"<td>{s.get('start_s', 0):.3f}-{s.get('end_s', 0):.3f}</td>{cells}"
            f"<td>{esc(str(s.get('strategy', '')))}</td></tr>"
        )
    recovery = [
        f"<li>{e['t']:.3f} s: {esc(RECOVERY[e['event']][1])} "
        + esc(", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event")))
        + "</li>"
        for e in events
        if e["event"] in RECOVERY
    ]
    online = [
        f"<li>round {e['round']}: {e['fraction']:.1%} read at {e['t']:.3f} s, {e['groups']} "
        f"groups, widest interval ±{_pct(e.get('widest_interval'))}"
        + (" (exact)" if e.get("final") else "")
        + "</li>"
        for e in events
        if e["event"] == "online_round"
    ]
    summary = (
        f"{end.get('rows', '?')} rows in {end.get('seconds', 0):.3f} s"
        if end.get("ok")
        else f"failed: {esc(str(end.get('error', 'the log has no end')))}"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 12px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; }}
pre {{ background: #f6f6f6; padding: 8px; white-space: pre-wrap; }}
</style></head><body>
<h1>{esc(title)}</h1>
<pre>{esc(str(start.get("sql", "")))}</pre>
<p>{summary}; {len(tasks)} map attempts on {start.get("workers", "?")} workers.</p>
<h2>Timeline</h2>
<p>Map attempts per worker (colour: stage; red outline: failed); dashed lines: recovery.</p>
{timeline_svg(events, stage_of)}
<h2>Recovery</h2>
<ul>{"".join(recovery) or "<li>none</li>"}</ul>
{"<h2>Online rounds</h2><ul>" + "".join(online) + "</ul>" if online else ""}
<h2>Stages</h2>
<p>Quantiles per stage over its committed map attempts: min / median / p90 / max.</p>
<table><tr><th>stage</th><th>exchange</th><th>tasks</th><th>failed attempts</th><th>rows</th>
<th>bytes</th><th>time (s)</th><th>task duration (s)</th><th>task rows</th><th>task bytes</th>
<th>task spill</th><th>task wait for memory (s)</th><th>strategy</th></tr>
{"".join(rows)}
</table>
</body></html>
"""


def report(path: str | os.PathLike[str]) -> str:
    """The report page of the event log at ``path``."""
    return render(read_events(path), title=f"flightshuffle: {os.path.basename(path)}")
