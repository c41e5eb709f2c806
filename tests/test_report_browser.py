"""The event-log report as a browser shows it: reports of TPC-H q18 and of a shuffle with a
worker killed mid-way open in headless Chromium (Debian's ``chromium``, which
``scripts/test.sh`` installs), which parses every task bar and recovery mark, logs nothing to
its console, and paints the bars and the recovery line in their colours."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import flightshuffle as fs
import polars as pl
import pytest
from conftest import TPCH_SF, assert_same_multiset
from flightshuffle.report import COLOURS, RECOVERY, read_events, tasks_of
from flightshuffle_bench import tpch

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (scripts/test.sh installs Debian's chromium as root)",
)

# Headless, with nothing reaching for the network (this machine's is closed) or a desktop.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
]


def chromium(page: str, tmp, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"profile-{len(os.listdir(tmp))}"
    return subprocess.run(
        [CHROMIUM or "chromium", *FLAGS, f"--user-data-dir={profile}", *args, f"file://{page}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def pixels_of(png, colour: str) -> int:
    from PIL import Image

    want = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    with Image.open(png) as img:
        return sum(n for n, px in img.convert("RGB").getcolors(1 << 24) or [] if px == want)


def check_in_browser(log: str, tmp, name: str) -> str:
    """Render `log`'s report, open it in Chromium: every bar and mark parsed, no console
    message, bars and (if any) the recovery line painted. Returns the screenshot's path."""
    events = read_events(log)
    page = tmp / f"{name}.html"
    page.write_text(fs.report.report(log))
    done = chromium(str(page), tmp, "--dump-dom")
    dom = done.stdout
    assert dom.count('<rect class="task"') == len(tasks_of(events)) > 0
    marks = [e for e in events if e["event"] in RECOVERY]
    assert dom.count('<line class="recovery"') == len(marks)
    assert "CONSOLE" not in done.stderr, done.stderr
    shot = tmp / f"{name}.png"
    chromium(str(page), tmp, "--window-size=1400,1100", f"--screenshot={shot}")
    stages = {int(e.get("stage", 0)) for e in events if e["event"] == "stage"} or {0}
    painted = sum(pixels_of(shot, COLOURS[s % len(COLOURS)]) for s in stages)
    assert painted > 500 * len(stages), "every stage's bars are painted"
    if marks:
        assert pixels_of(shot, RECOVERY[marks[0]["event"]][0]) > 20, "the recovery line"
    return str(shot)


def test_reports_of_q18_and_of_a_shuffle_with_a_worker_killed_render(tpch_data, tmp_path):
    logs = tmp_path / "events"
    with fs.Cluster(workers=3, memory_budget="256MiB", timeout=60, event_log=logs) as c:
        for name, path in tpch.table_paths(tpch_data).items():
            c.register_parquet(name, path)
        sql, ordered = tpch.query(18, TPCH_SF)
        want = tpch.duckdb_connect(tpch_data).sql(sql).to_arrow_table()
        assert tpch.compare(want, c.sql(sql), ordered) is None
        check_in_browser(c.last_event_log, tmp_path, "q18")

        n = 200_000
        df = pl.DataFrame({"k": [i % 1009 for i in range(n)], "v": list(range(n))})
        result = c.shuffle(df, by="k", partitions=6, map_bytes="128KiB", strategy="pull")
        result.wait_mapped()
        parts = [pl.from_arrow(next(result))]
        os.kill(c.worker_pids[1], signal.SIGKILL)
        parts += [pl.from_arrow(p) for p in result]
        assert_same_multiset(df, parts)
        kinds = {e["event"] for e in read_events(c.last_event_log)}
        assert "worker_lost" in kinds, kinds
        check_in_browser(c.last_event_log, tmp_path, "shuffle-kill")
