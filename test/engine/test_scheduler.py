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


# ---------------------------------------------------------------------- boundaries (mutation testing)


def test_config_accepts_its_documented_edges_and_names_what_it_refuses():
    """Each bound is inclusive exactly where the message says (>= 0, >= 1, (0, 1])."""
    assert SchedulerConfig(control_hz=0.5, chunk_size=1).control_hz == 0.5    # slow loops are loops too
    edge = SchedulerConfig(control_hz=50, chunk_size=1, max_obs_age_s=0.0, margin_ticks=0, latency_quantile=1.0,
                           latency_window=1, initial_latency_s=0.0, min_execute_ticks=0)
    assert (edge.chunk_size, edge.margin_ticks, edge.latency_window, edge.min_execute_ticks) == (1, 0, 1, 0)
    for kwargs, match in (({"chunk_size": 0}, "chunk_size must be an int >= 1"),
                          ({"max_obs_age_s": -0.01}, "max_obs_age_s must be >= 0"),
                          ({"margin_ticks": -1}, "margin_ticks must be an int >= 0"),
                          ({"latency_quantile": 1.01}, r"latency_quantile must be in \(0, 1\]"),
                          ({"latency_quantile": 0.0}, r"latency_quantile must be in \(0, 1\]"),
                          ({"latency_window": 0}, "latency_window must be an int >= 1"),
                          ({"initial_latency_s": float("inf")}, "initial_latency_s must be finite"),
                          ({"initial_latency_s": -0.1}, "initial_latency_s must be finite and >= 0"),
                          ({"min_execute_ticks": -1}, "min_execute_ticks must be an int >= 0"),
                          ({"control_hz": float("nan")}, "control_hz must be a positive number")):
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(**({"control_hz": 50, "chunk_size": 10} | kwargs))
    with pytest.raises(ValueError, match="cfg must be a SchedulerConfig, got dict"):
        StreamingScheduler({})


def test_latency_estimate_is_the_higher_quantile_of_the_last_window():
    s = StreamingScheduler(SchedulerConfig(control_hz=50, chunk_size=10, latency_quantile=0.5, latency_window=3))
    for latency in (0.9, 0.1, 0.2, 0.3):          # the 0.9 falls out of the 3-call window
        s.on_started(0)
        s.on_finished(1, latency)
    # window (0.1, 0.2, 0.3): median 0.2 either way; with an even window "higher" picks the upper one
    assert s.expected_latency_s() == 0.2
    s.on_started(0)
    s.on_finished(1, 0.0)                           # a zero latency is a valid measurement
    s2 = StreamingScheduler(SchedulerConfig(control_hz=50, chunk_size=10, latency_quantile=0.5, latency_window=2))
    for latency in (0.1, 0.3):
        s2.on_started(0)
        s2.on_finished(1, latency)
    assert s2.expected_latency_s() == 0.3           # not the interpolated 0.2


def test_counters_count_every_event_and_the_edges_of_each_rule():
    cfg = SchedulerConfig(control_hz=50, chunk_size=10, max_obs_age_s=0.1, initial_latency_s=0.04, margin_ticks=1)
    s = StreamingScheduler(cfg)
    lead = s.lead_ticks()
    assert s.should_start(0, lead, False, obs_age_s=0.1)       # exactly max_obs_age_s old: still fresh
    for _ in range(2):
        assert not s.should_start(0, lead, False, obs_age_s=0.2)
        assert not s.should_start(0, lead, True, obs_age_s=0.0)
    assert s.counters.skipped_stale_obs == 2 and s.counters.blocked_in_flight == 2
    for _ in range(2):                                         # two calls whose chunks arrive late
        s.on_started(10, start_tick=11)
        s.on_finished(14, 0.06)
    s.on_started(20, start_tick=25)                            # the caller's start tick, not the estimate's
    s.on_finished(24, 0.04)                                    # (20 + 3 ticks): on time
    s.on_started(30, start_tick=33)
    s.on_finished(33, 0.04)                                    # arrives at its start tick: on time
    assert s.counters.late == 2
    for bad, match in ((float("nan"), "latency_s must be finite and >= 0"), (-0.01, "latency_s must be finite")):
        s.on_started(30)
        with pytest.raises(ValueError, match=match):
            s.on_finished(31, bad)
        s.on_finished(31, 0.04)
    with pytest.raises(RuntimeError, match="on_finished without a call in flight"):
        s.on_finished(32, 0.04)
    for args, match in (((0, -1, False, 0.0), "plan_remaining must be >= 0, got -1"),
                        ((0, 0, False, float("inf")), "obs_age_s must be finite and >= 0"),
                        ((0, 0, False, -0.5), "obs_age_s must be finite and >= 0")):
        with pytest.raises(ValueError, match=match):
            s.should_start(*args)
