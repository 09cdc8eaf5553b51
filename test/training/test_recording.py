"""The shared recording loop: who acts (expert or driver), what is labelled, what is executed,
and which recordings keep their failed episodes."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from vla_runtime.training.recording import check_driver_settings, keeps_failed_episodes, labels_kind, record_rollout


@dataclass
class _Step:
    state: np.ndarray
    success: bool
    done: bool


class PointTask:
    """A 2-dim point that moves to the commanded action; done at ``max_steps``, success when at
    the goal (1, 1)."""

    instruction = "go to the goal"

    def __init__(self, max_steps: int = 12):
        self.max_steps, self.executed = max_steps, []

    def reset(self, seed: int) -> np.ndarray:
        self.x, self.steps, self.executed = np.zeros(2), 0, []
        return self.x.copy()

    def render(self) -> dict[str, np.ndarray]:
        return {"cam": np.zeros((4, 4, 3), np.uint8)}

    def step(self, action: np.ndarray) -> _Step:
        self.executed.append(np.array(action))
        self.x, self.steps = np.array(action, np.float64), self.steps + 1
        ok = bool(np.allclose(self.x, 1.0))
        return _Step(self.x.copy(), ok, ok or self.steps >= self.max_steps)


def _expert(env: PointTask):
    """Heads for (1, 1) in steps of 0.25 from wherever the point is."""
    return lambda: lambda: np.minimum(env.x + 0.25, 1.0)


def _record(env, **kw):
    return record_rollout(env, 0, _expert(env), call_every=3, tail_steps=2, dt=0.1, action_names=["x", "y"],
                          episode_id="e", source="test", **kw)


def test_the_expert_acts_and_labels_without_a_driver():
    env = PointTask()
    roll = _record(env)
    assert roll.episode.success and roll.steps == 4 + 2                 # 4 steps to the goal, 2 tail steps
    assert len(roll.episode.frames) == 2                                # frames at steps 0 and 3
    np.testing.assert_allclose(roll.actions.values[:4, 0], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(roll.actions.t, np.arange(6) * 0.1)


def test_a_driver_acts_through_the_command_filter_while_the_expert_labels():
    """The driver asks for 5.0 every step; the filter caps commands at 0.3; the expert's labels
    are for the states the capped commands led to."""
    env = PointTask(max_steps=6)
    seen = []

    def driver(images, state, instruction):
        seen.append(state.copy())
        return np.full((4, 2), 5.0)

    roll = _record(env, driver=driver, beta=0.0, command=lambda a, step: np.minimum(a, 0.3))
    assert not roll.episode.success and roll.steps == 6 and len(seen) == 2
    np.testing.assert_allclose(np.stack(env.executed), 0.3)            # executed: the driver's, filtered
    np.testing.assert_allclose(roll.actions.values[0], [0.25, 0.25])    # labels: the expert's from 0
    np.testing.assert_allclose(roll.actions.values[1:], 0.55)           # ... and from 0.3 afterwards
    np.testing.assert_allclose(seen[1], [0.3, 0.3])


def test_the_expert_takes_over_calls_at_beta_one_and_a_non_finite_chunk():
    for beta, chunk in ((1.0, np.zeros((3, 2))), (0.0, np.full((3, 2), np.nan))):
        env = PointTask()
        roll = _record(env, driver=lambda *_: chunk, beta=beta)
        assert roll.episode.success and roll.steps == 6                 # as if no driver


def test_dagger_manifest_keeps_failed_episodes(tmp_path):
    (tmp_path / "expert" / "t" / "ep").mkdir(parents=True)
    (tmp_path / "dagger" / "t" / "ep").mkdir(parents=True)
    (tmp_path / "expert" / "demos.json").write_text(json.dumps({"labels": labels_kind(False)}))
    (tmp_path / "dagger" / "demos.json").write_text(json.dumps({"labels": labels_kind(True)}))
    assert not keeps_failed_episodes(tmp_path / "expert" / "t" / "ep", tmp_path)
    assert keeps_failed_episodes(tmp_path / "dagger" / "t" / "ep", tmp_path)
    assert not keeps_failed_episodes(tmp_path / "elsewhere" / "ep", tmp_path)     # no manifest: successes only


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_driver_settings_accept_a_probability_and_an_existing_checkpoint(beta, tmp_path):
    check_driver_settings(None, beta)
    check_driver_settings(str(tmp_path), beta)


@pytest.mark.parametrize("beta", [-0.01, 1.01, float("nan")])
def test_driver_settings_refuse_a_beta_outside_0_1(beta):
    with pytest.raises(ValueError, match=f"beta must be in \\[0, 1\\], got {beta}"):
        check_driver_settings(None, beta)


def test_driver_settings_refuse_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--policy {tmp_path / 'none'}: no checkpoint directory there"):
        check_driver_settings(str(tmp_path / "none"), 0.5)
