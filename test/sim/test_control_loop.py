"""The control-loop harness in simulated time: stalls, overlap, reaction latency, smoothness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vla_runtime.engine.stitching import STITCH_MODES, StitchConfig
from vla_runtime.engine.controller import ControllerConfig
from vla_runtime.engine.safety import JointLimits
from vla_runtime.sim.control_loop import (HarnessConfig, LatencySource, Robot, SyncController, run_harness,
                                          spread_events)

HOME = np.array([0.0, 0.5, 0.45, 0.35, 0.25, 0.15, 1.0])
TARGETS = (HOME, np.array([0.3, 0.2, 0.1, 0.3, 0.2, 0.1, 0.0]))
EVENTS = spread_events(9.0, every_s=1.0, seed=1)  # the last one leaves time to react


def smooth_to_target(obs, state: np.ndarray) -> np.ndarray:
    """Stand-in policy: a smooth 50-step approach from the prompt state to the current target."""
    target = TARGETS[obs.phase % 2]
    i = np.arange(1, 51)[:, None]
    return state + (target - state) * (1.0 - np.exp(-i / 15.0))


def _run(**over):
    cfg = HarnessConfig(**{"latency": 0.2, "duration_s": 10.0, "event_times_s": EVENTS, **over})
    return run_harness(cfg, chunk_fn=smooth_to_target)


def test_streaming_hides_latency_shorter_than_a_chunk():
    r = _run(mode="stream")
    lat_ticks = 10  # 0.2 s at 50 Hz
    assert r.warmup_ticks == lat_ticks  # only the very first call is waited for
    assert r.stall_ticks == 0 and r.stall_rate == 0.0
    assert r.concurrent_calls_max == 1 and r.late_chunks == 0
    merged = [c for c in r.call_records if c.influence_tick is not None]
    # Every chunk after the first arrived while the previous plan still had actions, and by
    # the tick it was meant to start at.
    assert r.chunks_ready_in_time == len(merged) - 1 > 10
    assert all(c.arrival_tick <= c.start_tick for c in r.call_records)
    # Calls never overlap in simulated time.
    for a, b in zip(r.call_records, r.call_records[1:]):
        assert b.call_tick >= a.arrival_tick
    assert r.safety["held"] == r.warmup_ticks and r.watchdog["held_ticks"] == r.warmup_ticks


def test_sync_stalls_for_the_whole_latency_of_every_call():
    r = _run(mode="sync", n_execute=25)
    lat_ticks = 10
    assert r.concurrent_calls_max == 1
    # After the first call, every call stands the robot still for exactly its latency
    # (a call still in flight when the run ends is cut off there).
    expected = sum(min(c.arrival_tick, r.total_ticks) - c.call_tick for c in r.call_records[1:])
    assert r.stall_ticks == expected
    full = [c for c in r.call_records[1:] if c.arrival_tick < r.total_ticks]
    assert all(c.arrival_tick - c.call_tick == lat_ticks for c in full)
    assert r.stall_ticks >= lat_ticks * len(full) > 0
    # Execute 25, wait 10: a period of 35 ticks.
    assert [b.call_tick - a.call_tick for a, b in zip(r.call_records, r.call_records[1:])][:3] == [35, 35, 35]


def test_streaming_reacts_faster_than_sync():
    sync, stream = _run(mode="sync", n_execute=25), _run(mode="stream", n_execute=25)
    assert sync.events_unreacted == 0 and stream.events_unreacted == 0
    assert len(stream.reaction_latency_s) == len(EVENTS)
    # Every reaction includes at least the inference latency.
    assert min(stream.reaction_latency_s) >= 0.2 - 1e-9 and min(sync.reaction_latency_s) >= 0.2 - 1e-9
    assert stream.reaction_latency_median_s < sync.reaction_latency_median_s
    assert np.mean(stream.reaction_latency_s) < np.mean(sync.reaction_latency_s)


def test_reaction_latency_is_measured_from_the_observation_after_the_event():
    # One event, injected latency 0.1 s, sync with a 20-tick execution: calls at ticks
    # 0, 25, 50, ... (execute 20 + wait 5). An event at 0.55 s (tick 27.5) is first seen by
    # the call at tick 50, whose chunk executes from tick 55 (1.10 s).
    cfg = HarnessConfig(mode="sync", n_execute=20, latency=0.1, duration_s=2.0, event_times_s=(0.55,))
    r = run_harness(cfg, chunk_fn=smooth_to_target)
    assert [c.call_tick for c in r.call_records][:3] == [0, 25, 50]
    assert r.reaction_latency_s == pytest.approx([1.10 - 0.55])


@pytest.mark.parametrize("mode", STITCH_MODES)
def test_every_stitching_mode_runs_without_stalls_and_reports_boundary_jerk(mode):
    r = _run(mode="stream", stitch=StitchConfig(mode=mode))
    assert r.stall_ticks == 0 and r.concurrent_calls_max == 1
    j = r.boundary_jerk
    assert j["boundaries_used"] == r.calls - 1 - j["boundaries_skipped"] > 5
    assert np.isfinite(j["boundary_rms_jerk"]) and j["boundary_rms_jerk"] > 0
    assert np.isfinite(r.commands).all() and r.commands.shape == (r.total_ticks, 7)


def test_blending_smooths_boundaries_and_prediction_beats_the_stale_state():
    replace = _run(mode="stream", stitch=StitchConfig(mode="replace"))
    blend = _run(mode="stream", stitch=StitchConfig(mode="blend", blend_steps=8))
    assert blend.boundary_jerk["boundary_rms_jerk"] < replace.boundary_jerk["boundary_rms_jerk"]
    # Conditioning on the commanded future state instead of the lagging observed state keeps
    # the new chunk continuous with the old one (no jump back at the boundary).
    stale = _run(mode="stream", stitch=StitchConfig(mode="replace"), predictor="observed")
    assert replace.boundary_jerk["boundary_rms_jerk"] < stale.boundary_jerk["boundary_rms_jerk"]


def test_latency_longer_than_the_horizon_still_never_overlaps_calls():
    # 0.7 s = 35 ticks > n_execute (25): calls run back to back and the plan's tail covers them.
    r = _run(mode="stream", latency=0.7, duration_s=6.0, event_times_s=())
    assert r.concurrent_calls_max == 1 and r.stall_ticks == 0
    for a, b in zip(r.call_records, r.call_records[1:]):
        assert b.call_tick >= a.arrival_tick + 1  # min_execute_ticks = 1


def test_sync_controller_calls_on_an_empty_plan_and_executes_n_actions_from_arrival():
    cfg = ControllerConfig(control_hz=50.0, chunk_size=10, action_dim=2, stitch=StitchConfig(mode="blend"),
                           predictor="absolute", initial_latency_s=0.04, watchdog_s=0.1)
    c = SyncController(cfg, JointLimits(np.array([-1.0, -1.0]), np.array([1.0, 1.0])), n_execute=4)
    c.set_initial(np.zeros(2))
    req = c.maybe_request(0, np.array([0.1, 0.2]), obs_age_s=0.0)
    np.testing.assert_array_equal(req.state, [0.1, 0.2])             # the observed state, never predicted
    chunk = np.linspace(0.0, 0.95, 20).reshape(10, 2)
    assert c.on_chunk(req.request_seq, chunk, now=30, latency_s=0.6)  # 0.6 s, past the 0.1 s deadline: kept
    assert c.scheduler.counters.late == 0
    assert c.maybe_request(30, np.zeros(2), 0.0) is None              # the chunk's part is not used up
    np.testing.assert_allclose([c.tick(t).action for t in range(30, 34)], chunk[:4])   # from arrival, replaced
    assert c.tick(34).status == "held"                                # then the robot stands and waits
    assert c.maybe_request(35, np.zeros(2), 0.0) is not None


def test_a_chunk_past_the_watchdog_deadline_is_refused_as_on_the_robot():
    # The harness runs the policy node's controller: a chunk arriving 0.6 s after its call,
    # past a 0.3 s deadline, was planned for a world that has moved on and is never executed.
    r = _run(mode="stream", latency=0.6, watchdog_s=0.3, duration_s=3.0, event_times_s=())
    assert r.calls > 1 and r.rejected_chunks == r.scheduler["finished"] > 0
    assert r.safety["held"] == r.total_ticks and all(c.influence_tick is None for c in r.call_records)
    # Within the deadline every chunk is taken.
    ok = _run(mode="stream", latency=0.2, watchdog_s=0.3, duration_s=3.0, event_times_s=())
    assert ok.rejected_chunks == 0 and ok.safety["held"] < ok.total_ticks
    # A synchronous robot waits for its chunk however long it takes.
    sync = _run(mode="sync", latency=0.6, watchdog_s=0.3, duration_s=3.0, event_times_s=(), n_execute=25)
    assert sync.rejected_chunks == 0 and sync.scheduler["late"] == 0 and sync.safety["ok"] > 0


def test_jittered_latency_adapts_the_overlap():
    r = _run(mode="stream", latency=(0.2, 0.05), latency_quantile=0.95)
    assert r.concurrent_calls_max == 1
    assert r.latency_s["max"] > r.latency_s["p50"] > 0.1
    # The lead follows the measured quantile: few chunks arrive after their start tick, and
    # when one does the plan's tail covers it.
    assert r.late_chunks <= r.calls // 3
    assert r.stall_ticks == 0


def test_never_calls_on_a_stale_observation():
    # Camera frames 0.3 s old exceed the 0.2 s bound: no call ever starts, the robot holds.
    r = _run(mode="stream", obs_delay_s=0.3, duration_s=1.0)
    assert r.calls == 0 and r.scheduler["skipped_stale_obs"] > 0
    assert r.warmup_ticks == r.total_ticks and r.safety["held"] == r.total_ticks
    ok = _run(mode="stream", obs_delay_s=0.1, duration_s=2.0)
    assert ok.calls > 0 and ok.max_obs_age_used_s == pytest.approx(0.1)
    assert all(c.call_tick - c.obs_tick == 5 for c in ok.call_records)


def test_safety_filter_clamps_what_the_policy_asks():
    r = _run(mode="stream", joint_lower=(-0.1,) * 7, joint_upper=(0.2,) * 7, duration_s=2.0)
    assert r.safety["clamped"] > 0
    assert (r.commands <= 0.2 + 1e-12).all() and (r.commands >= -0.1 - 1e-12).all()


def test_robot_lag_and_latency_source():
    robot = Robot(np.zeros(2), dt=0.02, tau_s=0.05)
    robot.step(np.ones(2))
    assert 0.0 < robot.state[0] < 1.0 and robot.state_at(0)[0] == 0.0
    for _ in range(50):
        robot.step(np.ones(2))
    assert robot.state[0] == pytest.approx(1.0, abs=1e-6)
    assert LatencySource(0.04).duration(wall_s=3.0) == 0.04
    assert LatencySource("measured").duration(wall_s=0.3) == 0.3
    jit = LatencySource((0.04, 0.01), seed=3)
    draws = [jit.duration(0.0) for _ in range(100)]
    assert min(draws) >= 0.0 and 0.03 < np.mean(draws) < 0.05


@pytest.mark.parametrize("bad, match", [
    (dict(mode="async"), "mode"), (dict(latency="fast"), "latency"), (dict(latency=(0.1,)), "latency"),
    (dict(event_times_s=(2.0, 1.0)), "sorted"), (dict(predictor="kalman"), "predictor"),
    (dict(n_execute=0), "n_execute"), (dict(control_hz=0), "control_hz"), (dict(joint_lower=(0.0,)), "both"),
    (dict(latency_quantile=2.0), "latency_quantile"),
])
def test_config_is_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        HarnessConfig(**bad)


def test_real_tiny_engine_closes_the_loop(tmp_path: Path):
    from vla_runtime.engine.policy import Pi05Policy
    from vla_runtime.commands.demo import DemoSpec, make_demo

    info = make_demo(tmp_path / "demo", DemoSpec(preset="pi05-tiny", episodes=2, held_out=1, steps_per_episode=20),
                     log=lambda _: None)
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=info["cameras"])
    chunk = policy.engine.cfg.chunk_size  # 10 actions: 0.2 s at 50 Hz
    cfg = HarnessConfig(mode="stream", duration_s=1.5, latency=0.06, n_execute=chunk // 2, render=True,
                        task=info["task"], event_times_s=(0.5,), stitch=StitchConfig(mode="blend", blend_steps=2))
    r = run_harness(cfg, policy=policy)
    assert r.calls >= 10 and r.concurrent_calls_max == 1
    assert r.stall_ticks == 0 and r.events_unreacted == 0
    assert np.isfinite(r.commands).all() and r.commands.shape == (75, 7)
    assert r.wall_s["n"] == r.calls and r.boundary_jerk["boundaries_used"] > 0
    sync = run_harness(HarnessConfig(mode="sync", duration_s=1.5, latency=0.06, n_execute=chunk // 2,
                                     task=info["task"]), policy=policy)
    assert sync.stall_ticks > 0 and sync.stall_rate > r.stall_rate


def test_cli_bench_stream_writes_the_comparison(tmp_path: Path, capsys):
    import json

    from vla_runtime.cli import main

    out = tmp_path / "stream.json"
    rc = main(["bench", "--stream", "--preset", "pi05-tiny", "--latency-ms", "40", "--duration", "3",
               "--stitch", "replace,blend", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert set(d["summary"]) == {"sync", "stream/replace", "stream/blend", "stream-jit/replace"}
    assert d["latency"] == {"injected_ms": 40.0} and d["chunk_size"] == 10
    for key in ("stream/replace", "stream/blend"):
        assert d["summary"][key]["stall_rate"] == 0.0 and d["summary"][key]["concurrent_calls_max"] == 1
    assert d["summary"]["sync"]["stall_rate"] > 0
    assert main(["bench", "--stream", "--stitch", "zigzag"]) == 2


def test_continuous_replanning_reacts_faster_than_just_in_time():
    """With latency well under a chunk, re-planning as soon as a call returns (Reflex's policy
    stream) reacts to a change sooner than waiting for the execution horizon, without stalls."""
    base = dict(mode="stream", latency=0.04, duration_s=6.0, event_times_s=(1.3, 2.7, 4.1), n_execute=25)
    jit = run_harness(HarnessConfig(**base), chunk_fn=smooth_to_target)
    cont = run_harness(HarnessConfig(stream_horizon=1, **base), chunk_fn=smooth_to_target)
    assert cont.stall_rate == 0 and cont.concurrent_calls_max == 1
    assert cont.calls > jit.calls
    assert cont.reaction_latency_median_s < jit.reaction_latency_median_s
