"""Property tests (hypothesis) of the rules that must hold for every input: the safety filter's
limits and the stitchers' continuity.

Safety filter: whatever it is given (any floats, NaN, +-inf, None) at strictly increasing ticks
with any gaps, every command is finite, inside the joint limits, and moves each joint by at most
``max_velocity * dt * (ticks since the last command)`` (the first command: one tick).

Stitching: every mode only ever blends, so at each tick the merge writes, the new plan lies
between the old plan and the new chunk, joint by joint (a crossfade or a running average cannot
overshoot either); where the old plan had nothing it is the chunk; ticks before the first usable
one are untouched; and a blend's first tick moves exactly 1/(blend_steps+1) of the way.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vla_runtime.engine.safety import JointLimits, SafetyFilter
from vla_runtime.engine.stitching import ActionPlan, make_stitcher

DT = 0.02
DIM = 3
LOWER = np.array([-1.0, -2.0, 0.0])
UPPER = np.array([1.0, 2.0, 0.5])
# Slack for comparisons of float64 sums of magnitude <= ~1e3: a few ulps.
EPS = 1e-9

any_float = st.floats(allow_nan=True, allow_infinity=True, width=64)
actions = st.one_of(st.none(), hnp.arrays(np.float64, DIM, elements=any_float),
                    hnp.arrays(np.float64, DIM, elements=st.floats(-3, 3)))


@settings(max_examples=300, deadline=None)
@given(vmax=st.one_of(st.none(), st.lists(st.one_of(st.floats(0.01, 50), st.just(np.inf)), min_size=DIM,
                                          max_size=DIM)),
       initial=hnp.arrays(np.float64, DIM, elements=st.floats(-5, 5)),
       steps=st.lists(st.tuples(st.integers(1, 5), actions), min_size=1, max_size=30))
def test_safety_filter_output_is_finite_within_limits_and_rate(vmax, initial, steps):
    limits = JointLimits.from_lists(LOWER.tolist(), UPPER.tolist(), vmax)
    f = SafetyFilter(limits, DT)
    f.set_initial(initial)
    last, tick, last_tick = np.clip(initial, LOWER, UPPER), 0, None
    for gap, action in steps:
        tick += gap
        cmd = f.filter(action, tick).action
        assert np.all(np.isfinite(cmd)) and limits.contains(cmd)
        assert np.all(cmd >= LOWER) and np.all(cmd <= UPPER)
        if vmax is not None:
            elapsed = 1 if last_tick is None else tick - last_tick
            bound = np.asarray(vmax) * DT * elapsed
            assert np.all(np.abs(cmd - last) <= bound + EPS), (cmd, last, bound)
        last, last_tick = cmd, tick


chunks = st.integers(1, 8).flatmap(lambda c: hnp.arrays(np.float64, (c, DIM), elements=st.floats(-10, 10)))
modes = st.sampled_from([("replace", {}), ("blend", {"blend_steps": 3}), ("blend", {"blend_steps": 0}),
                         ("ensemble", {"ensemble_decay": 0.3}), ("ensemble", {"ensemble_decay": 0.0}),
                         ("freeze", {"freeze_steps": 2, "post_freeze_blend": 2})])


@settings(max_examples=300, deadline=None)
@given(mode=modes, merges=st.lists(st.tuples(chunks, st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=6))
def test_every_stitcher_stays_between_the_old_plan_and_the_new_chunk(mode, merges):
    name, params = mode
    stitcher = make_stitcher(name, **params)
    plan = ActionPlan(DIM, capacity=64)
    now = 0
    for chunk, delay, advance in merges:
        for _ in range(advance):                 # the controller executes some ticks
            plan.pop(now)
            now += 1
        start = max(now - delay, 0)              # the chunk was planned from an earlier tick
        first = max(start, now, (plan.last_popped_tick + 1) if plan.last_popped_tick is not None else start)
        end = start + len(chunk) - 1
        span = max(end, first) + 8
        before, before_mask = plan.read(now, span)
        stitcher.merge(plan, chunk, start, now)
        after, after_mask = plan.read(now, span)
        for i, t in enumerate(range(now, span)):
            if t < first:                                             # not usable: untouched
                assert after_mask[i] == before_mask[i] and np.array_equal(after[i], before[i])
            elif t <= end:
                new = chunk[t - start]
                assert after_mask[i]
                if before_mask[i]:
                    lo, hi = np.minimum(before[i], new), np.maximum(before[i], new)
                    assert np.all(after[i] >= lo - EPS) and np.all(after[i] <= hi + EPS), (t, before[i], new, after[i])
                else:
                    np.testing.assert_allclose(after[i], new, rtol=0, atol=EPS)
        if name == "blend" and first <= end and before_mask[first - now]:
            w = 1.0 / (params["blend_steps"] + 1)
            old, new = before[first - now], chunk[first - start]
            np.testing.assert_allclose(after[first - now], old + w * (new - old), rtol=0, atol=EPS)
