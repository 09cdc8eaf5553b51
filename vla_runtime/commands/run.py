"""``vla-runtime run``: the three-stage pipeline without ROS, over a recorded episode.

The episode bag plays the robot: at each call time its newest images, joint state and
instruction go to the vision stage; the policy stage's chunk comes back. With ``--processes 3``
the stages are three OS processes sharing the rings (the nodes' deployment, with pipes for the
notifications); with ``--processes 1`` they run here. Both run the same stage code as the rclpy
nodes, so this is how to try a checkpoint, a profile and a cache repository on a machine
without ROS.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..io.bags import profile_topics, read_episode
from ..nodes.pipeline import PipelineSpec, make_pipeline
from ..nodes.profile import load_profile
from ..nodes.stages import RingNames


@dataclass(frozen=True)
class RunSpec:
    episode: Path
    profile: Path
    checkpoint: Path | None = None     # None: the profile's engine.checkpoint
    processes: int = 3
    cache: bool | None = None          # None: the profile's cache.enabled
    repository: Path | None = None     # overrides the profile's cache.repository (and enables the cache)
    call_period: float = 0.5
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.processes not in (1, 3):
            raise ValueError(f"processes must be 1 or 3, got {self.processes}")
        if not self.call_period > 0:
            raise ValueError(f"call_period must be > 0 s, got {self.call_period}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def pipeline_spec(spec: RunSpec) -> tuple[PipelineSpec, Any]:
    """The pipeline for a run, from the profile and the overrides; ring names are unique to this run."""
    profile = load_profile(spec.profile)
    checkpoint = spec.checkpoint or profile.engine.checkpoint
    if not checkpoint:
        raise ValueError(f"no checkpoint: pass --checkpoint or set engine.checkpoint in {spec.profile}")
    cache = profile.cache
    if spec.repository is not None:
        cache = dataclasses.replace(cache, enabled=True, repository=str(spec.repository))
    if spec.cache is not None:
        cache = dataclasses.replace(cache, enabled=spec.cache)
    if cache.enabled and not cache.repository:
        raise ValueError("the cache needs a repository: pass --repository or set cache.repository in the profile")
    tag = f"run{os.getpid()}"
    rings = RingNames.tagged(tag)
    engine = dataclasses.replace(profile.engine, threads=spec.threads or profile.engine.threads)
    return PipelineSpec(Path(checkpoint), tuple(c.name for c in profile.cameras), cache, engine, rings, spec.seed,
                        arm_slices=profile.arm_slices), profile


def run_pipeline(spec: RunSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One call per call time of the episode; returns the per-call record and a summary (JSON-ready)."""
    pspec, profile = pipeline_spec(spec)
    if not spec.episode.exists():
        raise FileNotFoundError(f"no episode bag at {spec.episode}")
    episode = read_episode(spec.episode, profile_topics(profile), spec.call_period, state_dim=profile.state_dim)
    log(f"starting {spec.processes} process(es): cameras {list(pspec.cameras)}, cache "
        f"{'on (' + str(pspec.cache.repository) + ')' if pspec.cache.enabled else 'off'}")
    t0 = time.perf_counter()
    calls: list[dict[str, Any]] = []
    with make_pipeline(pspec, spec.processes) as pipeline:
        start_s = time.perf_counter() - t0
        if episode.frames:   # the episode announced before its first call, as the robot's reset does
            pipeline.start_episode(episode.instruction_at(0))
        for i, frame in enumerate(episode.frames):
            t1 = time.perf_counter()
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.instruction_at(i), start_tick=i)
            wall = time.perf_counter() - t1
            choice = pipeline.last_choice
            calls.append({"call_id": res.request_seq, "t": frame.t, "source": "cached" if res.cached else "dense",
                          "reference": f"{choice.episode}:{choice.index}" if choice is not None and choice.found else None,
                          "dense_reason": choice.reason if choice is not None and not choice.found else None,
                          "seconds": {**{k: float(v) for k, v in pipeline.last_times.items()}, "call": wall},
                          "actions": np.asarray(res.chunk).round(6).tolist()})
            log(f"call {i} at t={frame.t:.2f}s: {calls[-1]['source']}"
                + (f" ({calls[-1]['reference']})" if calls[-1]["reference"] else "")
                + f", {wall * 1e3:.1f} ms")
    walls = [c["seconds"]["call"] for c in calls]
    phases = sorted({k for c in calls for k in c["seconds"]})
    return {"episode": str(spec.episode), "profile": profile.name, "checkpoint": str(pspec.checkpoint),
            "processes": spec.processes, "cache": pspec.cache.enabled, "start_s": start_s,
            "episode_start_s": pipeline.last_episode_start_s if episode.frames else 0.0,
            "calls": len(calls), "cached_calls": sum(c["source"] == "cached" for c in calls),
            "median_seconds": {p: statistics.median(c["seconds"][p] for c in calls if p in c["seconds"])
                               for p in phases} if calls else {},
            "max_call_s": max(walls, default=None), "per_call": calls}
