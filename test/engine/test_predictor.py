"""Future-state predictors on hand-made plans."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.engine.predictor import (AbsoluteActionPredictor, DeltaActionPredictor, ObservedState,
                                          make_predictor)


class _Plan:
    """A plan given as {tick: action}; the predictors only read ``action_at``."""

    def __init__(self, actions: dict[int, list[float]]):
        self.actions = {t: np.asarray(a, dtype=np.float64) for t, a in actions.items()}

    def action_at(self, tick: int) -> np.ndarray | None:
        return self.actions.get(tick)


OBSERVED = np.array([0.0, 1.0])
PLAN = _Plan({10: [0.1, 1.1], 11: [0.2, 1.2], 12: [0.3, 1.3], 13: [0.4, 1.4]})


def test_observed_state_is_the_stale_baseline():
    out = ObservedState().predict(OBSERVED, PLAN, now=10, start_tick=13)
    np.testing.assert_array_equal(out, OBSERVED)
    assert out is not OBSERVED  # a copy: the caller may mutate it


def test_absolute_takes_the_last_command_before_the_new_chunk():
    p = AbsoluteActionPredictor()
    np.testing.assert_allclose(p.predict(OBSERVED, PLAN, now=10, start_tick=13), [0.3, 1.3])
    np.testing.assert_allclose(p.predict(OBSERVED, PLAN, now=10, start_tick=11), [0.1, 1.1])
    # Nothing executes before the chunk starts: the observed state is already right.
    np.testing.assert_allclose(p.predict(OBSERVED, PLAN, now=10, start_tick=10), OBSERVED)
    # The plan runs out before the new chunk (the controller will hold): fall back.
    np.testing.assert_allclose(p.predict(OBSERVED, PLAN, now=12, start_tick=20), OBSERVED)
    np.testing.assert_allclose(p.predict(OBSERVED, _Plan({}), now=0, start_tick=5), OBSERVED)


def test_absolute_ignores_padding_dims_and_never_trusts_non_finite_actions():
    p = AbsoluteActionPredictor()
    padded = _Plan({4: [0.5, 0.6, 9.0, 9.0]})
    np.testing.assert_allclose(p.predict(OBSERVED, padded, now=3, start_tick=5), [0.5, 0.6])
    bad = _Plan({4: [np.nan, 0.6]})
    np.testing.assert_allclose(p.predict(OBSERVED, bad, now=3, start_tick=5), OBSERVED)
    with pytest.raises(ValueError, match="cannot be read"):
        p.predict(OBSERVED, _Plan({4: [0.5]}), now=3, start_tick=5)


def test_delta_rolls_the_observed_state_forward():
    p = DeltaActionPredictor()
    deltas = _Plan({10: [0.1, -0.1], 11: [0.1, -0.1], 12: [0.05, 0.0], 14: [1.0, 1.0]})
    # Ticks 10, 11, 12 execute before a chunk starting at 13; tick 14 is after it.
    np.testing.assert_allclose(p.predict(OBSERVED, deltas, now=10, start_tick=13), [0.25, 0.8])
    # Unplanned tick 13 adds nothing (hold); 14 is still before a chunk at 15.
    np.testing.assert_allclose(p.predict(OBSERVED, deltas, now=12, start_tick=15), [1.05, 2.0])
    np.testing.assert_allclose(p.predict(OBSERVED, deltas, now=10, start_tick=10), OBSERVED)


def test_validation_and_factory():
    for name, cls in (("observed", ObservedState), ("absolute", AbsoluteActionPredictor),
                      ("delta", DeltaActionPredictor)):
        assert isinstance(make_predictor(name), cls)
    with pytest.raises(ValueError, match="unknown state predictor"):
        make_predictor("kalman")
    with pytest.raises(ValueError, match="before now"):
        AbsoluteActionPredictor().predict(OBSERVED, PLAN, now=10, start_tick=9)
    with pytest.raises(ValueError, match="NaN"):
        ObservedState().predict(np.array([np.nan, 0.0]), PLAN, now=0, start_tick=1)
    with pytest.raises(ValueError, match="vector"):
        ObservedState().predict(np.zeros((2, 2)), PLAN, now=0, start_tick=1)
