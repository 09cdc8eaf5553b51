"""Safety filter and watchdog: nothing unsafe reaches the robot, stale plans are not executed."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.engine.safety import JointLimits, SafeCommand, SafetyFilter, Watchdog
from vla_runtime.engine.stitching import ActionPlan, ReplaceStitcher

DT = 0.02


def _limits(vmax=None) -> JointLimits:
    return JointLimits.from_lists([-1.0, -2.0, 0.0], [1.0, 2.0, 0.5], vmax)


def _filter(vmax=None, initial=(0.0, 0.0, 0.1)) -> SafetyFilter:
    f = SafetyFilter(_limits(vmax), DT)
    f.set_initial(np.array(initial))
    return f


# ---------------------------------------------------------------------- JointLimits


def test_limits_validation():
    lim = _limits([1.0, 1.0, np.inf])
    assert lim.dim == 3 and lim.lower.dtype == np.float64
    with pytest.raises(ValueError):
        lim.lower[0] = -5.0                                  # read-only
    for lower, upper, vmax, msg in [
        ([0.0, 0.0], [1.0], None, "shape"),
        ([0.0, 1.0], [1.0, 1.0], None, "lower must be < upper"),
        ([0.0, np.nan], [1.0, 1.0], None, "finite"),
        ([0.0, -np.inf], [1.0, 1.0], None, "finite"),
        ([0.0, 0.0], [1.0, 1.0], [1.0], "max_velocity"),
        ([0.0, 0.0], [1.0, 1.0], [1.0, 0.0], "max_velocity"),
        ([0.0, 0.0], [1.0, 1.0], [1.0, np.nan], "max_velocity"),
        ([], [], None, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            JointLimits.from_lists(lower, upper, vmax)
    assert lim.contains(np.array([0.0, 0.0, 0.2])) and not lim.contains(np.array([0.0, 0.0, 0.6]))


def test_filter_and_watchdog_config_validation():
    with pytest.raises(ValueError, match="dt"):
        SafetyFilter(_limits(), 0.0)
    with pytest.raises(ValueError, match="JointLimits"):
        SafetyFilter([[-1, 1]], DT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="deadline_s"):
        Watchdog(-0.1, DT)
    with pytest.raises(ValueError, match="dt"):
        Watchdog(0.1, float("nan"))
    with pytest.raises(ValueError, match="on_stale"):
        Watchdog(0.1, DT, on_stale="extrapolate")
    with pytest.raises(ValueError, match="status"):
        SafeCommand(np.zeros(2), "fine", "", 0)
    with pytest.raises(ValueError, match="finite"):
        SafeCommand(np.array([np.nan]), "ok", "", 0)


# ---------------------------------------------------------------------- SafetyFilter


def test_must_set_initial_state_first():
    f = SafetyFilter(_limits(), DT)
    with pytest.raises(RuntimeError, match="set_initial"):
        f.filter(np.zeros(3), 0)
    with pytest.raises(ValueError, match="shape"):
        f.set_initial(np.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        f.set_initial(np.array([0.0, np.nan, 0.0]))


def test_ok_passes_exactly_and_clamps_exactly():
    f = _filter()
    a = np.array([0.3, -1.25, 0.4])
    c = f.filter(a, 0)
    assert c.status == "ok" and c.reason == "" and np.array_equal(c.action, a)
    c = f.filter(np.array([5.0, -9.0, 0.25]), 1)
    assert c.status == "clamped" and "joints [0, 1]" in c.reason
    assert c.action.tolist() == [1.0, -2.0, 0.25]
    c = f.filter(np.array([-1.0, 2.0, 0.5]), 2)            # on the limits is allowed
    assert c.status == "ok" and c.action.tolist() == [-1.0, 2.0, 0.5]
    assert f.counts == {"ok": 2, "clamped": 1, "held": 0, "rate_limited": 0}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_never_passes(bad):
    f = _filter()
    f.filter(np.array([0.5, 0.5, 0.2]), 0)
    c = f.filter(np.array([0.1, bad, 0.1]), 1)
    assert c.status == "held" and "joints [1]" in c.reason
    assert c.action.tolist() == [0.5, 0.5, 0.2]
    assert np.isfinite(c.action).all()


def test_hold_before_and_after_commands():
    f = _filter(initial=(0.2, 3.0, 0.1))                   # initial outside limits is clamped
    c = f.filter(None, 0)
    assert c.status == "held" and c.reason == "no planned action"
    assert c.action.tolist() == [0.2, 2.0, 0.1]
    f.filter(np.array([0.3, 0.3, 0.3]), 1)
    for t in range(2, 5):
        c = f.filter(None, t)
        assert c.status == "held" and c.action.tolist() == [0.3, 0.3, 0.3]
    # what goes out is read-only, so nobody downstream can change what is held
    with pytest.raises(ValueError):
        c.action[0] = 9.0
    assert f.filter(None, 5).action.tolist() == [0.3, 0.3, 0.3]


def test_ticks_and_shapes_are_checked():
    f = _filter()
    f.filter(None, 3)
    with pytest.raises(ValueError, match="does not come after"):
        f.filter(None, 3)
    with pytest.raises(ValueError, match="shape"):
        f.filter(np.zeros(4), 4)
    with pytest.raises(ValueError, match="integer"):
        f.filter(None, 4.0)  # type: ignore[arg-type]


def test_velocity_limit():
    vmax = [1.0, 10.0, np.inf]                              # step per tick: 0.02, 0.2, unlimited
    f = _filter(vmax, initial=(0.0, 0.0, 0.0))
    c = f.filter(np.array([0.5, 0.1, 0.5]), 0)
    assert c.status == "rate_limited" and "joints [0]" in c.reason
    assert c.action == pytest.approx([0.02, 0.1, 0.5])
    assert c.action[1] == 0.1 and c.action[2] == 0.5       # unlimited joints keep their exact target
    c = f.filter(np.array([-0.5, 0.1, 0.0]), 1)
    assert c.action == pytest.approx([0.0, 0.1, 0.0])
    # a skipped tick allows two steps' worth of motion
    c = f.filter(np.array([0.5, 0.1, 0.0]), 3)
    assert c.action == pytest.approx([0.04, 0.1, 0.0])
    # out of limits and too fast: clamped first, then rate limited; stays within limits
    c = f.filter(np.array([5.0, 0.1, 0.0]), 4)
    assert c.status == "rate_limited" and "clamped" in c.reason
    assert c.action == pytest.approx([0.06, 0.1, 0.0])
    # repeated holds do not move
    assert f.filter(None, 5).action == pytest.approx([0.06, 0.1, 0.0])
    # converge onto a target; every step within the bound
    prev = f.last_command
    for t in range(6, 100):
        c = f.filter(np.array([1.0, 1.0, 0.3]), t)
        assert np.all(np.abs(c.action - prev) <= np.array([0.02, 0.2, np.inf]) + 1e-12)
        assert _limits().contains(c.action)
        prev = c.action
    assert c.status == "ok" and c.action.tolist() == [1.0, 1.0, 0.3]


# ---------------------------------------------------------------------- Watchdog


def test_watchdog_holds_on_a_stalled_engine():
    wd = Watchdog(deadline_s=0.1, dt=DT)                   # 5 ticks
    assert wd.deadline_ticks == 5
    assert wd.check(0) is False                            # no chunk yet
    wd.on_chunk(1)
    assert [wd.check(t) for t in range(1, 10)] == [True] * 6 + [False] * 3
    assert wd.stale_ticks == 4 and wd.held_ticks == 4 and wd.stale_events == 1
    assert wd.max_age_ticks == 8
    wd.on_chunk(10)                                        # engine recovers
    assert wd.check(10) is True and wd.check(15) is True and wd.check(16) is False
    assert wd.stale_events == 2 and wd.chunks == 2
    with pytest.raises(ValueError, match="before"):
        wd.on_chunk(9)


def test_watchdog_finish_chunk_executes_plan_then_holds():
    """End to end: plan of 8 ticks, engine stalls after the first chunk."""
    chunk = np.linspace([0.0, 0.0, 0.0], [0.7, 0.7, 0.35], 8)

    def run(on_stale: str) -> list[SafeCommand]:
        p = ActionPlan(3, 32)
        ReplaceStitcher().merge(p, chunk, 0, 0)
        wd = Watchdog(0.06, DT, on_stale=on_stale)         # 3 ticks
        wd.on_chunk(0)
        f = _filter(initial=(0.0, 0.0, 0.0))
        out = []
        for t in range(12):
            action = p.pop(t)
            if not wd.check(t):
                action = None
            out.append(f.filter(action, t))
        return out

    hold = run("hold")
    assert [c.status for c in hold] == ["ok"] * 4 + ["held"] * 8
    assert all(np.array_equal(c.action, chunk[3]) for c in hold[4:])

    finish = run("finish_chunk")
    assert [c.status for c in finish] == ["ok"] * 8 + ["held"] * 4   # no extrapolation past the chunk
    for t in range(8):
        assert np.array_equal(finish[t].action, chunk[t])
    assert all(np.array_equal(c.action, chunk[7]) for c in finish[8:])


def test_watchdog_finish_chunk_still_waits_for_the_first_chunk_and_counts_staleness():
    wd = Watchdog(0.04, DT, on_stale="finish_chunk")
    assert wd.check(0) is False
    wd.on_chunk(1)
    assert all(wd.check(t) for t in range(1, 8))
    assert wd.stale_ticks == 1 + 4 and wd.held_ticks == 1 and wd.stale_events == 1
    assert wd.is_stale(8) and not wd.is_stale(3)


# ---------------------------------------------------------------------- found by mutation testing


def test_rate_limit_steps_from_where_the_arm_is_not_from_zero():
    """From a non-zero position each joint moves at most vmax * dt towards the target; a joint
    within its step keeps its exact target."""
    f = _filter(vmax=[1.0, 1.0, 1.0], initial=(0.5, 1.0, 0.3))          # step 0.02 per tick
    cmd = f.filter(np.array([0.9, -1.0, 0.31]), tick=1)
    np.testing.assert_allclose(cmd.action, [0.52, 0.98, 0.31], rtol=0, atol=1e-12)
    assert cmd.status == "rate_limited" and cmd.tick == 1
    assert cmd.reason == "step limited to max_velocity in joints [0, 1]"
    cmd = f.filter(np.array([2.0, -1.0, 0.31]), tick=2)                 # clamped and rate limited
    assert cmd.reason == "clamped to joint limits in joints [0]; step limited to max_velocity in joints [0, 1]"


def test_initial_state_outside_the_limits_is_held_at_the_nearest_limit():
    f = _filter(initial=(-5.0, 5.0, -1.0))
    cmd = f.filter(None, tick=3)
    np.testing.assert_array_equal(cmd.action, [-1.0, 2.0, 0.0])
    assert cmd.status == "held" and cmd.tick == 3
    assert f.filter(np.array([np.nan, 0.0, 0.0]), tick=4).tick == 4
    assert f.counts["held"] == 2


def test_limits_are_inclusive_read_only_and_refusals_name_the_joint():
    lim = _limits([1.0, 1.0, np.inf])
    assert lim.contains(lim.lower) and lim.contains(lim.upper)
    for arr in (lim.upper, lim.max_velocity):
        with pytest.raises(ValueError):
            arr[0] = 5.0
    with pytest.raises(ValueError, match=r"not so for joints \[1\]"):
        JointLimits.from_lists([0.0, 1.0], [1.0, 1.0])
    for args, match in ((([0.0], [[1.0]]), "upper must be a non-empty 1-D array"),
                        (([[0.0]], [1.0]), "lower must be a non-empty 1-D array"),
                        (([0.0], [1.0], [[1.0]]), "max_velocity must be a non-empty 1-D array"),
                        (([0.0], [np.inf]), "joint limits must be finite"),
                        (([0.0], [1.0], [0.0]), r"max_velocity must be > 0 for every joint \(inf = not limited\)")):
        with pytest.raises(ValueError, match=match):
            JointLimits.from_lists(*args)
    for call, match in ((lambda: SafetyFilter(_limits(), 0.0), "dt must be a positive number of seconds, got 0.0"),
                        (lambda: SafetyFilter([[-1, 1]], DT), "limits must be a JointLimits, got list"),
                        (lambda: Watchdog(0.0, DT), "deadline_s must be a positive number of seconds"),
                        (lambda: Watchdog(0.1, -1.0), "dt must be a positive number of seconds"),
                        (lambda: SafeCommand(np.array([np.nan]), "ok", "", 0),
                         "a SafeCommand's action must be a finite 1-D array"),
                        (lambda: _filter().set_initial(np.array([np.nan, 0.0, 0.0])),
                         "initial state contains NaN/Inf; cannot hold a non-finite position"),
                        (lambda: SafetyFilter(_limits(), DT).filter(None, 0),
                         r"SafetyFilter has no reference state: call set_initial\(robot_state\) before the first")):
        with pytest.raises((ValueError, RuntimeError), match=match):
            call()


def test_watchdog_counts_from_a_fresh_start():
    w = Watchdog(0.1, DT)                       # fresh for 5 ticks after a chunk
    assert w.max_age_ticks == 0 and w.stale_events == 0
    w.on_chunk(0)
    w.on_chunk(0)                               # a second chunk at the same tick is fine
    assert w.check(9) is False and w.stale_events == 1 and w.max_age_ticks == 9
    w.on_chunk(10)
    assert w.check(20) is False and w.stale_events == 2
    with pytest.raises(ValueError, match="tick 5 is before the newest chunk's tick 10"):
        w.age_ticks(5)
