"""Tick statistics on constructed start times (no clock is read: the figures follow from the input)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vla_runtime.engine.tick_timing import TickRecord, long_gaps, missed_in_gap, tick_statistics

MS = 1_000_000   # ns


def starts(gaps_ms: list[float], t0_ns: int = 10**12) -> list[int]:
    """Start times whose consecutive gaps are ``gaps_ms`` (an integer number of ns each)."""
    return [t0_ns + int(round(x)) for x in np.concatenate([[0.0], np.cumsum(gaps_ms)]) * MS]


@pytest.mark.parametrize("gap_periods, missed", [(0.5, 0), (1.0, 0), (1.5, 0), (1.51, 1), (2.0, 1), (2.4, 1),
                                                 (3.0, 2), (10.0, 9)])
def test_missed_ticks_in_a_gap(gap_periods: float, missed: int) -> None:
    assert missed_in_gap(gap_periods * 0.02, 0.02) == missed


def test_regular_ticks_have_the_period_and_nothing_missed() -> None:
    s = tick_statistics(starts([20.0] * 100), 0.02)
    # the starts are whole ns: each gap is 20 ms exactly (float rounding of 1e-9 * ns only)
    assert s.ticks == 101 and s.p50_ms == pytest.approx(20.0, abs=1e-6)
    assert s.p99_ms == pytest.approx(20.0, abs=1e-6) and s.max_ms == pytest.approx(20.0, abs=1e-6)
    assert s.missed == 0 and s.late == 0


def test_a_late_tick_is_late_and_a_long_gap_counts_the_ticks_that_did_not_run() -> None:
    # 200 gaps: one tick 8 ms late (28 then 12: the timer keeps its schedule), one gap of 3 periods
    gaps = [20.0] * 100 + [28.0, 12.0] + [20.0] * 50 + [60.0] + [20.0] * 47
    s = tick_statistics(starts(gaps), 0.02)
    assert s.missed == 2 and s.late == 1            # 28 > 20 + 5; 60 ms is missed ticks, not lateness
    assert s.max_ms == pytest.approx(60.0, abs=1e-6)
    assert s.p50_ms == pytest.approx(20.0, abs=1e-6)
    # numpy's linear percentile of the sorted gaps: rank 0.99 * 199 = 197.01 lies between the
    # 198th (20) and 199th (28) smallest gaps
    assert s.p99_ms == pytest.approx(20.0 + 0.01 * 8.0, abs=1e-6)
    # where the missed ticks are: the start after the 60 ms gap (gap 152, counted from 0, ends at start 153); the
    # late 28 ms gap and exactly 1.5 periods (30 ms) are not listed
    t = starts(gaps)
    [(at, ms)] = long_gaps(t, 0.02)
    assert at == t[153] and ms == pytest.approx(60.0, abs=1e-6)
    assert long_gaps(starts([20.0, 30.0, 31.0]), 0.02) == [(starts([20.0, 30.0, 31.0])[3], pytest.approx(31.0))]


def test_fewer_than_two_starts_give_no_period() -> None:
    s = tick_statistics([5], 0.02)
    assert s.ticks == 1 and math.isnan(s.p99_ms) and s.missed == 0


@pytest.mark.parametrize("bad, period, match", [([3, 2], 0.02, "increasing"), ([[1, 2]], 0.02, "one-dimensional"),
                                                ([1, 2], 0.0, "period_s"), ([1, 2], float("nan"), "period_s")])
def test_bad_input_is_refused(bad, period: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tick_statistics(bad, period)


def test_record_keeps_a_bounded_window_counts_every_missed_tick_and_drains_once() -> None:
    rec = TickRecord(capacity=5, period_s=0.02)
    t = starts([20.0, 20.0, 45.0, 20.0, 20.0, 20.0, 80.0])   # 8 starts: one missed, then three
    for x in t[:4]:
        rec.add(x)
    assert rec.drain() == t[:4] and rec.drain() == []
    for x in t[4:]:
        rec.add(x)
    assert rec.total == 8 and rec.missed == 1 + 3
    assert rec.recent() == t[3:]                     # the last 5 only
    assert rec.drain() == t[4:]
    assert rec.statistics().max_ms == pytest.approx(80.0, abs=1e-6)


def test_record_refuses_a_useless_capacity_or_period() -> None:
    with pytest.raises(ValueError, match="capacity"):
        TickRecord(1, 0.02)
    with pytest.raises(ValueError, match="period_s"):
        TickRecord(10, -1.0)
