"""Timing summaries for the JSON reports."""

from __future__ import annotations

import pytest

from vla_runtime.engine.timing import PhaseTimer, summarize


def test_summary_has_count_mean_quantiles_and_max():
    s = summarize([0.4, 0.1, 0.3, 0.2, 0.5], (0.5, 0.95))
    assert s == pytest.approx({"n": 5, "mean": 0.3, "p50": 0.3, "p95": 0.48, "max": 0.5})


def test_summary_of_nothing_is_all_none_so_a_report_still_writes():
    assert summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "max": None}


def test_phase_timer_adds_up_repeated_phases():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("denoise"):
            pass
    with timer.phase("vision"):
        pass
    times = timer.times.as_dict()
    assert set(times) == {"denoise", "vision", "total"}
    assert times["total"] == pytest.approx(times["denoise"] + times["vision"])
