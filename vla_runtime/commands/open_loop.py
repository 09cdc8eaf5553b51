"""``vla-runtime replay --dataset``: open-loop evaluation of a checkpoint on a LeRobot dataset.

Why: a dataset holds what the robot was *commanded* after every frame, so the policy's chunks can
be scored against it offline, per episode, without a robot or a simulator, and the cache's
effect on that score measured on the same calls. Each episode is sampled into policy calls like
a bag (:class:`~vla_runtime.io.episode_sources.DatasetRef`); each call runs dense and, with
``repository``, cached on the same inputs and the same noise (``seed * 1000003 + call``, the
policy node's seeding), with the cache manager choosing references and sliding its window
between calls as in ``bench --cache``.

The score: the first ``n_execute`` rows of each chunk (the actions a robot would execute before
the next call; by default ``call_period * fps``) against the dataset's actions at the same
frames (row ``j`` of the chunk of a call that saw frame ``f`` against the action of frame
``f + j``, rows past the episode's end left out), as mean absolute error, RMS and maximum, in
robot units and in the checkpoint's normalised space (where joints of different ranges weigh
alike). The dense chunks go to one output bag per episode (the replay bag format), so
``--golden`` compares a later run with an earlier one call by call, as for bags.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, get_args

import numpy as np
import torch

from ..engine.policy import Observation
from ..io.bags import DEFAULT_START_TIME_NS, Storage
from ..io.episode_sources import open_dataset
from ..nodes.profile import load_profile
from .cache_bench import cache_engines, side_by_side
from .replay import (LATENCY_PHASES, NOISE_SEED_STRIDE, CallResult, Comparison, compare_chunks, read_action_chunks,
                     runtime_typestore, write_replay_bag)

SUMMARY_FILE = "open_loop.json"


@dataclass(frozen=True)
class OpenLoopSpec:
    """One open-loop run. ``checkpoint=None``: the profile's ``engine.checkpoint``;
    ``repository=None``: dense only; ``n_execute=None``: the frames between two calls."""

    dataset: Path
    out: Path
    checkpoint: Path | None = None
    profile: Path | None = None
    repository: Path | None = None
    episodes: str | None = None
    features: tuple[str, ...] = ()
    call_period: float = 0.5
    n_execute: int | None = None
    seed: int = 0
    rho_p: float | None = None      # with a repository; None: its profiled fraction
    time_available_s: float = 1.0
    storage: Storage = "sqlite3"
    overwrite: bool = False
    golden: Path | None = None
    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("dataset", "out", "checkpoint", "profile", "repository", "golden"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "features", tuple(self.features))
        if not (isinstance(self.call_period, (int, float)) and math.isfinite(self.call_period) and self.call_period > 0):
            raise ValueError(f"call_period must be a positive number of seconds, got {self.call_period!r}")
        if self.n_execute is not None and not (isinstance(self.n_execute, int) and self.n_execute >= 1):
            raise ValueError(f"n_execute must be an int >= 1, got {self.n_execute!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.storage not in get_args(Storage):
            raise ValueError(f"storage must be one of {list(get_args(Storage))}, got {self.storage!r}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a finite number >= 0, got {self.tolerance!r}")
        if self.golden is not None and self.golden.resolve() == self.out.resolve():
            raise ValueError(f"the output folder {self.out} is the golden one; choose another --out")


@dataclass
class ErrorStats:
    """Absolute errors pooled over calls: mean, RMS and max."""

    total: float = 0.0
    squares: float = 0.0
    count: int = 0
    worst: float = 0.0

    def add(self, diff: np.ndarray) -> None:
        a = np.abs(np.asarray(diff, dtype=np.float64))
        self.total += float(a.sum())
        self.squares += float((a ** 2).sum())
        self.count += a.size
        self.worst = max(self.worst, float(a.max())) if a.size else self.worst

    def merge(self, other: "ErrorStats") -> None:
        self.total += other.total
        self.squares += other.squares
        self.count += other.count
        self.worst = max(self.worst, other.worst)

    def as_dict(self) -> dict[str, float | None]:
        if not self.count:
            return {"mae": None, "rmse": None, "max": None}
        return {"mae": self.total / self.count, "rmse": math.sqrt(self.squares / self.count), "max": self.worst}


@dataclass
class EpisodeScore:
    """One episode's open-loop errors, dense and cached, with the cache's hits and fallbacks."""

    index: int
    label: str
    task: str
    calls: int = 0
    errors: dict[str, dict[str, ErrorStats]] = field(default_factory=dict)   # mode -> units -> stats
    hits: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    cached_vs_dense: list[float] = field(default_factory=list)               # relative L2 of the chunk on hits
    comparison: Comparison | None = None

    def stats(self, mode: str, units: str) -> ErrorStats:
        return self.errors.setdefault(mode, {}).setdefault(units, ErrorStats())

    def as_dict(self) -> dict[str, Any]:
        cmp = self.comparison
        return {"episode": self.index, "label": self.label, "task": self.task, "calls": self.calls,
                "errors": {m: {u: s.as_dict() for u, s in units.items()} for m, units in self.errors.items()},
                "hits": self.hits, "hit_rate": self.hits / self.calls if self.calls and "cached" in self.errors else None,
                "fallbacks": self.fallbacks,
                "cached_vs_dense_relative_l2_mean": float(np.mean(self.cached_vs_dense)) if self.cached_vs_dense else None,
                "golden_max_abs_diff": None if cmp is None else cmp.max_diff,
                "golden_problem": None if cmp is None else cmp.problem}


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse an existing folder unless ``overwrite``, and then delete it only if it is an
    earlier open-loop output (a typo in ``--out`` must not wipe another folder)."""
    if not out.exists():
        return
    if not overwrite:
        raise FileExistsError(f"output folder {out} exists already; pass --overwrite to replace it")
    if not (out / SUMMARY_FILE).is_file():
        raise FileExistsError(f"{out} exists and is not an open-loop output (no {SUMMARY_FILE}); refusing to "
                              "overwrite it")
    shutil.rmtree(out)


def run_open_loop(spec: OpenLoopSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Score every selected episode; write the per-episode bags and ``open_loop.json`` into ``spec.out``."""
    profile = load_profile(spec.profile) if spec.profile is not None else None
    checkpoint = spec.checkpoint or (profile.engine.checkpoint if profile is not None else None)
    if not checkpoint:
        raise ValueError("no checkpoint: pass --checkpoint (or --profile with engine.checkpoint)")
    if spec.golden is not None and not (spec.golden / SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"no open-loop output at {spec.golden} (no {SUMMARY_FILE}) to compare with")
    if spec.out.exists() and not spec.overwrite:
        raise FileExistsError(f"output folder {spec.out} exists already; pass --overwrite to replace it")
    policy, refs = open_dataset(spec.dataset, checkpoint, profile, spec.features, spec.episodes, log)
    cache = cache_engines(policy, spec.repository, spec.rho_p, spec.time_available_s) if spec.repository else None
    reader = refs[0].reader if refs else None
    action_key = refs[0].features.action if refs else "action"
    names = profile.joint_names if profile is not None else (
        reader.features[action_key].names if reader is not None and reader.features[action_key].names else
        tuple(f"action_{i}" for i in range(policy.action_norm.dim)))
    typestore = runtime_typestore()
    _prepare_out(spec.out, spec.overwrite)
    spec.out.mkdir(parents=True)

    scores = []
    for k, ref in enumerate(refs, start=1):
        recorded = ref.read(spec.call_period)
        episode = recorded.episode
        n_execute = spec.n_execute or max(1, round(spec.call_period * recorded.fps))
        target = recorded.actions.astype(np.float32)
        target_n = policy.action_norm.normalize(torch.from_numpy(target)).numpy()
        score = EpisodeScore(ref.index, ref.label, episode.task)
        if cache is not None:
            cache[0].start_episode(episode.task)
        results = []
        for i, frame in enumerate(episode.frames):
            obs = Observation(frame.images, frame.state, episode.instruction_at(i))
            noise = policy.engine.make_noise(1, torch.Generator().manual_seed(spec.seed * NOISE_SEED_STRIDE + i))
            if cache is not None:
                r = side_by_side(policy, cache[1], cache[0], obs, noise, spec.time_available_s)
                outputs = {"dense": r.dense, "cached": r.cached}
                if r.hit:
                    score.hits += 1
                    d, c = r.dense.actions, r.cached.actions
                    score.cached_vs_dense.append(float((c - d).norm() / d.norm().clamp_min(1e-12)))
                else:
                    score.fallbacks[r.reason] = score.fallbacks.get(r.reason, 0) + 1
            else:
                outputs = {"dense": policy.engine.infer(policy.prepare(obs), noise=noise)}
            f = int(recorded.call_frames[i])
            for mode, out in outputs.items():
                model = out.actions[0].float().cpu()
                robot = policy.action_norm.unnormalize(model).numpy()
                rows = min(n_execute, robot.shape[0], target.shape[0] - f)
                score.stats(mode, "robot").add(robot[:rows] - target[f:f + rows])
                score.stats(mode, "normalised").add(model[:rows, :target.shape[1]].numpy() - target_n[f:f + rows])
                if mode == "dense":
                    times = out.times.as_dict()
                    results.append(CallResult(call_id=i, t=frame.t, stamp_ns=DEFAULT_START_TIME_NS + round(frame.t * 1e9),
                                              actions=robot, latency={p: float(times.get(p, 0.0)) for p in LATENCY_PHASES}))
            score.calls += 1
        bag = spec.out / ref.label
        write_replay_bag(bag, results, names, recorded.fps, profile.name if profile else "lerobot-dataset",
                         spec.storage, typestore, {"checkpoint_hash": policy.checkpoint_hash or "",
                                                   "seed": str(spec.seed), "call_period": repr(spec.call_period),
                                                   "input_bag": ref.source})
        if spec.golden is not None:
            golden = spec.golden / ref.label
            if not golden.exists():
                raise FileNotFoundError(f"the golden output {spec.golden} has no {ref.label}")
            score.comparison = compare_chunks(results, read_action_chunks(golden, typestore, raw=True), spec.tolerance,
                                              names)
        dense = score.stats("dense", "robot").as_dict()
        log(f"[{k}/{len(refs)}] {ref.label}: {score.calls} calls, dense MAE {dense['mae']:.4g}"
            + (f", {score.hits} cached" if cache is not None else "")
            + ("" if score.comparison is None else f", golden {'ok' if score.comparison.ok else 'DRIFT'}"))
        scores.append(score)

    overall = EpisodeScore(-1, "overall", "")
    for s in scores:
        overall.calls += s.calls
        overall.hits += s.hits
        overall.cached_vs_dense += s.cached_vs_dense
        for reason, n in s.fallbacks.items():
            overall.fallbacks[reason] = overall.fallbacks.get(reason, 0) + n
        for mode, units in s.errors.items():
            for u, st in units.items():
                overall.stats(mode, u).merge(st)
    drifting = [s for s in scores if s.comparison is not None and not s.comparison.ok]
    summary = {
        "dataset": str(spec.dataset), "out": str(spec.out), "checkpoint": str(checkpoint),
        "checkpoint_hash": policy.checkpoint_hash, "repository": None if spec.repository is None else str(spec.repository),
        "rho_p": cache[1].cache.rho_p if cache else None, "seed": spec.seed, "call_period_s": spec.call_period,
        "n_execute": spec.n_execute, "fps": reader.fps if reader else None, "joint_names": list(names),
        "episodes": [s.as_dict() for s in scores], "overall": overall.as_dict() | {"episode": None, "label": None},
        "golden": None if spec.golden is None else str(spec.golden), "tolerance": spec.tolerance,
        "drift": None if spec.golden is None else bool(drifting),
        "problem": None if not drifting else f"{drifting[0].label}: {drifting[0].comparison.problem}",
    }
    (spec.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
    for line in score_table(scores + [overall], cache is not None):
        log(line)
    return summary


def score_table(scores: list[EpisodeScore], cached: bool) -> list[str]:
    """A short fixed-width table: MAE in robot units and normalised, dense (and cached), hits."""
    head = f"{'episode':>16} {'calls':>5} {'dense MAE':>10} {'norm':>8}"
    if cached:
        head += f" {'cached MAE':>10} {'norm':>8} {'hits':>5} {'fallback':>8}"
    lines = [head]
    for s in scores:
        d, dn = s.stats("dense", "robot").as_dict(), s.stats("dense", "normalised").as_dict()
        row = f"{s.label:>16} {s.calls:>5} {d['mae'] or 0:>10.4g} {dn['mae'] or 0:>8.4g}"
        if cached:
            c, cn = s.stats("cached", "robot").as_dict(), s.stats("cached", "normalised").as_dict()
            row += f" {c['mae'] or 0:>10.4g} {cn['mae'] or 0:>8.4g} {s.hits:>5} {sum(s.fallbacks.values()):>8}"
        lines.append(row)
    return lines


def open_loop_main(spec: OpenLoopSpec, log: Callable[[str], None] = print,
                   out: Callable[[str], None] = print) -> int:
    """Run, print the JSON summary with ``out``; exit status 2 when a golden comparison drifted."""
    summary = run_open_loop(spec, log)
    out(json.dumps(summary, indent=2, default=str))
    if summary["drift"]:
        log(f"open-loop replay drifted from golden {spec.golden}: {summary['problem']}")
        return 2
    if summary["drift"] is False:
        log(f"open-loop replay matches golden {spec.golden} within {spec.tolerance:g}")
    return 0
