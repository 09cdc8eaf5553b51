"""Chunk stitching: the plan ring and each merge mode's semantics on hand-made chunks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vla_runtime.engine.stitching import (
    ActionPlan,
    BlendStitcher,
    EnsembleStitcher,
    FreezeStitcher,
    ReplaceStitcher,
    StitchConfig,
    Stitcher,
    boundary_jerk,
    make_stitcher,
)


def _chunk(values, dim: int = 2) -> np.ndarray:
    """Chunk whose joint j at row i is values[i] + 100 * j, so rows are easy to recognise."""
    v = np.asarray(values, dtype=np.float64)[:, None]
    return v + 100.0 * np.arange(dim)[None, :]


def _plan_rows(plan: ActionPlan, start: int, stop: int) -> list:
    return [None if (a := plan.action_at(t)) is None else a.tolist() for t in range(start, stop)]


# ---------------------------------------------------------------------- ActionPlan


def test_plan_empty_and_validation():
    plan = ActionPlan(action_dim=2, capacity=16)
    assert plan.action_at(0) is None
    assert plan.last_planned_tick() is None
    assert plan.remaining(0) == 0
    assert plan.pop(0) is None
    with pytest.raises(ValueError, match="action_dim"):
        ActionPlan(0, 8)
    with pytest.raises(ValueError, match="capacity"):
        ActionPlan(2, 0)
    with pytest.raises(ValueError, match="integer control tick"):
        plan.action_at(1.0)  # type: ignore[arg-type]


def test_plan_pop_commits_and_forgets_earlier_ticks():
    plan = ActionPlan(2, 16)
    ReplaceStitcher().merge(plan, _chunk(range(5)), start_tick=10, now=10)
    assert plan.last_planned_tick() == 14
    assert plan.remaining(10) == 5 and plan.remaining(12) == 3 and plan.remaining(15) == 0
    np.testing.assert_array_equal(plan.pop(10), [0.0, 100.0])
    np.testing.assert_array_equal(plan.pop(12), [2.0, 102.0])
    assert plan.action_at(11) is None          # forgotten by the commit at 12
    assert plan.last_popped_tick == 12
    np.testing.assert_array_equal(plan.pop(12), [2.0, 102.0])   # idempotent
    tick, action = plan.executed()
    assert tick == 12 and action.tolist() == [2.0, 102.0]
    with pytest.raises(ValueError, match="back in time"):
        plan.pop(11)
    # returned arrays are copies
    a = plan.action_at(13)
    a[:] = -1
    assert plan.action_at(13).tolist() == [3.0, 103.0]


def test_ring_wraps_over_many_chunks():
    """A 50-chunk run through a ring of 12 ticks: every tick executes its own chunk's value."""
    plan = ActionPlan(3, capacity=12)
    stitch = ReplaceStitcher()
    C, stride = 8, 5
    got = []
    for k in range(50):
        start = k * stride
        chunk = np.stack([np.full(3, 1000.0 * k + i) for i in range(C)])
        stitch.merge(plan, chunk, start_tick=start, now=start)
        for t in range(start, start + stride):
            got.append(plan.pop(t))
    for t, a in enumerate(got):
        k, i = divmod(t, stride)
        np.testing.assert_array_equal(a, np.full(3, 1000.0 * k + i))
    assert plan.last_planned_tick() == 49 * stride + C - 1
    assert plan.remaining(50 * stride) == C - stride


def test_chunk_that_does_not_fit_is_refused_unchanged():
    plan = ActionPlan(2, capacity=6)
    ReplaceStitcher().merge(plan, _chunk(range(4)), 0, 0)
    before = _plan_rows(plan, 0, 10)
    with pytest.raises(ValueError, match="capacity"):
        ReplaceStitcher().merge(plan, _chunk(range(8)), 2, 0)   # would need ticks 0..9
    assert _plan_rows(plan, 0, 10) == before


def test_a_chunk_filling_the_ring_exactly_fits():
    """The retained window is [floor, floor + capacity): capacity ticks fit, one more does not."""
    plan = ActionPlan(2, capacity=6)
    ReplaceStitcher().merge(plan, _chunk(range(6)), 0, 0)
    assert plan.last_planned_tick() == 5 and plan.remaining(0) == 6
    with pytest.raises(ValueError, match="capacity"):
        ReplaceStitcher().merge(plan, _chunk(range(7)), 0, 0)
    assert _plan_rows(plan, 0, 6) == [[float(i), 100.0 + i] for i in range(6)]


def test_gap_between_chunks_is_none_not_interpolated():
    plan = ActionPlan(2, 32)
    s = FreezeStitcher(freeze_steps=0)
    s.merge(plan, _chunk([1, 2, 3]), 0, 0)
    s.merge(plan, _chunk([7, 8]), 5, 1)                  # arrives early, starts after a gap
    assert _plan_rows(plan, 1, 8) == [[2, 102], [3, 103], None, None, [7, 107], [8, 108], None]
    assert plan.remaining(1) == 2
    mask = plan.read(1, 8)[1]
    assert mask.tolist() == [True, True, False, False, True, True, False]


def test_bad_arguments_are_named_in_the_error():
    """Each refusal names the offending argument or position (found by mutation testing: the
    messages were not checked)."""
    plan = ActionPlan(2, 16)
    s = ReplaceStitcher()
    for call, match in ((lambda: plan.read(0.5, 2), "start must be"), (lambda: plan.read(0, 2.5), "stop must be"),
                        (lambda: plan.read(3, 2), r"read range \[3, 2\) is reversed"),
                        (lambda: s.merge(plan, _chunk([1]), 1.0, 0), "start_tick must be"),
                        (lambda: s.merge(plan, _chunk([1]), 0, 1.0), "now must be"),
                        (lambda: s.merge({}, _chunk([1]), 0, 0), "plan must be an ActionPlan, got dict"),
                        (lambda: s.merge(plan, _chunk([1, 2]).astype(np.complex128), 0, 0),
                         "real-valued, got dtype complex128"),
                        (lambda: FreezeStitcher().merge(plan, _chunk([1]), 0, 0, freeze=-1), "freeze must be")):
        with pytest.raises(ValueError, match=match):
            call()
    for call, match in ((lambda: plan.action_at(1.5), "tick must be"), (lambda: plan.pop(1.5), "tick must be"),
                        (lambda: plan.remaining(1.5), "now must be"),
                        (lambda: BlendStitcher(-1), "blend_steps must be"),
                        (lambda: FreezeStitcher(freeze_steps=-1), "freeze_steps must be"),
                        (lambda: FreezeStitcher(post_freeze_blend=-1), "post_freeze_blend must be"),
                        (lambda: FreezeStitcher().merge(plan, _chunk([1]), 0, 0), "freeze stitcher needs the number"),
                        (lambda: StitchConfig(mode="lerp"), "stitch mode must be one of"),
                        (lambda: StitchConfig(blend_steps=-1), "blend_steps must be"),
                        (lambda: StitchConfig(freeze_steps=-1), "freeze_steps must be"),
                        (lambda: StitchConfig(post_freeze_blend=-1), "post_freeze_blend must be"),
                        (lambda: StitchConfig(ensemble_decay=-0.1), "ensemble_decay must be a finite number"),
                        (lambda: s.merge(ActionPlan(2, 4), _chunk(range(6)), 0, 0),
                         r"merge needs ticks 0..5 \(6 ticks\) but the plan holds 4")):
        with pytest.raises(ValueError, match=match):
            call()
    bad = _chunk([1, 2, 3])
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"first at action 2, joint 1"):
        s.merge(plan, bad, 0, 0)


def test_empty_read_and_one_row_chunk():
    plan = ActionPlan(2, 16)
    actions, mask = plan.read(4, 4)
    assert actions.shape == (0, 2) and actions.dtype == np.float64 and mask.shape == (0,)
    ReplaceStitcher().merge(plan, _chunk([7]), 3, 3)           # a chunk of one action is a chunk
    assert _plan_rows(plan, 3, 5) == [[7, 107], None]
    assert plan.last_planned_tick() == 3 and plan.remaining(3) == 1 and plan.remaining(4) == 0
    actions, mask = plan.read(2, 5)
    assert actions.dtype == np.float64 and mask.tolist() == [False, True, False]


# ---------------------------------------------------------------------- replace


def test_replace_boundaries():
    plan = ActionPlan(2, 32)
    s = make_stitcher("replace")
    assert isinstance(s, Stitcher) and s.name == "replace"
    s.merge(plan, _chunk([0, 1, 2, 3, 4, 5]), start_tick=0, now=0)
    plan.pop(0), plan.pop(1)
    # chunk anchored at 1 but merged at now=3: ticks 1, 2 are stale; 3.. are the new chunk
    s.merge(plan, _chunk([10, 11, 12, 13, 14]), start_tick=1, now=3)
    assert [plan.action_at(t)[0] for t in range(3, 6)] == [12.0, 13.0, 14.0]
    assert plan.action_at(6) is None                     # never beyond the chunk's last action
    assert plan.last_planned_tick() == 5
    # ticks before now are forgotten by the merge, tick 2 is gone too
    assert plan.action_at(2) is None


def test_replace_never_rewrites_an_executed_tick():
    plan = ActionPlan(1, 16)
    s = ReplaceStitcher()
    s.merge(plan, np.zeros((4, 1)), 0, 0)
    plan.pop(2)
    s.merge(plan, np.ones((4, 1)), start_tick=0, now=2)   # caller passes now = popped tick
    assert plan.action_at(2)[0] == 0.0                     # committed action unchanged
    assert plan.action_at(3)[0] == 1.0


def test_newest_chunk_shorter_cuts_the_old_tail():
    plan = ActionPlan(1, 16)
    s = ReplaceStitcher()
    s.merge(plan, np.zeros((8, 1)), 0, 0)
    s.merge(plan, np.ones((2, 1)), 2, 2)
    assert plan.last_planned_tick() == 3
    assert plan.action_at(4) is None


# ---------------------------------------------------------------------- blend


def test_blend_weights_each_step_exactly():
    plan = ActionPlan(2, 32)
    s = BlendStitcher(blend_steps=3)
    old = _chunk([0.0] * 10)
    new = _chunk([8.0] * 10)
    s.merge(plan, old, 0, 0)
    s.merge(plan, new, start_tick=4, now=4)
    # w_i = (i+1)/4 -> 2, 4, 6, then the new chunk (ticks before now=4 are forgotten)
    expected_j0 = [2, 4, 6, 8, 8, 8, 8, 8, 8, 8]
    got = [plan.action_at(t) for t in range(4, 14)]
    assert [a[0] for a in got] == expected_j0
    assert [a[1] for a in got] == [100 + v for v in expected_j0]
    assert plan.action_at(14) is None


def test_blend_where_old_plan_ends_uses_new_chunk():
    plan = ActionPlan(1, 32)
    s = BlendStitcher(blend_steps=4)
    s.merge(plan, np.zeros((6, 1)), 0, 0)        # old plan: ticks 0..5
    s.merge(plan, np.full((6, 1), 10.0), 4, 4)   # blend window 4..7, old exists at 4, 5 only
    assert [plan.action_at(t)[0] for t in range(4, 10)] == [2.0, 4.0, 10.0, 10.0, 10.0, 10.0]


def test_blend_zero_steps_is_replace_and_late_chunk_blends_from_now():
    plan = ActionPlan(1, 32)
    make_stitcher("blend", blend_steps=0).merge(plan, np.zeros((4, 1)), 0, 0)
    make_stitcher("blend", blend_steps=0).merge(plan, np.ones((4, 1)), 2, 2)
    assert [plan.action_at(t)[0] for t in range(2, 6)] == [1.0] * 4
    b = BlendStitcher(blend_steps=1)
    b.merge(plan, np.full((6, 1), 5.0), start_tick=1, now=3)   # late by two ticks
    assert plan.action_at(3)[0] == pytest.approx(0.5 * 1.0 + 0.5 * 5.0)
    assert [plan.action_at(t)[0] for t in range(4, 7)] == [5.0, 5.0, 5.0]
    assert plan.action_at(7) is None


# ---------------------------------------------------------------------- ensemble


def test_ensemble_matches_hand_computation_with_three_chunks():
    m = 0.5
    plan = ActionPlan(1, 32)
    s = EnsembleStitcher(ensemble_decay=m)
    a = np.array([[1.0], [2.0], [3.0], [4.0]])        # ticks 0..3
    b = np.array([[10.0], [20.0], [30.0], [40.0]])    # ticks 1..4
    c = np.array([[100.0], [200.0], [300.0], [400.0]])  # ticks 2..5
    s.merge(plan, a, 0, 0)
    s.merge(plan, b, 1, 1)
    w0, w1, w2 = 1.0, math.exp(-m), math.exp(-2 * m)   # k = 0 for the oldest prediction
    assert plan.action_at(1)[0] == pytest.approx((2 * w0 + 10 * w1) / (w0 + w1), rel=1e-12)
    s.merge(plan, c, 2, 2)
    expected = {
        2: (3 * w0 + 20 * w1 + 100 * w2) / (w0 + w1 + w2),
        3: (4 * w0 + 30 * w1 + 200 * w2) / (w0 + w1 + w2),
        4: (40 * w0 + 300 * w1) / (w0 + w1),
        5: 400.0,
    }
    for t, v in expected.items():
        assert plan.action_at(t)[0] == pytest.approx(v, rel=1e-12)
    assert plan.action_at(1) is None                    # before now=2: forgotten by the merge
    assert [s.predictions_at(t) for t in range(2, 7)] == [3, 3, 2, 1, 0]
    assert plan.action_at(6) is None


def test_ensemble_drops_stale_predictions_and_zero_decay_is_mean():
    plan = ActionPlan(1, 32)
    s = EnsembleStitcher(ensemble_decay=0.0)
    s.merge(plan, np.array([[0.0], [0.0], [0.0], [0.0]]), 0, 0)
    s.merge(plan, np.array([[9.0], [9.0], [6.0], [6.0]]), start_tick=0, now=2)   # rows 0, 1 stale
    assert [plan.action_at(t)[0] for t in (2, 3)] == [3.0, 3.0]
    assert s.predictions_at(2) == 2
    assert plan.action_at(1) is None


def test_ensemble_counts_a_foreign_planned_action_as_one_prediction():
    plan = ActionPlan(1, 32)
    ReplaceStitcher().merge(plan, np.full((3, 1), 2.0), 0, 0)
    s = EnsembleStitcher(ensemble_decay=0.0)
    s.merge(plan, np.full((3, 1), 4.0), 1, 1)
    assert [plan.action_at(t)[0] for t in (1, 2, 3)] == [3.0, 3.0, 4.0]


def test_ensemble_bounded_memory_over_many_chunks():
    """Calling every tick (the densest overlap) for 200 ticks in a ring of 20: the ensemble's
    records live in a ring as large as the plan's and the values stay the running average."""
    C, m = 10, 0.1
    plan = ActionPlan(1, 20)
    s = EnsembleStitcher(ensemble_decay=m)
    for t in range(200):
        s.merge(plan, np.full((C, 1), float(t)), t, t)
        out = plan.pop(t)
        ks = np.arange(min(t + 1, C))               # predictions for t came from chunks t-C+1..t
        preds = (t - (len(ks) - 1)) + ks            # oldest first
        w = np.exp(-m * ks)
        assert out[0] == pytest.approx(float((w * preds).sum() / w.sum()), rel=1e-12)
    assert s._sum.shape == (20, 1)


# ---------------------------------------------------------------------- freeze


def test_freeze_keeps_prefix_bit_exact_then_new_chunk():
    rng = np.random.default_rng(0)
    plan = ActionPlan(3, 32)
    s = make_stitcher("freeze")
    old = rng.normal(size=(10, 3))
    new = rng.normal(size=(10, 3))
    s.merge(plan, old, 0, 0, freeze=0)
    for t in range(3):
        plan.pop(t)
    s.merge(plan, new, start_tick=3, now=3, freeze=4)
    for t in range(3, 7):
        assert np.array_equal(plan.action_at(t), old[t])          # bit-exact carry
    for t in range(7, 13):
        assert np.array_equal(plan.action_at(t), new[t - 3])
    assert plan.action_at(13) is None


def test_freeze_with_post_blend_and_late_arrival():
    plan = ActionPlan(1, 32)
    s = FreezeStitcher(freeze_steps=2, post_freeze_blend=1)
    s.merge(plan, np.arange(10, dtype=float)[:, None], 0, 0)        # old[t] = t
    s.merge(plan, np.full((8, 1), 50.0), start_tick=2, now=4)       # late: rows 0, 1 stale
    got = [plan.action_at(t)[0] for t in range(4, 10)]
    # frozen 4, 5 (old), blend at 6 with w = 1/2, then new
    assert got == [4.0, 5.0, 0.5 * 6.0 + 0.5 * 50.0, 50.0, 50.0, 50.0]


def test_freeze_fills_missing_old_actions_and_keeps_committed_tail():
    plan = ActionPlan(1, 32)
    s = FreezeStitcher()
    s.merge(plan, np.zeros((3, 1)), 0, 0, freeze=0)      # old plan: 0..2
    s.merge(plan, np.ones((3, 1)), 1, 1, freeze=4)       # frozen 1..4; old only at 1, 2
    assert [plan.action_at(t)[0] for t in range(1, 4)] == [0.0, 0.0, 1.0]
    # a new chunk shorter than the committed prefix: committed ticks survive
    s2 = FreezeStitcher()
    p2 = ActionPlan(1, 32)
    s2.merge(p2, np.arange(8, dtype=float)[:, None], 0, 0, freeze=0)
    s2.merge(p2, np.full((2, 1), 9.0), 2, 2, freeze=5)  # frozen 2..6 but chunk ends at 3
    assert [p2.action_at(t)[0] for t in range(2, 7)] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert p2.action_at(7) is None


def test_freeze_needs_a_count():
    plan = ActionPlan(1, 8)
    with pytest.raises(ValueError, match="freeze"):
        FreezeStitcher().merge(plan, np.zeros((2, 1)), 0, 0)
    with pytest.raises(ValueError, match="freeze"):
        FreezeStitcher().merge(plan, np.zeros((2, 1)), 0, 0, freeze=-1)
    s = FreezeStitcher()
    s.freeze_steps = 1                                    # set on the stitcher before merging
    s.merge(plan, np.zeros((2, 1)), 0, 0)
    assert plan.last_planned_tick() == 1


# ---------------------------------------------------------------------- all modes


MODES = ["replace", "blend", "ensemble", "freeze"]


@pytest.mark.parametrize("mode", MODES)
def test_nan_chunk_rejected_plan_unchanged(mode):
    plan = ActionPlan(2, 32)
    s = make_stitcher(mode, blend_steps=2, freeze_steps=1)
    s.merge(plan, _chunk(range(6)), 0, 0)
    before = _plan_rows(plan, 0, 12)
    for bad in (np.nan, np.inf, -np.inf):
        chunk = _chunk(range(6))
        chunk[3, 1] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            s.merge(plan, chunk, 2, 2)
        assert _plan_rows(plan, 0, 12) == before
    s.merge(plan, _chunk(range(6)), 2, 2)               # the stitcher still works afterwards


@pytest.mark.parametrize("mode", MODES)
def test_entirely_stale_chunk_is_noop(mode):
    plan = ActionPlan(2, 32)
    s = make_stitcher(mode, freeze_steps=1)
    s.merge(plan, _chunk(range(10)), 0, 0)
    plan.pop(6)
    before = _plan_rows(plan, 0, 12)
    s.merge(plan, _chunk([50, 51, 52]), start_tick=2, now=7)   # covers 2..4 < 7
    s.merge(plan, _chunk([50, 51, 52]), start_tick=4, now=6)   # covers 4..6, 6 already executed
    assert _plan_rows(plan, 0, 12) == before


@pytest.mark.parametrize("mode", MODES)
def test_shape_checks(mode):
    plan = ActionPlan(2, 32)
    s = make_stitcher(mode, freeze_steps=0)
    for bad in (np.zeros((4, 3)), np.zeros(4), np.zeros((0, 2)), np.zeros((2, 4, 2))):
        with pytest.raises(ValueError, match="shape"):
            s.merge(plan, bad, 0, 0)
    with pytest.raises(ValueError, match="integer"):
        s.merge(plan, np.zeros((4, 2)), 0.0, 0)  # type: ignore[arg-type]
    assert plan.last_planned_tick() is None


@pytest.mark.parametrize("mode", MODES)
def test_first_chunk_on_empty_plan_is_the_chunk(mode):
    plan = ActionPlan(2, 32)
    s = make_stitcher(mode, freeze_steps=3, blend_steps=3)
    chunk = _chunk(np.linspace(0, 1, 5)).astype(np.float32)
    s.merge(plan, chunk, 7, 7)
    for i in range(5):
        np.testing.assert_array_equal(plan.action_at(7 + i), chunk[i].astype(np.float64))
    assert plan.action_at(12) is None and plan.action_at(6) is None


def test_make_stitcher_and_config():
    assert [make_stitcher(m, freeze_steps=1).name for m in MODES] == MODES
    with pytest.raises(ValueError, match="unknown stitching mode"):
        make_stitcher("average")
    with pytest.raises(ValueError, match="unknown stitcher parameter"):
        make_stitcher("blend", blend_step=3)
    with pytest.raises(ValueError, match="blend_steps"):
        make_stitcher("blend", blend_steps=-1)
    with pytest.raises(ValueError, match="ensemble_decay"):
        make_stitcher("ensemble", ensemble_decay=float("nan"))
    cfg = StitchConfig()
    assert cfg.mode == "freeze" and cfg.freeze_steps is None and cfg.blend_steps == 8
    s = StitchConfig(mode="blend", blend_steps=5).build()
    assert isinstance(s, BlendStitcher) and s.blend_steps == 5
    f = StitchConfig(mode="freeze", freeze_steps=3, post_freeze_blend=2).build()
    assert isinstance(f, FreezeStitcher) and (f.freeze_steps, f.post_freeze_blend) == (3, 2)
    e = StitchConfig(mode="ensemble", ensemble_decay=0.2).build()
    assert isinstance(e, EnsembleStitcher) and e.ensemble_decay == 0.2
    for bad in (dict(mode="x"), dict(blend_steps=-1), dict(ensemble_decay=-0.1),
                dict(freeze_steps=1.5), dict(post_freeze_blend=-2), dict(ensemble_decay=float("inf"))):
        with pytest.raises(ValueError):
            StitchConfig(**bad)


# ---------------------------------------------------------------------- boundary_jerk


def test_boundary_jerk_on_cubic_and_a_step():
    dt, c = 0.02, 3.0
    t = np.arange(40) * dt
    cubic = np.stack([c * t**3, -2 * c * t**3], axis=1)   # jerk 6c and -12c exactly
    r = boundary_jerk(cubic, dt, boundaries=[10, 25])
    expected = math.sqrt(((6 * c) ** 2 + (12 * c) ** 2) / 2)
    assert r["rms_jerk"] == pytest.approx(expected, rel=1e-6)
    assert r["boundary_rms_jerk"] == pytest.approx(expected, rel=1e-6)
    assert r["per_boundary"] == pytest.approx([expected, expected], rel=1e-6)
    assert r["boundaries_used"] == 2 and r["boundaries_skipped"] == 0

    # a step of h at boundary b: third differences touching it are h, -3h... /dt^3
    h, b = 0.1, 20
    step = np.zeros((40, 1))
    step[b:] = h
    r = boundary_jerk(step, dt, boundaries=[b, 0, 40], window=0)
    per = math.sqrt((1 + 4 + 1) / 3) * h / dt**3        # j[b-3..b-1] = h, -2h, h
    assert r["per_boundary"] == pytest.approx([per])
    assert r["boundaries_skipped"] == 2
    assert r["rms_jerk"] == pytest.approx(math.sqrt(6 / 37) * h / dt**3)   # 37 differences
    assert r["max_abs_jerk"] == pytest.approx(2 * h / dt**3)


def test_boundary_jerk_validation():
    with pytest.raises(ValueError, match="shape"):
        boundary_jerk(np.zeros((3, 2)), 0.01, [1])
    with pytest.raises(ValueError, match="NaN"):
        boundary_jerk(np.full((5, 1), np.nan), 0.01, [1])
    with pytest.raises(ValueError, match="dt"):
        boundary_jerk(np.zeros((5, 1)), 0.0, [1])
    assert boundary_jerk(np.zeros((5, 1)), 0.01, [])["boundary_rms_jerk"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_random_control_loop_invariants(mode):
    """A loop with jittery latency: every executed action is finite, nothing is planned past
    the newest chunk's end, and the plan is contiguous from the executing tick."""
    rng = np.random.default_rng(7)
    C, A = 10, 4
    plan = ActionPlan(A, capacity=3 * C)
    s = make_stitcher(mode, blend_steps=3, ensemble_decay=0.05, post_freeze_blend=2)
    t = 0
    late = 0
    while t < 300:
        start = t + 2                       # the scheduler expects the chunk in 2 ticks...
        arrive = t + int(rng.integers(0, 6))  # ...it arrives after 0..5
        while t < arrive:
            a = plan.pop(t)
            assert a is None or np.isfinite(a).all()
            t += 1
        late += arrive > start
        s.merge(plan, rng.normal(size=(C, A)).cumsum(axis=0), start_tick=start, now=t, freeze=2)
        newest_end = start + C - 1
        assert plan.last_planned_tick() == newest_end
        assert plan.remaining(max(t, start)) == newest_end - max(t, start) + 1
        assert plan.action_at(newest_end + 1) is None
    assert late > 0


def _jerk_by_hand(a: np.ndarray, dt: float, boundaries: list[int], window: int) -> dict:
    """boundary_jerk's documented rule written out with loops: j[k] = (a[k+3] - 3a[k+2] + 3a[k+1] - a[k]) / dt^3;
    a boundary b (1 <= b <= T-1) covers the differences k in [b-3-window, b-1+window] that exist."""
    T = len(a)
    j = [(a[k + 3] - 3 * a[k + 2] + 3 * a[k + 1] - a[k]) / dt**3 for k in range(T - 3)]
    covered: set[int] = set()
    per = []
    for b in boundaries:
        if not 1 <= b <= T - 1:
            continue
        ks = [k for k in range(b - 3 - window, b + window) if 0 <= k < T - 3]
        covered |= set(ks)
        per.append(math.sqrt(sum(float((j[k] ** 2).sum()) for k in ks) / (len(ks) * a.shape[1])))
    allsq = sum(float((x ** 2).sum()) for x in j) / (len(j) * a.shape[1])
    cov = sorted(covered)
    return {"rms_jerk": math.sqrt(allsq),
            "boundary_rms_jerk": math.sqrt(sum(float((j[k] ** 2).sum()) for k in cov) / (len(cov) * a.shape[1]))
            if cov else 0.0,
            "per_boundary": per, "max_abs_jerk": max(float(np.abs(x).max()) for x in j),
            "boundaries_used": len(per), "boundaries_skipped": len(boundaries) - len(per)}


@pytest.mark.parametrize("window", [0, 1, 2, 5])
def test_boundary_jerk_windows_follow_the_written_out_rule_at_every_edge(window):
    # random actions (every difference distinct), boundaries at both ends of the trajectory,
    # overlapping windows and ones outside it; the same sums in another order: float64 rounding
    rng = np.random.default_rng(window)
    a = rng.normal(size=(12, 3))
    bounds = [0, 1, 2, 3, 6, 7, 10, 11, 12, -1]
    got = boundary_jerk(a, 0.02, bounds, window=window)
    want = _jerk_by_hand(a, 0.02, bounds, window)
    assert got["boundaries_used"] == want["boundaries_used"] == 7
    assert got["boundaries_skipped"] == want["boundaries_skipped"] == 3
    for key in ("rms_jerk", "boundary_rms_jerk", "max_abs_jerk"):
        assert got[key] == pytest.approx(want[key], rel=1e-12), key
    assert got["per_boundary"] == pytest.approx(want["per_boundary"], rel=1e-12)
    # a single boundary: its window alone, and the union equals it
    one = boundary_jerk(a, 0.02, [6], window=window)
    assert one["boundary_rms_jerk"] == pytest.approx(_jerk_by_hand(a, 0.02, [6], window)["boundary_rms_jerk"], rel=1e-12)
    assert one["per_boundary"] == pytest.approx([one["boundary_rms_jerk"]], rel=1e-12)


def test_boundary_jerk_errors_name_the_value():
    with pytest.raises(ValueError, match=r"actions must have shape \[T >= 4, A\], got \(3, 2\)"):
        boundary_jerk(np.zeros((3, 2)), 0.01, [1])
    with pytest.raises(ValueError, match=r"got \(5,\)"):
        boundary_jerk(np.zeros(5), 0.01, [1])
    with pytest.raises(ValueError, match="^actions contain NaN/Inf; log held commands, not missing ones$"):
        boundary_jerk(np.array([[0.0], [1.0], [np.inf], [2.0]]), 0.01, [1])
    for dt in (0.0, -0.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"dt must be a positive number of seconds, got {dt!r}"):
            boundary_jerk(np.zeros((5, 1)), dt, [1])
    with pytest.raises(ValueError, match="^window must be a non-negative integer, got -1$"):
        boundary_jerk(np.zeros((5, 1)), 0.01, [1], window=-1)
    with pytest.raises(ValueError, match="^boundary must be an integer control tick, got 1.5$"):
        boundary_jerk(np.zeros((5, 1)), 0.01, [1.5])


def test_boundary_jerk_window_defaults_to_two_differences_each_side():
    a = np.random.default_rng(7).normal(size=(20, 2))
    assert boundary_jerk(a, 0.02, [10]) == boundary_jerk(a, 0.02, [10], window=2)
    assert boundary_jerk(a, 0.02, [10]) != boundary_jerk(a, 0.02, [10], window=3)


def test_clear_drops_every_planned_action_and_keeps_the_commit_point():
    plan = ActionPlan(action_dim=2, capacity=16)
    ReplaceStitcher().merge(plan, _chunk([1.0, 2.0, 3.0, 4.0]), start_tick=0, now=0)
    assert plan.pop(1).tolist() == _chunk([2.0])[0].tolist()
    plan.clear()
    assert plan.last_planned_tick() is None and plan.remaining(2) == 0
    assert _plan_rows(plan, 0, 5) == [None] * 5
    assert plan.last_popped_tick == 1                       # what was executed stays executed
    ReplaceStitcher().merge(plan, _chunk([7.0, 8.0, 9.0]), start_tick=0, now=2)
    assert _plan_rows(plan, 0, 4) == [None, None, _chunk([9.0])[0].tolist(), None]


class _DictPlan:
    """ActionPlan's documented contract over a plain dict (no ring): what replace merges and
    pops must leave, for comparing the ring's bookkeeping with at every step."""

    def __init__(self, capacity: int):
        self.capacity, self.actions, self.floor, self.last_popped = capacity, {}, None, None

    def merge(self, chunk: np.ndarray, start: int, now: int) -> None:
        first = max(start, now, -10**9 if self.last_popped is None else self.last_popped + 1)
        end = start + len(chunk) - 1
        if first > end:
            return
        floor = now if self.floor is None else max(self.floor, now)
        if end - floor + 1 > self.capacity:
            raise ValueError("does not fit")
        self.floor = floor
        self.actions = {t: a for t, a in self.actions.items() if floor <= t <= end}
        self.actions.update({first + i: chunk[first - start + i] for i in range(end - first + 1)})

    def pop(self, tick: int):
        action = self.actions.get(tick) if self.floor is None or tick >= self.floor else None
        self.last_popped = tick
        self.floor = tick if self.floor is None else max(self.floor, tick)
        self.actions = {t: a for t, a in self.actions.items() if t >= self.floor}
        return action

    def last_planned(self) -> int | None:
        return max(self.actions) if self.actions else None

    def remaining(self, now: int) -> int:
        n = 0
        while now + n in self.actions:
            n += 1
        return n


@pytest.mark.parametrize("capacity", [1, 3, 7])
def test_the_ring_keeps_the_dict_contract_through_laps_late_chunks_and_refusals(capacity):
    # random replace merges and pops over many laps of a small ring: chunks that arrive late,
    # start in the future, end before the plan does, do not fit; every query compared after each step
    rng = np.random.default_rng(capacity)
    plan, ref, replace = ActionPlan(action_dim=2, capacity=capacity), _DictPlan(capacity), ReplaceStitcher()
    now, refused = 0, 0
    for step in range(300):
        if rng.random() < 0.6:
            length = int(rng.integers(1, capacity + 3))
            start = now + int(rng.integers(-3, 4))
            chunk = rng.normal(size=(length, 2))
            try:
                ref.merge(chunk, start, now)
            except ValueError:
                refused += 1
                before = plan.read(now - capacity, now + 2 * capacity)
                with pytest.raises(ValueError, match="holds"):
                    replace.merge(plan, chunk, start, now)
                after = plan.read(now - capacity, now + 2 * capacity)
                assert np.array_equal(before[1], after[1]) and np.array_equal(before[0], after[0])
            else:
                replace.merge(plan, chunk, start, now)
        else:
            got, want = plan.pop(now), ref.pop(now)
            assert (got is None) == (want is None) and (got is None or np.array_equal(got, want)), step
            now += int(rng.integers(1, 3))
        assert plan.last_planned_tick() == ref.last_planned(), step
        for t in range(now - 2, now + 2 * capacity + 4):
            assert plan.remaining(t) == ref.remaining(t), (step, t)
        acts, mask = plan.read(now - 2, now + 2 * capacity + 4)
        for i, t in enumerate(range(now - 2, now + 2 * capacity + 4)):
            assert bool(mask[i]) == (t in ref.actions), (step, t)
            if mask[i]:
                assert np.array_equal(acts[i], ref.actions[t]) and np.array_equal(plan.action_at(t), ref.actions[t])
    assert refused > 0   # the draw exercised the capacity refusal


@pytest.mark.parametrize("old_len", [9, 10])   # an odd and an even committed tail past the new chunk
def test_freeze_keeps_a_committed_tail_to_its_last_tick_and_invents_none(old_len):
    plan = ActionPlan(action_dim=2, capacity=32)
    old = _chunk(np.arange(old_len) + 1.0)
    ReplaceStitcher().merge(plan, old, start_tick=0, now=0)
    FreezeStitcher().merge(plan, _chunk([-1.0, -2.0, -3.0]), start_tick=2, now=2, freeze=20)
    # ticks 2..old_len-1 were committed: kept bit-exactly (all inside the freeze); nothing after them
    assert plan.last_planned_tick() == old_len - 1
    assert _plan_rows(plan, 2, old_len + 3) == [old[t].tolist() for t in range(2, old_len)] + [None] * 3
