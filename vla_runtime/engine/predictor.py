"""Future-state prediction: which robot state the next policy call is conditioned on.

When inference overlaps execution, a call started at tick ``now`` produces a chunk whose first
action runs at ``start_tick`` (later, by the expected latency). Conditioning that chunk on the
state observed at ``now`` describes a robot that will have moved on by then, so the chunk's
first actions would pull it back (a visible jerk at every boundary). The state the chunk
should start from is the one the robot is expected to be in at ``start_tick``, and the plan
already says what the controller commands until then.

pi0.5 writes the state into its text prompt, and the prefix attends bidirectionally, so the
choice has to be made *before* the prefix is built: the predictor runs when a call is started,
not when its chunk is merged.

Predictors are pluggable (``StatePredictor``) and stateless, so one instance can be shared and
the baseline (``ObservedState``) is a drop-in replacement for A/B measurements.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class PlannedActions(Protocol):
    """The part of :class:`vla_runtime.engine.stitching.ActionPlan` a predictor reads."""

    def action_at(self, tick: int) -> np.ndarray | None: ...


class StatePredictor(Protocol):
    """Maps the observed state and the current plan to the state expected at ``start_tick``."""

    def predict(self, observed_state: np.ndarray, plan: PlannedActions, now: int, start_tick: int) -> np.ndarray: ...


def _check(observed_state: np.ndarray, now: int, start_tick: int) -> np.ndarray:
    state = np.asarray(observed_state, dtype=np.float64)
    if state.ndim != 1:
        raise ValueError(f"observed_state must be a vector, got shape {state.shape}")
    if not np.isfinite(state).all():
        raise ValueError("observed_state contains NaN or Inf")
    if start_tick < now:
        raise ValueError(f"start_tick {start_tick} lies before now {now}: a chunk cannot start in the past")
    return state


def _as_action(action: np.ndarray, state: np.ndarray) -> np.ndarray | None:
    """A planned action usable as a state, or ``None`` (a non-finite action is never trusted)."""
    a = np.asarray(action, dtype=np.float64)
    if a.shape[-1] < state.shape[0]:
        raise ValueError(f"planned actions have {a.shape[-1]} values, the state {state.shape[0]}: "
                         "a future state cannot be read from them")
    a = a[: state.shape[0]]
    return a if np.isfinite(a).all() else None


class ObservedState:
    """The baseline (what synchronous systems do): the state as observed, however stale."""

    def predict(self, observed_state: np.ndarray, plan: PlannedActions, now: int, start_tick: int) -> np.ndarray:
        return _check(observed_state, now, start_tick).copy()


class AbsoluteActionPredictor:
    """Absolute position actions: the robot is headed for whatever the controller commands
    last before the new chunk takes over, i.e. the planned action at ``start_tick - 1``.

    When nothing is planned there (no plan yet, or the plan runs out before the new chunk
    starts, so the controller will be holding), the observed state is the best guess.
    Action dimensions beyond the state (e.g. padding) are ignored.
    """

    def predict(self, observed_state: np.ndarray, plan: PlannedActions, now: int, start_tick: int) -> np.ndarray:
        state = _check(observed_state, now, start_tick)
        if start_tick <= now:  # nothing executes between observation and the new chunk
            return state.copy()
        action = plan.action_at(start_tick - 1)
        if action is None:
            return state.copy()
        target = _as_action(action, state)
        return state.copy() if target is None else target


class DeltaActionPredictor:
    """Delta actions: roll the observed state forward by every planned delta that executes
    before the new chunk starts (ticks ``now .. start_tick - 1``); unplanned ticks add nothing
    (the controller holds)."""

    def predict(self, observed_state: np.ndarray, plan: PlannedActions, now: int, start_tick: int) -> np.ndarray:
        state = _check(observed_state, now, start_tick)
        out = state.copy()
        for tick in range(now, start_tick):
            action = plan.action_at(tick)
            if action is None:
                continue
            delta = _as_action(action, state)
            if delta is not None:
                out += delta
        return out


_PREDICTORS: dict[str, Callable[[], StatePredictor]] = {
    "observed": ObservedState,
    "absolute": AbsoluteActionPredictor,
    "delta": DeltaActionPredictor,
}


def make_predictor(name: str) -> StatePredictor:
    """``"observed"`` (baseline), ``"absolute"`` or ``"delta"``."""
    try:
        return _PREDICTORS[name]()
    except KeyError:
        raise ValueError(f"unknown state predictor {name!r}; choose from {sorted(_PREDICTORS)}") from None


PREDICTORS = tuple(_PREDICTORS)
