"""The fact table of an online SQL query cut into sampling units, and the units into map tasks.

The estimates' intervals come from the spread between units (see :mod:`flightshuffle.estimates`),
so they are only as good as the units are many: at least 64 row ranges of the fact table's
row groups, read in a random order (each costs about 2 ms: see TARGET_UNITS). A map task is costlier than a unit (a call, a commit,
blocks every fold reads), so a task reads several units at once, each as its own partition of
the fact stage (their totals stay apart: ``SplitTotalsExec``), and the tasks stay about as
many as the rounds asked for.
"""

from __future__ import annotations

import os
import random

from flightshuffle import footers

# Units the fact table is cut into (at least; more when the caller asks with min_splits),
# each of at least MIN_UNIT_ROWS rows and within one row group. Each unit is a partition of
# the fact stage and costs about 2 ms on 2 workers whatever its size (A/B at SF1, fastest of
# 3: Q1 0.37 s with one unit per row group, 0.44 s with 64 units, 0.81 s with 256; Q3 0.28,
# 0.36, 0.75; docs/online/ab-units-sf1-w2.json), so 64: about 6 units in the first 10% of a
# table (a t interval with 5 degrees of freedom); a large table's units are whole row groups.
TARGET_UNITS = 64
MIN_UNIT_ROWS = 8192

# Rows a map task reads at most after the first wave, unless that would make fewer tasks
# than rounds (four of the 262,144-row row groups DataFusion and tpchgen write). Every task
# is a call, a commit, blocks every fold reads. With 24 single row groups TPC-H Q3 at SF1
# took 1.22 x distributed SQL, with 12 tasks of two 1.06 (A/B in one cluster, fastest of 10).
SPLIT_ROWS = 1 << 20

# Rows a task of the first wave reads at most (one per worker; a quarter of the 262,144-row
# row groups), for a query over one table: its first estimate comes after that many rows per
# worker. A/B in one cluster, 10 seeds x 3 runs, TPC-H SF1: Q1's first estimate 74 -> 49 ms
# (median). Queries with joins wait for their build sides anyway, and their first wave reads
# up to a row group.
FIRST_WAVE_ROWS = 65_536

# The first wave of a small table reads at most this share of it, so its first estimate
# comes as early in the table as a large one's (SF 0.1's lineitem: 6 units of 8,192 rows of
# 600 K rather than 2 x 65,536).
FIRST_WAVE_SHARE = 0.1

Unit = tuple[str, int, int, int, int]
"""A unit: (absolute path, file bytes, file rows, first row, rows)."""


def unit_rows(total: int, want: int = 0) -> int:
    """Rows per unit for a table of ``total`` rows cut into at least ``want`` units."""
    target = max(TARGET_UNITS, want, 1)
    return max(MIN_UNIT_ROWS, -(-total // target))


def fact_units(
    files: list[str],
    want: int,
    seed: int | None,
    first: int = 0,
    rounds: int = 0,
    head_rows: int | None = None,
) -> tuple[list[Unit], list[int]]:
    """The fact table's units in a random order (fixed by ``seed``), and how many
    consecutive units each map task reads. Every row group is cut into equal row ranges of
    about :func:`unit_rows` rows; the first ``first`` tasks (the first wave, one per worker)
    read units up to ``head_rows`` rows (a row group's without) and together at most
    :data:`FIRST_WAVE_SHARE` of the table, at least one each; the
    others about as many units each, as many tasks as ``rounds`` or as keep each within
    :data:`SPLIT_ROWS` rows."""
    groups: list[tuple[str, int, int, int, int]] = []
    for f in files:
        md = footers.metadata(f)
        path, size, at = os.path.abspath(f), os.path.getsize(f), 0
        for i in range(md.num_row_groups):
            n = md.row_group(i).num_rows
            if n > 0:
                groups.append((path, size, md.num_rows, at, n))
            at += n
    total = sum(g[4] for g in groups)
    if total == 0:
        return [], []
    per = unit_rows(total, want)
    units: list[Unit] = []
    for path, size, file_rows, start, n in groups:
        k = -(-n // per)
        units += [
            (path, size, file_rows, start + i * n // k, (i + 1) * n // k - i * n // k)
            for i in range(k)
        ]
    random.Random(seed).shuffle(units)
    # The first wave reads at most FIRST_WAVE_SHARE of the table (and one unit each).
    cap = min(head_rows or max(g[4] for g in groups), int(FIRST_WAVE_SHARE * total / max(first, 1)))
    per_task: list[int] = []
    at = 0
    for _ in range(first):
        if at >= len(units):
            break
        k, rows = 1, units[at][4]
        while at + k < len(units) and rows + units[at + k][4] <= cap:
            rows += units[at + k][4]
            k += 1
        per_task.append(k)
        at += k
    rest = units[at:]
    if rest:
        rest_rows = sum(u[4] for u in rest)
        tasks = min(len(rest), max(rounds, 1, -(-rest_rows // SPLIT_ROWS)))
        per_task += [(t + 1) * len(rest) // tasks - t * len(rest) // tasks for t in range(tasks)]
    return units, per_task
