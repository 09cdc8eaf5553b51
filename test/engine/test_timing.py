"""Timing summaries for the JSON reports."""

from __future__ import annotations

import pytest

from vla_runtime.engine.timing import PhaseTimer, summarize


def test_summary_has_count_mean_quantiles_and_max():
    s = summarize([0.4, 0.1, 0.3, 0.2, 0.5], (0.5, 0.95))
    assert s == pytest.approx({"n": 5, "mean": 0.3, "p50": 0.3, "p95": 0.48, "max": 0.5})


def test_summary_of_nothing_is_all_none_so_a_report_still_writes():
    assert summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "max": None}


def test_phase_timer_adds_up_repeated_phases(monkeypatch):
    """A fake clock that advances by known amounts inside each phase: the timer must add exactly
    those (a timer recording zeros, or the time between phases, fails)."""
    import vla_runtime.engine.timing as timing

    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def spend(seconds: float) -> None:
        now[0] += seconds

    timer = PhaseTimer()
    for seconds in (1.5, 2.0):
        with timer.phase("denoise"):
            spend(seconds)
        spend(10.0)                          # between phases: counted nowhere
    with timer.phase("vision"):
        spend(0.25)
    assert timer.times.as_dict() == {"denoise": 3.5, "vision": 0.25, "total": 3.75}
