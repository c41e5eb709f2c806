"""A few seeded kill trials (``flightshuffle kill-trials``): a worker SIGKILLed while a job
runs, for shuffles under push with one map task (the victim often ran no map but holds
blocks) and two-level, a dataset pipeline and a SQL query. Every trial must land its kill
during the job and end exact or in a clear error, never with a wrong answer."""

from __future__ import annotations

import pytest
from flightshuffle_bench import killtrials


@pytest.mark.parametrize(
    ("kind", "n", "strategy", "parity"),
    [
        ("shuffle", 1, "push", 0),
        ("shuffle", 3, "two-level", 0),
        ("shuffle", 1, "push", 1),
        ("dataset", 0, "merged", 0),
        ("sql", 1, "auto", 0),
    ],
)
def test_a_kill_trial_lands_and_ends_exact(kind, n, strategy, parity):
    r = killtrials.trial(kind, n, seed=7, parity=parity, strategy=strategy)
    assert r["kill_landed"], r
    assert r["outcome"] == "exact", r
