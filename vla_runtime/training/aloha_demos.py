"""Scripted transfer-cube demonstrations on gym-aloha, recorded as an ALOHA records them.

The expert is ``sim.aloha_expert.TransferCubeExpert`` (joint targets from task-space waypoints
through inverse kinematics). Each bag is in the robot profile's own layout (``config/aloha.yaml``
by default), so ``replay``, ``build-cache --robot-profile`` and a real ALOHA's recordings read
alike:

* one frame per policy call (every ``call_every`` 50 Hz steps): the profile's cameras on their
  topics (rendered only then), the 14 joint positions split over the profile's joint-state topics
  by arm (``arm_slices``) under the profile's joint names, and the instruction;
* the commanded 14 joint targets at **every** step on ``/action_command`` (the chunk after any
  frame is cut from it by time), ``tail_steps`` more after the success;
* the outcome. Only successful episodes are kept; failed seeds are listed in ``demos.json``.

With ``--policy CHECKPOINT`` it records a DAgger round instead: the policy drives through the
profile's safety filter, as on the robot (the expert takes over a call with probability
``--beta``), the expert's targets for the states actually reached are recorded at every step,
and every episode is kept (``"labels": "dagger"``), failures included.

    python -m vla_runtime.training.aloha_demos --out /tmp/aloha/demos --episodes 50
    python -m vla_runtime.training.aloha_demos --out /tmp/aloha/dagger1 --episodes 40 --seed-base 5000 \
        --policy checkpoints/pi05-aloha-transfer-cube --beta 0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.safety import SafetyFilter
from ..io.bags import BagTopics, profile_topics, write_episode_bag
from ..nodes.profile import RobotProfile, load_profile
from ..sim.aloha_env import CONTROL_DT, DEFAULT_CAMERAS, DEFAULT_PROFILE, AlohaSimConfig, AlohaTask, check_profile
from ..sim.aloha_expert import TransferCubeExpert
from .recording import (ACTION_TOPIC, MANIFEST, CommandFilter, Driver, Rollout, check_driver_settings, labels_kind,
                        pipeline_driver, record_rollout)


@dataclass(frozen=True)
class AlohaDemoConfig:
    """What to record: ``episodes`` successful episodes from seeds ``seed_base + i`` (with a
    ``policy``: ``episodes`` DAgger episodes, whatever their outcome)."""

    episodes: int = 50
    profile: str = str(DEFAULT_PROFILE)
    image_size: int = 64
    call_every: int = 10               # 50 Hz steps between frames (policy calls): 5 Hz
    tail_steps: int = 20               # expert steps recorded after the success (actions only)
    max_steps: int = 400               # gym-aloha's episode length (8 s)
    seed_base: int = 0
    max_tries_factor: int = 2          # seeds tried per wanted episode before giving up
    policy: str | None = None          # DAgger: this checkpoint drives, the expert labels
    beta: float = 0.3                  # DAgger: probability that the expert drives a call instead
    threads: int = 1                   # DAgger: torch threads of the policy

    def validate(self) -> "AlohaDemoConfig":
        if self.episodes < 1 or self.call_every < 1 or self.tail_steps < 0 or self.max_tries_factor < 1:
            raise ValueError("episodes, call_every, max_tries_factor >= 1 and tail_steps >= 0")
        check_driver_settings(self.policy, self.beta)
        if self.image_size < 8 or self.max_steps < 1:
            raise ValueError("image_size >= 8 and max_steps >= 1")
        check_profile(load_profile(self.profile), dict(DEFAULT_CAMERAS))
        return self


def joint_layout(profile: RobotProfile) -> dict[str, list[str]]:
    """Which of the profile's joints each of its joint-state topics carries: one topic per arm
    when there is a topic per ``arm_slices`` entry (ALOHA's two followers), else one topic."""
    topics, names = profile.joint_states_topics, list(profile.joint_names)
    if len(topics) == 1:
        return {topics[0]: names}
    if len(topics) != len(profile.arm_slices):
        raise ValueError(f"profile {profile.name!r}: {len(topics)} joint-state topics but "
                         f"{len(profile.arm_slices)} arm_slices; cannot tell which joints each carries")
    return {t: names[a:b] for t, (a, b) in zip(topics, profile.arm_slices)}


def safety_command(env: AlohaTask, profile: RobotProfile) -> CommandFilter:
    """The profile's safety filter (limits, speed) on every executed command, as the policy node
    applies it; restarted from the robot's state at each episode's first step."""
    safety = SafetyFilter(profile.joint_limits(), CONTROL_DT)

    def command(action: np.ndarray, step: int) -> np.ndarray:
        if step == 0:
            safety.set_initial(env.state())
        return safety.filter(action, step).action

    return command


def record_transfer_cube(env: AlohaTask, seed: int, call_every: int, tail_steps: int, driver: Driver | None = None,
                         beta: float = 0.0, command: CommandFilter | None = None) -> Rollout:
    """One expert episode from ``seed``'s cube position (``training.recording.record_rollout``); with
    ``driver`` (DAgger) the policy acts, through ``command``, except on calls the expert takes over."""
    expert = TransferCubeExpert(env)

    def start() -> Callable[[], np.ndarray]:
        expert.reset()
        return expert.action

    source = f"sim:gym-aloha:transfer_cube:seed={seed}:" + ("scripted" if driver is None else f"dagger:beta={beta}")
    return record_rollout(env, seed, start, call_every=call_every, tail_steps=tail_steps, dt=CONTROL_DT,
                          action_names=[f"target_{i}" for i in range(14)], episode_id=f"transfer_cube_s{seed}",
                          source=source, driver=driver, beta=beta, command=command)


def record_aloha_demos(cfg: AlohaDemoConfig, out: str | Path, log: Callable[[str], None] = print) -> dict:
    """Record ``cfg.episodes`` successful episodes (or DAgger episodes) into ``out/transfer_cube/``;
    writes ``demos.json``."""
    cfg = cfg.validate()
    out = Path(out)
    (out / "transfer_cube").mkdir(parents=True, exist_ok=True)
    profile = load_profile(cfg.profile)
    topics: BagTopics = profile_topics(profile, outcome="/episode_outcome")
    layout = joint_layout(profile)
    driven = cfg.policy is not None
    saved, failed, frames, t0 = 0, [], 0, time.time()
    with AlohaTask(AlohaSimConfig(image_size=cfg.image_size, max_steps=cfg.max_steps)) as env:
        driver, close_driver = ((None, lambda: None) if not driven else
                                pipeline_driver(cfg.policy, [c.name for c in profile.cameras], threads=cfg.threads,
                                                seed=cfg.seed_base, arm_slices=tuple(tuple(s) for s in profile.arm_slices),
                                                state_dim=len(profile.joint_names)))
        command = safety_command(env, profile) if driven else None
        try:
            for i in range(cfg.episodes if driven else cfg.episodes * cfg.max_tries_factor):
                if saved >= cfg.episodes:
                    break
                seed = cfg.seed_base + i
                roll = record_transfer_cube(env, seed, cfg.call_every, cfg.tail_steps, driver, cfg.beta, command)
                if not roll.episode.success:
                    failed.append(seed)
                    if not driven:
                        continue
                write_episode_bag(out / "transfer_cube" / roll.episode.episode_id, roll.episode, topics,
                                  joint_layout=layout, series={ACTION_TOPIC: roll.actions})
                saved += 1
                frames += len(roll.episode.frames)
                if saved % 10 == 0 or saved == cfg.episodes:
                    log(f"transfer_cube: {saved}/{cfg.episodes} episodes ({len(failed)} failed), {time.time() - t0:.0f}s")
        finally:
            close_driver()
    manifest = {"labels": labels_kind(driven), "config": asdict(cfg), "profile": profile.name,
                "topics": {"cameras": topics.cameras, "joint_states": layout, "instruction": topics.instruction,
                           "outcome": topics.outcome, "actions": ACTION_TOPIC},
                "state_names": list(profile.joint_names), "env_dt": CONTROL_DT,
                "call_period": cfg.call_every * CONTROL_DT, "saved": saved, "failed_seeds": failed,
                "frames": frames, "seconds": round(time.time() - t0, 1)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    kept = " (kept: expert labels)" if driven else ""
    log(f"{saved} episodes ({frames} frames), {len(failed)} failed seeds{kept}, written to {out} in {manifest['seconds']}s")
    if saved < cfg.episodes:
        raise RuntimeError(f"only {saved} of {cfg.episodes} episodes succeeded in {cfg.episodes * cfg.max_tries_factor} "
                           f"tries (failed seeds: {failed[:20]})")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aloha_demos", description=__doc__.split("\n")[0])
    d = AlohaDemoConfig()
    p.add_argument("--out", required=True)
    p.add_argument("--episodes", type=int, default=d.episodes, help="successful episodes to record")
    p.add_argument("--profile", default=d.profile, help="robot profile whose topics and joint names the bags use")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--call-every", type=int, default=d.call_every, help="50 Hz steps between frames")
    p.add_argument("--tail-steps", type=int, default=d.tail_steps)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--seed-base", type=int, default=d.seed_base)
    p.add_argument("--policy", default=None, help="DAgger: a checkpoint that drives while the expert labels "
                                                   "every step (failed episodes are kept)")
    p.add_argument("--beta", type=float, default=d.beta, help="DAgger: probability that the expert drives a call")
    p.add_argument("--threads", type=int, default=d.threads, help="DAgger: torch threads of the policy")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = AlohaDemoConfig(episodes=a.episodes, profile=a.profile, image_size=a.image_size, call_every=a.call_every,
                          tail_steps=a.tail_steps, max_steps=a.max_steps, seed_base=a.seed_base,
                          policy=a.policy, beta=a.beta, threads=a.threads)
    try:
        record_aloha_demos(cfg, a.out)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"aloha_demos: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
