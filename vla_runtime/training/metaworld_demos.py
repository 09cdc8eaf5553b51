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

With ``--policy CHECKPOINT`` it records DAgger episodes instead: a trained policy drives (the
expert takes over a call with probability ``--beta``), and the expert's action for the state the
robot is actually in is recorded at every step. Those labels are right whatever the outcome, so
every episode is kept, failed ones included (the directory's ``demos.json`` says
``"labels": "dagger"``, which tells the training tool to keep them): they are the states a policy
drifts into and the way back from them, which expert runs never show.

With ``--format lerobot`` the recorded demonstrations are also exported as a LeRobot v3.0 dataset
in ``<out>/lerobot`` (:func:`export_lerobot`): one dataset frame per recorded policy call (fps =
1 / (call_every * env dt), 20 by default), both cameras as H.264 video under
``observation.images.<camera>``, the state as ``observation.state`` and, as ``action``, the
command the expert issued at that frame's step, so LeRobot tooling and ``build-cache --dataset``
read the same demonstrations.

Run: ``python -m vla_runtime.training.metaworld_demos --out /tmp/mw/demos --episodes 40``;
DAgger: ``... --out /tmp/mw/demos/dagger1 --policy /tmp/mw/checkpoint --episodes 30 --seed-base 20000``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..io.bags import write_episode_bag
from ..sim.metaworld_env import (ACTION_NAMES, CONTROL_DT, DEFAULT_CAMERAS, DEFAULT_TASKS, STATE_NAMES,
                                 MetaWorldConfig, MetaWorldTask, bag_topics, scripted_expert)
from .recording import (ACTION_TOPIC, MANIFEST, Driver, Rollout, check_driver_settings, labels_kind, pipeline_driver,
                        record_rollout)


FORMATS = ("rosbag2", "lerobot")
LEROBOT_DIR = "lerobot"


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
    policy: str | None = None          # DAgger: this checkpoint drives, the expert labels
    beta: float = 0.3                  # DAgger: probability that the expert drives a call instead
    threads: int = 1                   # DAgger: torch threads of each worker's policy
    format: str = "rosbag2"            # "lerobot": also export <out>/lerobot as a LeRobot v3.0 dataset

    def validate(self) -> "DemoConfig":
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.episodes < 1 or self.call_every < 1 or self.tail_steps < 0 or self.workers < 1:
            raise ValueError("episodes, call_every, workers >= 1 and tail_steps >= 0")
        check_driver_settings(self.policy, self.beta)
        for task in self.tasks:
            self.harness(task)
        return self

    def harness(self, task: str) -> MetaWorldConfig:
        return MetaWorldConfig(task=task, cameras=self.cameras, image_size=self.image_size,
                               max_steps=self.max_steps, pose_band=self.pose_band).validate()


def record_episode(env: MetaWorldTask, seed: int, call_every: int, tail_steps: int,
                   driver: Driver | None = None, beta: float = 0.0) -> Rollout:
    """One episode from ``seed``'s pose, frames every ``call_every`` steps, Meta-World's scripted
    expert's action (clipped to the action box) recorded at every step; with ``driver`` (DAgger)
    the policy acts except on calls the expert takes over (``training.recording.record_rollout``)."""
    def expert() -> Callable[[], np.ndarray]:
        policy = scripted_expert(env.cfg.task)
        return lambda: np.clip(np.asarray(policy.get_action(env.full_observation), np.float64), -1.0, 1.0)

    source = f"sim:metaworld:{env.cfg.task}:seed={seed}" + (f":dagger:beta={beta}" if driver is not None else "")
    return record_rollout(env, seed, expert, call_every=call_every, tail_steps=tail_steps, dt=CONTROL_DT,
                          action_names=ACTION_NAMES, episode_id=f"{env.cfg.task}_s{seed}", source=source,
                          driver=driver, beta=beta, command=lambda a, _step: np.clip(a, -1.0, 1.0))


@dataclass
class TaskReport:
    task: str
    saved: int = 0
    failed_seeds: list[int] = field(default_factory=list)
    frames: int = 0
    steps: int = 0
    seconds: float = 0.0


def record_task(cfg: DemoConfig, task: str, out: Path, log_prefix: str = "") -> TaskReport:
    """Record ``cfg.episodes`` episodes of one task into ``out/<task>/``: successful expert
    episodes, or (with ``cfg.policy``) DAgger episodes whatever their outcome."""
    env = MetaWorldTask(cfg.harness(task))
    driver, close_driver = ((None, lambda: None) if cfg.policy is None else
                            pipeline_driver(cfg.policy, cfg.cameras, threads=cfg.threads, seed=cfg.seed_base))
    topics = bag_topics(cfg.cameras)
    report = TaskReport(task)
    t0 = time.time()
    tries = cfg.episodes if cfg.policy else cfg.episodes * cfg.max_tries_factor
    try:
        for i in range(tries):
            if report.saved >= cfg.episodes:
                break
            seed = cfg.seed_base + i
            roll = record_episode(env, seed, cfg.call_every, cfg.tail_steps, driver, cfg.beta)
            if not roll.episode.success:
                report.failed_seeds.append(seed)
                if driver is None:
                    continue
            path = out / task / roll.episode.episode_id
            path.parent.mkdir(parents=True, exist_ok=True)
            write_episode_bag(path, roll.episode, topics, series={ACTION_TOPIC: roll.actions})
            report.saved += 1
            report.frames += len(roll.episode.frames)
            report.steps += roll.steps
            if report.saved % 10 == 0:
                print(f"{log_prefix}{task}: {report.saved}/{cfg.episodes} episodes "
                      f"({len(report.failed_seeds)} failed), {time.time() - t0:.0f}s", flush=True)
    finally:
        close_driver()
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
        "labels": labels_kind(cfg.policy is not None), "config": asdict(cfg), "topics": {"cameras": bag_topics(cfg.cameras).cameras, "joint_states": "/joint_states",
                                          "instruction": "/instruction", "outcome": "/episode_outcome",
                                          "actions": ACTION_TOPIC},
        "state_names": list(STATE_NAMES), "action_names": list(ACTION_NAMES),
        "env_dt": CONTROL_DT, "call_period": cfg.call_every * CONTROL_DT,
        "reports": reports, "seconds": round(time.time() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for r in reports:
        failed = f"{len(r['failed_seeds'])} failed" + (" (kept: expert labels)" if cfg.policy else " seeds skipped")
        log(f"{r['task']}: {r['saved']} episodes ({r['frames']} frames, {r['steps']} steps), {failed}, "
            f"{r['seconds']:.0f}s")
    log(f"demos written to {out} in {manifest['seconds']}s")
    if cfg.format == "lerobot":
        export_lerobot(out, out / LEROBOT_DIR, log=log)
    return manifest


def export_lerobot(demos: str | Path, dataset: str | Path, codec: str = "h264", log=print) -> Path:
    """Write the demonstrations recorded in ``demos`` (bags and ``demos.json``) as a LeRobot
    v3.0 dataset at ``dataset``: one frame per recorded call, the action the expert commanded at
    that frame's step (the newest ``/action_command`` message at or before it), tasks by
    instruction, episodes in path order."""
    from ..io.bags import list_episode_bags, read_episode, read_joint_series
    from ..io.lerobot_writer import DatasetEpisodeData, WriterConfig, write_lerobot_dataset

    demos = Path(demos)
    manifest = json.loads((demos / MANIFEST).read_text())
    cameras = tuple(manifest["config"]["cameras"])
    period = float(manifest["call_period"])
    fps = round(1.0 / period)
    if abs(fps * period - 1.0) > 1e-6:
        raise ValueError(f"call period {period} s is not a whole number of frames per second; a LeRobot dataset "
                         "needs an integer fps")
    topics = bag_topics(cameras)
    episodes = []
    for bag in list_episode_bags(demos):
        ep = read_episode(bag, topics, period)
        series = read_joint_series(bag, ACTION_TOPIC)
        at = np.searchsorted(series.t, np.array([f.t for f in ep.frames]) + 1e-6, side="right") - 1
        if at[0] < 0:
            raise ValueError(f"{bag}: no action command at or before the first frame")
        episodes.append(DatasetEpisodeData(
            task=ep.task, state=np.stack([f.state for f in ep.frames]), action=series.values[at],
            images={f"observation.images.{c}": np.stack([f.images[c] for f in ep.frames]) for c in cameras},
            frame_tasks=[ep.instruction_at(i) for i in range(len(ep.frames))]))
    log(f"exporting {len(episodes)} episode(s) as a LeRobot v3.0 dataset at {fps} fps to {dataset} ...")
    return write_lerobot_dataset(dataset, episodes, WriterConfig(
        fps=fps, video_keys=tuple(f"observation.images.{c}" for c in cameras), codec=codec,
        state_names=tuple(manifest["state_names"]), action_names=tuple(manifest["action_names"]),
        robot_type="sawyer_metaworld", episodes_per_file=50))


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
    p.add_argument("--policy", default=None, help="DAgger: a checkpoint that drives while the expert labels "
                                                   "every step (failed episodes are kept)")
    p.add_argument("--beta", type=float, default=d.beta, help="DAgger: probability that the expert drives a call")
    p.add_argument("--threads", type=int, default=d.threads, help="DAgger: torch threads per worker")
    p.add_argument("--format", default=d.format, choices=FORMATS,
                   help="lerobot: also export the demonstrations as a LeRobot v3.0 dataset in <out>/lerobot")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    band = tuple(float(x) for x in a.pose_band.split(","))
    cfg = DemoConfig(tasks=tuple(a.tasks.split(",")), episodes=a.episodes, cameras=tuple(a.cameras.split(",")),
                     image_size=a.image_size, call_every=a.call_every, tail_steps=a.tail_steps,
                     max_steps=a.max_steps, pose_band=(band[0], band[1]), seed_base=a.seed_base, workers=a.workers,
                     policy=a.policy, beta=a.beta, threads=a.threads, format=a.format)
    record_demos(cfg, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
