"""Scripted-expert demonstrations on Meta-World, recorded as rosbag2 episodes.

Why bags: a policy trained here must be trained on the same format a real robot records, so
the training tool, ``build-cache`` and replay read sim and robot data alike. Each episode bag has

* one frame per policy call (every ``call_every`` env steps): both camera images (rendered only
  then: rendering dominates the cost on a CPU), the robot state (hand xyz, gripper opening) on
  ``/joint_states`` and the instruction;
* the commanded action at **every** env step on ``/action_command`` (a ``JointState`` series,
  positions = Meta-World's 4-dim action), so the chunk of actions after any call is recovered
  from the log times (``Episode`` itself holds no actions);
* the outcome (``success``): only successful episodes are kept. After success the expert runs
  ``tail_steps`` more steps (actions only), so the last calls have a full action chunk too.

Run: ``python -m vla_runtime.tools.metaworld_demos --out /tmp/mw/demos --episodes 40``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..io.bags import BagTopics, Episode, EpisodeFrame, JointSeries, write_episode_bag
from ..sim.metaworld_env import (ACTION_NAMES, CONTROL_DT, DEFAULT_CAMERAS, DEFAULT_TASKS, STATE_NAMES,
                                 MetaWorldConfig, MetaWorldTask, scripted_expert)

ACTION_TOPIC = "/action_command"
MANIFEST = "demos.json"


@dataclass(frozen=True)
class DemoConfig:
    """What to record. Seeds ``seed_base + i`` (i < episodes * max_tries_factor) per task."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    episodes: int = 40                 # successful episodes per task
    cameras: tuple[str, ...] = DEFAULT_CAMERAS
    image_size: int = 64
    call_every: int = 4                # env steps between policy calls (frames)
    tail_steps: int = 16               # expert steps recorded after success (actions only)
    max_steps: int = 300
    pose_band: tuple[float, float] = (0.0, 1.0)
    seed_base: int = 0
    workers: int = 2
    max_tries_factor: int = 3

    def validate(self) -> "DemoConfig":
        if self.episodes < 1 or self.call_every < 1 or self.tail_steps < 0 or self.workers < 1:
            raise ValueError("episodes, call_every, workers >= 1 and tail_steps >= 0")
        for task in self.tasks:
            self.harness(task)
        return self

    def harness(self, task: str) -> MetaWorldConfig:
        return MetaWorldConfig(task=task, cameras=self.cameras, image_size=self.image_size,
                               max_steps=self.max_steps, pose_band=self.pose_band).validate()


def bag_topics(cameras: tuple[str, ...]) -> BagTopics:
    """Topic names of the Meta-World bags (a Sawyer with fixed cameras)."""
    return BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in cameras}, joint_states="/joint_states",
                     instruction="/instruction", outcome="/episode_outcome", joint_names=STATE_NAMES)


@dataclass
class Rollout:
    """One expert episode in memory: frames at call points, actions at every step."""

    episode: Episode
    actions: JointSeries
    steps: int


def record_episode(env: MetaWorldTask, seed: int, call_every: int, tail_steps: int) -> Rollout:
    """Run the scripted expert from ``seed``'s pose; frames every ``call_every`` steps."""
    expert = scripted_expert(env.cfg.task)
    dt = CONTROL_DT
    state = env.reset(seed)
    frames: list[EpisodeFrame] = []
    times: list[float] = []
    actions: list[np.ndarray] = []
    success, step = False, 0
    while True:
        if step % call_every == 0:
            frames.append(EpisodeFrame(t=(step // call_every) * call_every * dt, images=env.render(), state=state))
        action = np.clip(np.asarray(expert.get_action(env.full_observation), np.float64), -1.0, 1.0)
        times.append(step * dt)
        actions.append(action)
        result = env.step(action)
        state, step = result.state, step + 1
        if result.done:
            success = result.success
            break
    for _ in range(tail_steps if success else 0):   # actions after success: complete chunks
        action = np.clip(np.asarray(expert.get_action(env.full_observation), np.float64), -1.0, 1.0)
        times.append(step * dt)
        actions.append(action)
        env.step(action)
        step += 1
    ep = Episode(episode_id=f"{env.cfg.task}_s{seed}", task=env.instruction, success=success, frames=frames,
                 source=f"sim:metaworld:{env.cfg.task}:seed={seed}")
    return Rollout(ep, JointSeries(np.asarray(times), np.stack(actions), ACTION_NAMES), step)


@dataclass
class TaskReport:
    task: str
    saved: int = 0
    failed_seeds: list[int] = field(default_factory=list)
    frames: int = 0
    steps: int = 0
    seconds: float = 0.0


def record_task(cfg: DemoConfig, task: str, out: Path, log_prefix: str = "") -> TaskReport:
    """Record ``cfg.episodes`` successful expert episodes of one task into ``out/<task>/``."""
    env = MetaWorldTask(cfg.harness(task))
    topics = bag_topics(cfg.cameras)
    report = TaskReport(task)
    t0 = time.time()
    try:
        for i in range(cfg.episodes * cfg.max_tries_factor):
            if report.saved >= cfg.episodes:
                break
            seed = cfg.seed_base + i
            roll = record_episode(env, seed, cfg.call_every, cfg.tail_steps)
            if not roll.episode.success:
                report.failed_seeds.append(seed)
                continue
            path = out / task / roll.episode.episode_id
            path.parent.mkdir(parents=True, exist_ok=True)
            write_episode_bag(path, roll.episode, topics, series={ACTION_TOPIC: roll.actions})
            report.saved += 1
            report.frames += len(roll.episode.frames)
            report.steps += roll.steps
            if report.saved % 10 == 0:
                print(f"{log_prefix}{task}: {report.saved}/{cfg.episodes} episodes, "
                      f"{time.time() - t0:.0f}s", flush=True)
    finally:
        env.close()
    report.seconds = time.time() - t0
    return report


def _worker(args: tuple[DemoConfig, str, str]) -> dict:
    cfg, task, out = args
    return asdict(record_task(cfg, task, Path(out)))


def record_demos(cfg: DemoConfig, out: str | Path, log=print) -> dict:
    """Record every task (tasks spread over ``cfg.workers`` processes); writes ``demos.json``."""
    cfg = cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    jobs = [(cfg, task, str(out)) for task in cfg.tasks]
    if cfg.workers == 1:
        reports = [_worker(j) for j in jobs]
    else:
        # spawn: each worker opens its own EGL context (a forked GL context is not usable).
        with mp.get_context("spawn").Pool(min(cfg.workers, len(jobs))) as pool:
            reports = pool.map(_worker, jobs, chunksize=1)
    manifest = {
        "config": asdict(cfg), "topics": {"cameras": bag_topics(cfg.cameras).cameras, "joint_states": "/joint_states",
                                          "instruction": "/instruction", "outcome": "/episode_outcome",
                                          "actions": ACTION_TOPIC},
        "state_names": list(STATE_NAMES), "action_names": list(ACTION_NAMES),
        "env_dt": CONTROL_DT, "call_period": cfg.call_every * CONTROL_DT,
        "reports": reports, "seconds": round(time.time() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for r in reports:
        log(f"{r['task']}: {r['saved']} episodes ({r['frames']} frames, {r['steps']} steps), "
            f"{len(r['failed_seeds'])} failed seeds, {r['seconds']:.0f}s")
    log(f"demos written to {out} in {manifest['seconds']}s")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metaworld_demos", description=__doc__.split("\n")[0])
    d = DemoConfig()
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default=",".join(d.tasks), help="comma-separated Meta-World v3 task names")
    p.add_argument("--episodes", type=int, default=d.episodes, help="successful episodes per task")
    p.add_argument("--cameras", default=",".join(d.cameras))
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--call-every", type=int, default=d.call_every)
    p.add_argument("--tail-steps", type=int, default=d.tail_steps)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--pose-band", default="0,1", help="inner,outer normalised band of object poses")
    p.add_argument("--seed-base", type=int, default=d.seed_base)
    p.add_argument("--workers", type=int, default=d.workers)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    band = tuple(float(x) for x in a.pose_band.split(","))
    cfg = DemoConfig(tasks=tuple(a.tasks.split(",")), episodes=a.episodes, cameras=tuple(a.cameras.split(",")),
                     image_size=a.image_size, call_every=a.call_every, tail_steps=a.tail_steps,
                     max_steps=a.max_steps, pose_band=(band[0], band[1]), seed_base=a.seed_base, workers=a.workers)
    record_demos(cfg, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
