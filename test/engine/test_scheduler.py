"""Adaptive-overlap scheduler: when calls start, with what latency estimate, and what it refuses."""

from __future__ import annotations

import pytest

from vla_runtime.engine.scheduler import SchedulerConfig, StreamingScheduler, seconds_to_ticks


def _sched(**over) -> StreamingScheduler:
    return StreamingScheduler(SchedulerConfig(**{"control_hz": 50.0, "chunk_size": 50, **over}))


def test_seconds_to_ticks_is_a_robust_ceiling():
    assert seconds_to_ticks(0.04, 50.0) == 2  # 0.04 * 50 == 2.0000000000000004
    assert seconds_to_ticks(0.041, 50.0) == 3
    assert seconds_to_ticks(0.0, 50.0) == 0


def test_starts_latency_plus_margin_before_the_plan_runs_out():
    s = _sched(initial_latency_s=0.1, margin_ticks=1)  # 5 ticks + 1
    assert s.expected_latency_ticks() == 5 and s.lead_ticks() == 6
    assert not s.should_start(0, plan_remaining=7, in_flight=False, obs_age_s=0.0)
    assert s.should_start(0, plan_remaining=6, in_flight=False, obs_age_s=0.0)
    assert s.should_start(0, plan_remaining=0, in_flight=False, obs_age_s=0.0)
    assert s.start_tick(100) == 105


def test_never_two_calls_in_flight():
    s = _sched()
    assert s.should_start(0, 0, in_flight=False, obs_age_s=0.0)
    s.on_started(0)
    assert s.in_flight
    # The scheduler's own bookkeeping wins over a caller that forgot the call in flight.
    assert not s.should_start(1, 0, in_flight=False, obs_age_s=0.0)
    assert s.counters.blocked_in_flight == 1
    with pytest.raises(RuntimeError, match="still in flight"):
        s.on_started(1)
    s.on_finished(5, latency_s=0.1)
    assert not s.in_flight and s.counters.finished == 1
    with pytest.raises(RuntimeError, match="without a call"):
        s.on_finished(6, latency_s=0.1)


def test_a_chunk_after_its_start_tick_is_late_unless_it_starts_on_arrival():
    s = _sched(initial_latency_s=0.1)          # expected 5 ticks
    s.on_started(0)
    s.on_finished(6, latency_s=0.12)
    assert s.counters.late == 1
    s.on_started(10, starts_on_arrival=True)   # a synchronous caller: its chunk starts when it comes
    s.on_finished(40, latency_s=0.6)
    assert s.counters.late == 1 and s.counters.finished == 2


def test_refuses_stale_observations():
    s = _sched(max_obs_age_s=0.2)
    assert not s.should_start(0, 0, in_flight=False, obs_age_s=0.25)
    assert s.counters.skipped_stale_obs == 1
    assert s.should_start(0, 0, in_flight=False, obs_age_s=0.2)


def test_every_chunk_executes_before_the_next_call():
    s = _sched(min_execute_ticks=2)
    s.on_started(0)
    s.on_finished(5, 0.1)
    assert not s.should_start(5, 0, in_flight=False, obs_age_s=0.0)
    assert not s.should_start(6, 0, in_flight=False, obs_age_s=0.0)
    assert s.should_start(7, 0, in_flight=False, obs_age_s=0.0)


def test_latency_estimate_is_a_rolling_quantile():
    s = _sched(latency_window=5, latency_quantile=0.75, initial_latency_s=0.3)
    assert s.expected_latency_ticks() == 15  # before any measurement
    for k, lat in enumerate([0.04, 0.06, 0.05, 0.2, 0.05]):
        s.on_started(10 * k)
        s.on_finished(10 * k + 3, lat)
    assert s.expected_latency_s() == pytest.approx(0.06)  # one outlier in five does not set it
    for k, lat in enumerate([0.1] * 5):  # the window forgets the old latencies
        s.on_started(100 + 10 * k)
        s.on_finished(100 + 10 * k + 5, lat)
    assert s.expected_latency_ticks() == 5
    assert s.counters.started == 10


def test_late_chunks_are_counted():
    s = _sched(initial_latency_s=0.1)
    s.on_started(0)  # meant to start at tick 5
    s.on_finished(7, 0.14)
    assert s.counters.late == 1


@pytest.mark.parametrize("bad, match", [
    (dict(control_hz=0.0), "control_hz"), (dict(chunk_size=0), "chunk_size"),
    (dict(latency_quantile=0.0), "latency_quantile"), (dict(latency_window=0), "latency_window"),
    (dict(margin_ticks=-1), "margin_ticks"), (dict(max_obs_age_s=-0.1), "max_obs_age_s"),
    (dict(initial_latency_s=float("nan")), "initial_latency_s"), (dict(min_execute_ticks=-1), "min_execute_ticks"),
])
def test_config_is_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**{"control_hz": 50.0, "chunk_size": 50, **bad})
