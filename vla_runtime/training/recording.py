"""One simulated episode recorded the way a robot records it, for any simulator and expert.

A frame (every camera, the robot state) at each policy call point, every ``call_every`` control
steps, and the expert's action at *every* step: the training tool cuts the chunk after any frame
out of that series by its time stamps. After a success the expert goes on for ``tail_steps``
steps (actions only) so the last frames have a full chunk too.

With a ``driver`` (DAgger) a policy acts instead, except on the calls the expert takes over
(probability ``beta``, or when the policy's chunk is not finite); the expert still labels every
step, for the state the robot is actually in. Every executed command passes ``command`` first
(the action box, or a robot profile's safety filter), so a driven episode visits the states the
policy would reach on the robot.

The simulators (``sim.metaworld_env.MetaWorldTask``, ``sim.aloha_env.AlohaTask``) share what this
needs: ``reset(seed) -> state``, ``render() -> {camera: image}``, ``step(action)`` with ``state``,
``success`` and ``done``, and ``instruction``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from ..io.bags import Episode, EpisodeFrame, JointSeries

ACTION_TOPIC = "/action_command"   # the commanded action at every control step (a JointState series)
MANIFEST = "demos.json"            # what a recording directory holds: labels, topics, seeds, timings

#: The expert's action for the robot's current state (called once per control step).
Label = Callable[[], np.ndarray]
#: A DAgger driver: (images, state, instruction) -> a chunk of actions [chunk, >= action_dim].
Driver = Callable[[dict[str, np.ndarray], np.ndarray, str], np.ndarray]
#: What the robot executes for a commanded action at a control step: (action, step) -> action.
CommandFilter = Callable[[np.ndarray, int], np.ndarray]


def labels_kind(driven: bool) -> str:
    """A manifest's ``labels``: "expert" (the expert acted, successes only) or "dagger" (a policy
    acted, the expert labelled every step, failures kept: they are the states a policy reaches)."""
    return "dagger" if driven else "expert"


def keeps_failed_episodes(bag: Path, root: Path) -> bool:
    """Whether the nearest ``demos.json`` between ``bag`` and ``root`` marks DAgger labels."""
    for d in [bag.parent, *bag.parent.parents]:
        if (d / MANIFEST).is_file():
            return json.loads((d / MANIFEST).read_text()).get("labels") == labels_kind(True)
        if d == root:
            break
    return False


def check_driver_settings(policy: str | None, beta: float) -> None:
    """The DAgger settings both demo recorders take: ``beta`` a probability, ``policy`` (when
    given) a checkpoint directory that exists, checked before any episode is simulated."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if policy is not None and not Path(policy).is_dir():
        raise FileNotFoundError(f"--policy {policy}: no checkpoint directory there")


def pipeline_driver(checkpoint: str | Path, cameras: Sequence[str], *, threads: int, seed: int,
                    arm_slices: tuple[tuple[int, int], ...] = (), state_dim: int | None = None,
                    ) -> tuple[Driver, Callable[[], None]]:
    """A checkpoint as a DAgger driver (dense, the runtime's own pipeline in this process), and
    how to close it."""
    from ..nodes.pipeline import PipelineSpec, make_pipeline
    from ..nodes.profile import CacheSpec, EngineSpec
    from ..nodes.stages import RingNames

    spec = PipelineSpec(Path(checkpoint), tuple(cameras), CacheSpec(enabled=False), EngineSpec(threads=threads),
                        RingNames.tagged(f"dagger{os.getpid()}"), seed=seed, arm_slices=arm_slices,
                        state_dim=state_dim)
    pipeline = make_pipeline(spec, 1)

    def drive(images: dict[str, np.ndarray], state: np.ndarray, instruction: str) -> np.ndarray:
        return np.asarray(pipeline.call(images, state, instruction).chunk)

    pipeline.start_episode()
    return drive, pipeline.close


class SimTask(Protocol):
    instruction: str

    def reset(self, seed: int) -> np.ndarray: ...
    def render(self) -> dict[str, np.ndarray]: ...
    def step(self, action: np.ndarray): ...


@dataclass
class Rollout:
    """One episode in memory: frames at call points, actions at every step."""

    episode: Episode
    actions: JointSeries
    steps: int


def record_rollout(env: SimTask, seed: int, expert: Callable[[], Label], *, call_every: int, tail_steps: int,
                   dt: float, action_names: Sequence[str], episode_id: str, source: str,
                   driver: Driver | None = None, beta: float = 0.0,
                   command: CommandFilter | None = None) -> Rollout:
    """Run one episode from ``seed``. ``expert()`` is called once the environment is reset and
    returns the labelling function. ``command``: applied to every executed action (None: as is)."""
    rng = np.random.default_rng(seed)
    state = env.reset(seed)
    label = expert()
    dim = len(action_names)
    frames: list[EpisodeFrame] = []
    times: list[float] = []
    actions: list[np.ndarray] = []
    plan: np.ndarray | None = None
    success, step = False, 0
    while True:
        if step % call_every == 0:
            images = env.render()
            frames.append(EpisodeFrame(t=step * dt, images=images, state=state))
            plan = None
            if driver is not None and rng.random() >= beta:
                chunk = np.asarray(driver(images, state, env.instruction), np.float64)[:call_every, :dim]
                plan = chunk if np.isfinite(chunk).all() else None
        action = np.asarray(label(), np.float64)
        times.append(step * dt)
        actions.append(action)
        executed = action if plan is None or step % call_every >= len(plan) else plan[step % call_every]
        result = env.step(executed if command is None else command(executed, step))
        state, step = result.state, step + 1
        if result.done:
            success = result.success
            break
    for _ in range(tail_steps if success else 0):
        action = np.asarray(label(), np.float64)
        times.append(step * dt)
        actions.append(action)
        env.step(action)
        step += 1
    episode = Episode(episode_id=episode_id, task=env.instruction, success=success, frames=frames, source=source)
    return Rollout(episode, JointSeries(np.asarray(times), np.stack(actions), tuple(action_names)), step)
