"""The ALOHA profile in closed loop on gym-aloha: plumbing and latency, not task success.

What it checks, end to end through the same pipeline the nodes run (1 process or 3): the
profile's three cameras reach the model under the profile's names, the 14 joint positions come
back as 14-dim joint targets in the profile's order, every executed command passes the profile's
safety filter (limits and speed), and how long each call takes against the time its chunk lasts
on the robot (``n_execute`` ticks at the profile's 50 Hz): the next chunk must be ready before
the current one runs out, or the robot waits.

With ``--checkpoint`` it runs that policy (``checkpoints/pi05-aloha-transfer-cube`` is trained
here on ``training/aloha_demos``' scripted demonstrations). Without one it writes a pi0.5 checkpoint
with *random weights* of the chosen preset in the public layout, with normalisation statistics
drawn around the simulator's home pose: plumbing and latency only, success is expected to be 0.

    vla-runtime aloha-sim --out out/aloha --episodes 2 --processes 3
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..engine.safety import JointLimits, SafetyFilter
from ..engine.timing import summarize
from ..models.checkpoint import read_checkpoint_layout
from ..models.config import preset
from ..nodes.pipeline import PipelineSpec, make_pipeline
from ..nodes.profile import CacheSpec, EngineSpec, load_profile
from ..nodes.stages import RingNames
from ..sim.aloha_env import (CONTROL_DT, DEFAULT_CAMERAS, DEFAULT_PROFILE, INSTRUCTIONS, STATE_DIM, AlohaSimConfig,
                             AlohaTask, check_profile)


@dataclass(frozen=True)
class AlohaRunSpec:
    out: Path
    profile: Path | None = None          # None: the bundled config/aloha.yaml
    checkpoint: Path | None = None       # None: a random-weights checkpoint of ``preset`` is written to out/
    preset: str = "pi05-small"
    task: str = "transfer_cube"
    episodes: int = 2
    seed: int = 0                        # episode i uses object pose seed + i
    max_steps: int = 400
    n_execute: int = 25                  # ticks executed per call (0.5 s at 50 Hz)
    processes: int = 1
    engine: EngineSpec = field(default_factory=EngineSpec)
    cameras: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_CAMERAS))

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "profile", Path(self.profile or DEFAULT_PROFILE))
        if self.checkpoint is not None:
            object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if self.episodes < 1 or self.max_steps < 1 or self.n_execute < 1:
            raise ValueError("episodes, max_steps and n_execute must be >= 1")
        if self.task not in INSTRUCTIONS:
            raise ValueError(f"unknown gym-aloha task {self.task!r}; choose from {sorted(INSTRUCTIONS)}")


def write_aloha_checkpoint(ckpt: Path, preset_name: str, env: AlohaTask, cameras: list[str], seed: int = 0) -> None:
    """Random weights of ``preset_name``; statistics from poses around the home pose (so the
    normaliser maps real states into range), the tokenizer trained on the task's prompts."""
    from .demo import write_random_checkpoint

    cfg = preset(preset_name)
    if cfg.num_cameras < len(cameras) or cfg.max_state_dim < STATE_DIM or cfg.action_dim < STATE_DIM:
        raise ValueError(f"preset {preset_name} takes {cfg.num_cameras} cameras and {cfg.action_dim}-dim actions; "
                         f"ALOHA needs {len(cameras)} and {STATE_DIM}")
    rng = np.random.default_rng(seed)
    home = env.reset(seed)
    poses = home[None, :] + rng.normal(0.0, 0.15, (512, STATE_DIM))
    poses[:, [6, 13]] = rng.uniform(0.0, 1.0, (512, 2))           # grippers: the whole range
    write_random_checkpoint(ckpt, cfg, [env.instruction], poses, poses, tuple(cameras), seed=seed)


def run_episode(env: AlohaTask, pipeline, limits: JointLimits, seed: int, n_execute: int) -> dict[str, Any]:
    """One episode: render at each call, run the chunk's first ``n_execute`` targets through the
    safety filter into the simulator. A non-finite chunk is never executed (the filter holds)."""
    state = env.reset(seed)
    pipeline.start_episode()
    safety = SafetyFilter(limits, CONTROL_DT)
    safety.set_initial(state)
    rec: dict[str, Any] = {"seed": seed, "steps": 0, "calls": 0, "success": False, "call_s": [], "render_s": [],
                           "sim_step_s": [], "phase_s": {}, "outside_limits": 0, "action_dims": None}
    done, tick = False, 0
    while not done:
        t0 = time.perf_counter()
        images = env.render()
        rec["render_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = pipeline.call(images, state, env.instruction, start_tick=tick)
        rec["call_s"].append(time.perf_counter() - t0 - pipeline.last_times.get("upkeep", 0.0))
        rec["calls"] += 1
        for k, v in pipeline.last_times.items():
            rec["phase_s"].setdefault(k, []).append(float(v))
        chunk = np.asarray(out.chunk, np.float64)
        rec["action_dims"] = int(chunk.shape[1])
        for action in chunk[:n_execute]:
            cmd = safety.filter(action if np.isfinite(action).all() else None, tick)
            rec["outside_limits"] += int(not limits.contains(cmd.action))
            t0 = time.perf_counter()
            step = env.step(cmd.action)
            rec["sim_step_s"].append(time.perf_counter() - t0)
            tick += 1
            rec["steps"] += 1
            state = step.state
            rec["success"] = rec["success"] or step.success
            if step.done:
                done = True
                break
    rec["safety"] = dict(safety.counts)
    rec["max_reward"] = env.max_reward
    return rec


def run_aloha(spec: AlohaRunSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Episodes of ``spec.task`` through the pipeline; writes ``aloha.json`` in ``spec.out``."""
    profile = load_profile(spec.profile)
    check_profile(profile, spec.cameras)
    cameras = [c.name for c in profile.cameras]               # the model's camera order is the profile's
    limits = profile.joint_limits()
    spec.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"task": spec.task, "profile": str(spec.profile), "cameras": cameras,
                              "joint_names": list(profile.joint_names), "n_execute": spec.n_execute,
                              "chunk_duration_s": spec.n_execute * CONTROL_DT, "processes": spec.processes,
                              "engine": asdict(spec.engine)}
    image_size = (preset(spec.preset) if spec.checkpoint is None else
                  read_checkpoint_layout(spec.checkpoint)[3]).vision.image_size
    with AlohaTask(AlohaSimConfig(spec.task, cameras={c: spec.cameras[c] for c in cameras}, image_size=image_size,
                                  max_steps=spec.max_steps)) as env:
        ckpt = spec.checkpoint
        if ckpt is None:
            ckpt = spec.out / "checkpoint"
            log(f"no --checkpoint: writing a {spec.preset} checkpoint with RANDOM weights to {ckpt} "
                "(plumbing and latency only; success is expected to be 0)")
            write_aloha_checkpoint(ckpt, spec.preset, env, cameras, seed=spec.seed)
        report["checkpoint"] = str(ckpt)
        report["random_weights"] = spec.checkpoint is None
        tag = f"aloha{os.getpid()}"
        pspec = PipelineSpec(ckpt, tuple(cameras), CacheSpec(enabled=False), spec.engine,
                             RingNames.tagged(tag), seed=spec.seed,
                             arm_slices=tuple(tuple(s) for s in profile.arm_slices), state_dim=STATE_DIM)
        episodes = []
        with make_pipeline(pspec, spec.processes) as pipeline:
            for i in range(spec.episodes):
                rec = run_episode(env, pipeline, limits, spec.seed + i, spec.n_execute)
                episodes.append(rec)
                log(f"episode {i + 1}/{spec.episodes} (seed {rec['seed']}): {rec['steps']} steps, {rec['calls']} calls, "
                    f"call {statistics.fmean(rec['call_s']) * 1e3:.0f} ms mean, success {rec['success']} "
                    f"(reward stage {rec['max_reward']}), "
                    f"safety {rec['safety']}")
    calls = summarize([x for r in episodes for x in r["call_s"]], (0.5, 0.95))
    phases: dict[str, list[float]] = {}
    for r in episodes:
        for k, v in r["phase_s"].items():
            phases.setdefault(k, []).extend(v)
    report["episodes"] = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in episodes]
    report["summary"] = {
        "episodes": len(episodes), "successes": sum(r["success"] for r in episodes),
        # how far the failures got: episodes by the highest reward stage reached (transfer cube:
        # 1 right gripper on the cube, 2 lifted, 3 left gripper on it, 4 transferred)
        "episodes_by_max_reward": {str(k): sum(r["max_reward"] == k for r in episodes)
                                   for k in sorted({r["max_reward"] for r in episodes})},
        "calls": sum(r["calls"] for r in episodes), "steps": sum(r["steps"] for r in episodes),
        "call_s": calls, "phase_mean_s": {k: statistics.fmean(v) for k, v in phases.items()},
        "render_mean_s": statistics.fmean(x for r in episodes for x in r["render_s"]),
        "sim_step_mean_s": statistics.fmean(x for r in episodes for x in r["sim_step_s"]),
        # > 1: the next chunk is ready before the current one runs out (with the call started at
        # the chunk's start; the streaming controller starts it earlier still)
        "chunk_duration_over_call_p95": (spec.n_execute * CONTROL_DT) / max(calls["p95"] or 1e-9, 1e-9),
        "outside_limits": sum(r["outside_limits"] for r in episodes),
        "action_dims": sorted({r["action_dims"] for r in episodes}),
    }
    (spec.out / "aloha.json").write_text(json.dumps(report, indent=2))
    log(f"wrote {spec.out / 'aloha.json'}")
    return report

