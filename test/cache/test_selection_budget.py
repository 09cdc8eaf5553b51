"""Whether choosing a reference costs more than auto's halves save: decided once, on what was measured."""

from __future__ import annotations

import pytest

from vla_runtime.cache.selection_budget import SelectionBudget


def test_nothing_is_decided_before_the_calls_asked_for():
    b = SelectionBudget(saving_s=1e-3, calls=3)
    assert b.observe(5e-3, True) is None and b.observe(5e-3, True) is None
    assert b.keep is None and b.verdict is None


def test_selection_dearer_than_the_saving_turns_the_cache_off_and_says_by_how_much():
    b = SelectionBudget(saving_s=0.2e-3, calls=3)
    decisions = [b.observe(s, True) for s in (0.4e-3, 0.35e-3, 0.5e-3)]
    assert decisions == [None, None, False] and b.keep is False
    assert b.verdict == ("choosing a reference cost 0.40 ms a call (median of the first 3 calls), the halves "
                         "save 0.20 ms a call (0.20 ms by the recorded timing, 3 of 3 calls served)")
    assert b.observe(0.0, True) is None and len(b.select_s) == 3   # decided once: later calls change nothing


def test_the_median_decides_not_one_slow_call():
    b = SelectionBudget(saving_s=1e-3, calls=3)
    assert [b.observe(s, True) for s in (0.3e-3, 50e-3, 0.3e-3)][-1] is True


def test_a_saving_counts_only_on_the_calls_a_reference_served():
    # 1 ms saved where served, 0.5 ms to choose: on at 3 of 5 served (0.6 ms a call), off at 2 of 5 (0.4 ms)
    on = SelectionBudget(saving_s=1e-3, calls=5)
    assert [on.observe(0.5e-3, s) for s in (True, True, True, False, False)][-1] is True
    off = SelectionBudget(saving_s=1e-3, calls=5)
    assert [off.observe(0.5e-3, s) for s in (True, True, False, False, False)][-1] is False
    assert "2 of 5 calls served" in off.verdict


def test_a_check_over_no_calls_is_refused():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        SelectionBudget(saving_s=1e-3, calls=0)
