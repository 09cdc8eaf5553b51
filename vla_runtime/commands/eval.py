"""``vla-runtime eval``: closed-loop success on Meta-World, dense vs cached, same seeds.

A speed-up is only worth having if task success survives it. Each episode is a Meta-World task
with a fresh object pose per seed, driven through the same pipeline as the robot (the three
stages, in one process or three): camera images are rendered at each policy call, the chunk's
first ``n_execute`` actions are executed, and the episode ends on success or after
``max_steps`` environment steps.

The cached run needs a reference repository. It is built here, as on a robot: the dense policy
runs ``reference_episodes`` episodes per task on seeds disjoint from the evaluation seeds, its
successful ones are recorded as rosbag2 episodes and ``build_repository`` turns them into the
repository (so no evaluation seed is ever a reference). Then both modes run the same evaluation
seeds, taking turns episode by episode (the one going first alternating) so that their times are
measured side by side; the report has success rate, mean policy calls per successful episode,
per-phase latency, the speed-up (also seed by seed, ``speed_by_seed``) and the fallback rate, per
task and overall, as JSON, a table and a PNG plot.

Both modes also draw the same denoising noise on a seed (``start_episode(noise_seed=seed)``):
an episode differs between them only where the cache changed a chunk, so a call that fell back
to dense is the dense call, and the success difference is read seed by seed (``paired``) with
its own standard error instead of that of two independent rates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..cache.builder import BuildConfig, build_repository_from
from ..cache.half_profile import time_repository_halves
from ..cache.halves import (DEFAULT_RHO_N, DEFAULT_RHO_P, ResolvedHalves, choose_rho_p, median_interval,
                            resolve_halves)
from ..cache.masks import even_groups
from ..cache.repository import ReferenceRepository
from ..cache.retrieval import fallback_rule, first_call_floors
from ..cache.selection_budget import selection_pays
from ..engine.policy import Pi05Policy
from ..io.bags import BagTopics, Episode, EpisodeFrame, write_episode_bag
from ..io.episode_sources import bag_refs
from ..nodes.pipeline import PipelineSpec, make_pipeline
from ..nodes.profile import CacheSpec, EngineSpec
from ..nodes.stages import RingNames
from ..progress import Progress, silent
from .summaries import build as build_summary
from ..sim.metaworld_env import ACTION_DIM, DEFAULT_CAMERAS, DEFAULT_TASKS, MetaWorldConfig, MetaWorldTask

CALL_PERIOD_S = 0.5    # bag time between the recorded calls of a reference episode (a synthetic clock)
MODES = ("dense", "cached", "resampled")   # resampled: the dense policy drawing other noise (a baseline)
CACHES = ("context", "action")
AUTO = "auto"   # ``caches=("auto",)``: the cached mode runs what the runtime's own ``auto`` picks at start-up
# References recorded here go on 5 calls past their success; with them the fallback past the
# references is not needed (``EvalSpec.max_end_matches``): docs/cache.md, coverage at pi05-mw.
DEFAULT_REFERENCE_TAIL_CALLS = 5


@dataclass(frozen=True)
class EvalSpec:
    checkpoint: Path
    out: Path
    tasks: tuple[str, ...] = DEFAULT_TASKS
    episodes: int = 50                    # evaluation episodes per task (seeds eval_seed + i)
    eval_seed: int = 100_000
    reference_episodes: int = 10          # dense episodes per task recorded for the repository
    reference_seed: int = 50_000
    reference_tail_calls: int = DEFAULT_REFERENCE_TAIL_CALLS   # calls recorded past a reference's success
    pose_band: tuple[float, float] = (0.0, 1.0)            # evaluation poses (normalised band)
    reference_band: tuple[float, float] = (0.0, 1.0)       # reference poses
    cameras: tuple[str, ...] = DEFAULT_CAMERAS
    image_size: int = 64
    n_execute: int = 4                    # actions executed per policy call
    max_steps: int = 500                  # Meta-World's own episode length (max_path_length)
    processes: int = 1
    modes: tuple[str, ...] = ("dense", "cached")
    repository: Path | None = None        # an existing repository (skips the reference phase)
    reference_dataset: Path | None = None  # a LeRobot dataset (metaworld_demos --format lerobot) to build it from
    rho_p: float | None = None            # None: profiled when the repository is built here, else the repository's
    rho_n: float | None = None            # None: profiled (masks of a repository built here), else 0.5
    mask_groups: int | None = None        # Action Cache mask groups of a repository built here (None: 2)
    profile_episodes: int = 2             # reference episodes per task replayed to profile the ratios
    tolerance: float = 0.05               # mean relative action deviation the profiled ratios may cost
    caches: tuple[str, ...] = CACHES      # which halves the cached mode forces on (ablations), or ("auto",)
    min_similarity: float = CacheSpec.min_similarity    # fallback: every query (the profile's default)
    first_scene_floor: bool = False       # fallback: an episode's first scene below the repository's floor
    # fallback past the references; None: none (0) for references recorded here past their success,
    # else the profile's default (a given repository or dataset: its references may end at success)
    max_end_matches: int | None = None
    seed: int = 0                         # policy noise seed
    engine: EngineSpec = field(default_factory=EngineSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        object.__setattr__(self, "out", Path(self.out))
        if self.repository is not None:
            object.__setattr__(self, "repository", Path(self.repository))
        if self.reference_dataset is not None:
            object.__setattr__(self, "reference_dataset", Path(self.reference_dataset))
            if self.repository is not None:
                raise ValueError("give a repository or a reference dataset to build one from, not both")
        if not self.tasks:
            raise ValueError("at least one task is needed")
        if self.episodes < 1 or self.n_execute < 1 or self.max_steps < 1:
            raise ValueError("episodes, n_execute and max_steps must be >= 1")
        if unknown := sorted(set(self.modes) - set(MODES)):
            raise ValueError(f"unknown mode(s) {unknown}; choose from {MODES}")
        if self.mask_groups is not None:
            if self.repository is not None:
                raise ValueError("mask_groups sets the masks of a repository built here; a given repository keeps "
                                 "its own")
            if isinstance(self.mask_groups, bool) or not isinstance(self.mask_groups, int) or self.mask_groups < 1:
                raise ValueError(f"mask_groups must be a whole number >= 1, got {self.mask_groups!r}")
        if self.profile_episodes < 0 or not self.tolerance > 0:
            raise ValueError("profile_episodes must be >= 0 and tolerance > 0")
        if self.caches != (AUTO,) and (not self.caches or set(self.caches) - set(CACHES)):
            raise ValueError(f"caches must be a non-empty subset of {CACHES}, or ({AUTO!r},) alone, "
                             f"got {list(self.caches)}")
        if not 0 < self.min_similarity <= 1:
            raise ValueError(f"min_similarity must be in (0, 1], got {self.min_similarity}")
        if isinstance(self.reference_tail_calls, bool) or not isinstance(self.reference_tail_calls, int) \
                or self.reference_tail_calls < 0:
            raise ValueError(f"reference_tail_calls must be an int >= 0, got {self.reference_tail_calls!r}")
        if self.max_end_matches is None:
            recorded_past = self.repository is None and self.reference_dataset is None and self.reference_tail_calls > 0
            object.__setattr__(self, "max_end_matches", 0 if recorded_past else CacheSpec.max_end_matches)
        if self.max_end_matches < 0:
            raise ValueError(f"max_end_matches must be >= 0 (0: no limit), got {self.max_end_matches}")
        if "cached" in self.modes and self.repository is None and self.reference_dataset is None \
                and self.reference_episodes < 1:
            raise ValueError("the cached mode needs a repository or reference_episodes >= 1")
        seeds = range(self.eval_seed, self.eval_seed + self.episodes)
        refs = range(self.reference_seed, self.reference_seed + self.reference_episodes)
        if set(seeds) & set(refs):
            raise ValueError("evaluation and reference seeds overlap: a reference would be an evaluation episode")


@dataclass
class EpisodeResult:
    task: str
    seed: int
    success: bool
    steps: int
    calls: int
    cached_calls: int
    call_s: list[float]                   # wall time of each policy call
    phase_s: dict[str, list[float]]       # per-phase seconds of each call
    dense_reasons: dict[str, int]
    frames: list[EpisodeFrame] | None = None
    start_s: float = 0.0                  # the cache manager preparing the episode before its first call
    final_state: list[float] = field(default_factory=list)   # robot state at the end (same seed, same run: same state)
    # per call, the reference that served it ([episode, index, similarity]) or None (dense): where
    # in the references a cached episode was, and whether it kept returning to one entry
    references: list[list | None] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("frames")
        return d


def task_harness(spec: EvalSpec, task: str, band: tuple[float, float]) -> MetaWorldTask:
    return MetaWorldTask(MetaWorldConfig(task, cameras=spec.cameras, image_size=spec.image_size,
                                         max_steps=spec.max_steps, pose_band=band))


def run_episode(env: MetaWorldTask, pipeline, seed: int, n_execute: int, record: bool = False,
                tail_calls: int = 0) -> EpisodeResult:
    """One closed-loop episode: render at each call, execute the chunk's first ``n_execute`` actions.

    ``tail_calls``: after the call in which the task succeeded, that many calls more (within the
    step limit), as the policy drives on at the goal. A reference recorded so gives an episode
    that is near the goal and not yet done calls to match besides the references' last one (the
    ``max_end_matches`` fallback counts matches of last calls)."""
    state = env.reset(seed)
    # a robot resetting: the cache manager prepares meanwhile; the noise follows the seed alone
    pipeline.start_episode(env.instruction, noise_seed=seed)
    res = EpisodeResult(env.cfg.task, seed, False, 0, 0, 0, [], {}, {}, [] if record else None,
                        pipeline.last_episode_start_s)
    done, last_call = False, None   # last_call: once the task succeeded, the call count to stop at
    while not done and (last_call is None or res.calls < last_call):
        images = env.render()
        if record:
            res.frames.append(EpisodeFrame(len(res.frames) * CALL_PERIOD_S, images, state))
        t0 = time.perf_counter()
        out = pipeline.call(images, state, env.instruction)
        # the working set's upkeep overlaps the chunk's execution on a robot (the cache manager's
        # own process); run in one process it is serial, so it is reported apart, not in the call
        res.call_s.append(time.perf_counter() - t0 - pipeline.last_times.get("upkeep", 0.0))
        res.calls += 1
        res.cached_calls += int(out.cached)
        for k, v in pipeline.last_times.items():
            res.phase_s.setdefault(k, []).append(float(v))
        choice = pipeline.last_choice
        if choice is not None and not choice.found:
            res.dense_reasons[choice.reason] = res.dense_reasons.get(choice.reason, 0) + 1
        res.references.append([choice.episode, choice.index, round(float(choice.similarity), 6)]
                              if choice is not None and choice.found else None)
        chunk = np.asarray(out.chunk)
        if not np.isfinite(chunk).all():    # never executed: the episode fails safely
            res.dense_reasons["non-finite chunk"] = res.dense_reasons.get("non-finite chunk", 0) + 1
            break
        for action in chunk[:n_execute, :ACTION_DIM]:
            step = env.step(action)
            res.steps += 1
            state = step.state
            res.success = res.success or step.success
            if step.done:
                if not (res.success and tail_calls > 0 and res.steps < env.cfg.max_steps):
                    done = True
                    break
                last_call = res.calls + tail_calls if last_call is None else last_call
    res.final_state = [float(x) for x in np.asarray(state).reshape(-1)]
    return res


def half_settings(caches: tuple[str, ...]) -> tuple[str, str]:
    """The cached mode's ``cache.context_cache`` / ``cache.action_cache``: forced on or off, so the
    success comparison is about the halves asked for, unless ``auto`` is asked for (then the
    pipeline decides at start-up as a robot's does, from the repository's recorded timing)."""
    if caches == (AUTO,):
        return AUTO, AUTO
    return ("on" if "context" in caches else "off"), ("on" if "action" in caches else "off")


def _pipeline(spec: EvalSpec, mode: str, repository: Path | None, tag: str, rho_p: float = DEFAULT_RHO_P):
    context, action = half_settings(spec.caches)
    cache = CacheSpec(enabled=mode == "cached", repository=str(repository) if repository else None,
                      rho_p=rho_p, context_cache=context, action_cache=action,
                      min_similarity=spec.min_similarity, first_scene_floor=spec.first_scene_floor,
                      max_end_matches=spec.max_end_matches)
    rings = RingNames.tagged(tag)
    seed = spec.seed + 1 if mode == "resampled" else spec.seed
    pspec = PipelineSpec(spec.checkpoint, spec.cameras, cache, spec.engine, rings, seed)
    return make_pipeline(pspec, spec.processes)


def record_references(spec: EvalSpec, log: Callable[[str], None],
                      progress: Progress = silent) -> tuple[list[Path], dict[str, int]]:
    """Dense episodes on the reference seeds; the successful ones are written as bags."""
    out = spec.out / "references"
    bags: list[Path] = []
    counts: dict[str, int] = {}
    topics = reference_topics(spec)
    with _pipeline(spec, "dense", None, f"evref{os.getpid()}") as pipeline, \
            progress("reference episodes (dense)", len(spec.tasks) * spec.reference_episodes, "episode") as bar:
        for task in spec.tasks:
            env = task_harness(spec, task, spec.reference_band)
            try:
                for i in range(spec.reference_episodes):
                    seed = spec.reference_seed + i
                    r = run_episode(env, pipeline, seed, spec.n_execute, record=True,
                                    tail_calls=spec.reference_tail_calls)
                    bar.set_postfix_str(f"{task} seed {seed} {'success' if r.success else 'failure'}; "
                                        f"{len(bags) + r.success} recorded", refresh=False)
                    bar.update()
                    if not r.success:
                        continue
                    path = out / f"{task}-{seed}"
                    if path.exists():
                        raise FileExistsError(f"{path} exists; choose an empty --out")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_episode_bag(path, Episode(f"{task}-{seed}", env.instruction, True, r.frames,
                                                    f"sim:metaworld:{task}:{seed}"), topics)
                    bags.append(path)
                    counts[task] = counts.get(task, 0) + 1
            finally:
                env.close()
    log(f"references: {len(bags)} successful dense episode(s) of {len(spec.tasks) * spec.reference_episodes} "
        f"recorded under {out}")
    return bags, counts


def reference_topics(spec: EvalSpec) -> BagTopics:
    """The topics of the demonstration bags (``sim.metaworld_env.bag_topics``, as
    ``training.metaworld_demos`` records them): references and demonstrations are the same kind
    of recording."""
    from ..sim.metaworld_env import bag_topics

    return bag_topics(spec.cameras)


def dataset_references(spec: EvalSpec, policy: Pi05Policy, log: Callable[[str], None]):
    """The episodes of ``spec.reference_dataset`` whose task is one evaluated, every frame a call
    (the export has one frame per recorded call), cameras under ``observation.images.<camera>``."""
    from ..io.dataset_features import FeatureMap
    from ..io.episode_sources import dataset_refs
    from ..io.lerobot_dataset import LeRobotDatasetReader
    from ..sim.metaworld_env import TASK_INSTRUCTIONS

    reader = LeRobotDatasetReader(spec.reference_dataset)
    features = FeatureMap(cameras={c: f"observation.images.{c}" for c in spec.cameras})
    features.check(reader, policy.state_dim, policy.action_norm.dim)
    wanted = {TASK_INSTRUCTIONS[t] for t in spec.tasks}
    refs = [r for r in dataset_refs(reader, features) if set(reader.episodes[r.index].tasks) & wanted]
    if not refs:
        raise ValueError(f"{spec.reference_dataset} has no episode of the evaluated tasks {list(spec.tasks)}")
    task_of = {TASK_INSTRUCTIONS[t]: t for t in spec.tasks}
    counts: dict[str, int] = {}
    for r in refs:
        for text in set(reader.episodes[r.index].tasks) & wanted:
            counts[task_of[text]] = counts.get(task_of[text], 0) + 1
    log(f"references from dataset {spec.reference_dataset}: {len(refs)} episode(s) at {reader.fps:g} fps")
    return refs, 1.0 / reader.fps, counts


def build_reference_repository(spec: EvalSpec, log: Callable[[str], None],
                               progress: Progress = silent) -> tuple[Path, dict[str, Any]]:
    """The repository of the cached mode and the ``rho_p`` to run it at.

    Built here, the ratios are profiled as ``build-cache --profile --adopt-profiled`` does (rMuscle
    profiles them per model): ``profile_episodes`` reference episodes per task are replayed
    against the others, dense and cached, and the cheapest grid point whose mean action deviation
    is within ``tolerance`` is used. The paper's default (0.4, 0.5) suits pi0.5 at full size; a
    small model can need more neurons. ``rho_p``/``rho_n`` given in the spec are used as they are.
    """
    if spec.repository is not None:
        meta = ReferenceRepository.open(spec.repository, verify=False).meta
        rho_p, rho_p_from = choose_rho_p(spec.rho_p, meta.half_timing)
        return spec.repository, {"repository": str(spec.repository), "built": False, "rho_p": rho_p, "rho_n": meta.rho_n,
                                 "mask_groups": meta.mask_groups,
                                 "ratios_from": f"the repository's masks, rho_p from {rho_p_from}"}
    policy = Pi05Policy.from_checkpoint(spec.checkpoint, camera_names=list(spec.cameras))
    if spec.reference_dataset is not None:
        refs, call_period, counts = dataset_references(spec, policy, log)
    else:
        bags, counts = record_references(spec, log, progress=progress)
        if not bags:
            raise RuntimeError("the dense policy succeeded in no reference episode: nothing to build a repository from")
        refs, call_period = bag_refs(bags, reference_topics(spec)), CALL_PERIOD_S
    repo = spec.out / "repository"
    mask_groups = even_groups(policy.engine.model.cfg.num_steps, spec.mask_groups)
    profile = spec.profile_episodes if spec.rho_n is None or spec.rho_p is None else 0
    summary = build_repository_from(policy, policy.checkpoint_hash, refs, repo, call_period,
                                    BuildConfig(rho_n=DEFAULT_RHO_N if spec.rho_n is None else spec.rho_n,
                                                groups=mask_groups),
                                    profile_held_out=profile, tolerance=spec.tolerance,
                                    adopt_profiled=spec.rho_n is None, log=log, progress=progress)
    log(build_summary(summary.as_dict()))
    rho_p = spec.rho_p if spec.rho_p is not None else summary.rho_p if summary.rho_p is not None else DEFAULT_RHO_P
    source = ("given" if not profile else "profiled on the reference episodes" if summary.profile
              else "defaults: too few reference episodes per task to profile")
    return repo, {"repository": str(repo), "built": True, "reference_successes": counts,
                  "reference_dataset": None if spec.reference_dataset is None else str(spec.reference_dataset),
                  "reference_episodes_per_task": spec.reference_episodes, "calls": summary.calls,
                  "rho_p": rho_p, "rho_n": summary.rho_n, "mask_groups": [list(g) for g in mask_groups],
                  "profile": summary.profile, "ratios_from": source}


SELECTION_CHECK_CALLS = CacheSpec.selection_check_calls   # the pipelines' (eval leaves the profile's default)


def _halves_dict(halves: ResolvedHalves) -> dict[str, Any]:
    return {"context_cache": halves.context_cache, "action_cache": halves.action_cache, "reason": halves.reason,
            "saving_s": halves.saving_s}


def auto_choice(spec: EvalSpec, repository: Path, rho_p: float, built: bool, log: Callable[[str], None],
                progress: Progress = silent) -> tuple[dict[str, Any], ResolvedHalves]:
    """What ``cache.context_cache: auto`` / ``action_cache: auto`` would run on this machine with
    this repository, and what a pipeline started with ``auto`` resolves it to (the same, unless
    the repository records no timing: the runtime then runs both halves, *unmeasured*).

    The decision reads the half timing the repository records (``build-cache --profile``, which
    the repository built here went through when it was profiled). When it records none, the
    halves are timed here the same way (``time_halves``) on the repository's own calls, and
    recorded in it when it was built here (a repository given with ``--repository`` is only read).
    """
    repo = ReferenceRepository.open(repository, verify=False)
    timing, source, recorded = repo.meta.half_timing, "recorded by build-cache --profile", True
    if timing is None:
        log("the repository records no half timing: timing each half against dense on its calls ...")
        policy = Pi05Policy.from_checkpoint(spec.checkpoint, camera_names=list(spec.cameras))
        timing = time_repository_halves(policy.engine.model, repo, rho_p, record=built, progress=progress)
        source = "timed by eval on the repository's calls" + (" (now recorded in it)" if built else "")
        recorded = built
    halves = resolve_halves(AUTO, AUTO, timing, rho_p)
    log(f"auto would run: {halves.reason}")
    if halves.saving_s is not None:
        log(f"auto's halves save {1e3 * halves.saving_s:.2f} ms a call by that timing; a pipeline started with auto "
            f"runs dense after its first {SELECTION_CHECK_CALLS} calls if choosing a reference cost them "
            "more (cache.selection_check_calls)")
    runtime = halves if recorded else resolve_halves(AUTO, AUTO, None, rho_p)
    return {**_halves_dict(halves), "half_timing": timing.as_dict(), "timing_source": source}, runtime


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` (None: left as they are) for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def aggregate(results: list[EpisodeResult], cached: bool) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    calls = sum(r.calls for r in results)
    fallback = 1 - sum(r.cached_calls for r in results) / calls if calls and cached else None
    # the call rate is dominated by failing episodes, which run to the step limit: also say how
    # many episodes ran any call dense, and how much of the successful episodes ran dense
    ok_calls = sum(r.calls for r in ok)
    fallback_ok = 1 - sum(r.cached_calls for r in ok) / ok_calls if ok_calls and cached else None
    phases = sorted({k for r in results for k in r.phase_s})
    return {"episodes": len(results), "successes": len(ok), "success_rate": len(ok) / len(results) if results else None,
            "mean_calls_per_success": _mean([float(r.calls) for r in ok]),
            "mean_steps_per_success": _mean([float(r.steps) for r in ok]),
            "calls": calls, "cached_calls": sum(r.cached_calls for r in results),
            "fallback_rate": fallback, "fallback_rate_in_successes": fallback_ok,
            "episodes_with_fallback": sum(r.cached_calls < r.calls for r in results) if cached else None,
            "mean_call_s": _mean([s for r in results for s in r.call_s]),
            "mean_phase_s": {p: _mean([s for r in results for s in r.phase_s.get(p, [])]) for p in phases},
            "policy_s_per_success": _mean([sum(r.call_s) for r in ok]),
            "mean_episode_start_s": _mean([r.start_s for r in results])}


def evaluate(spec: EvalSpec, log: Callable[[str], None] = print, progress: Progress = silent) -> dict[str, Any]:
    """Run the evaluation and write ``eval.json``, ``eval.md`` and ``eval.png`` into ``spec.out``.

    ``log`` gets the few lines worth keeping (what the repository holds, what ``auto`` would
    run); ``progress`` one bar per phase: the reference episodes, the repository build's
    phases, and the evaluation episodes (its postfix: the latest episode, the successes so far).
    """
    spec.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"checkpoint": str(spec.checkpoint), "tasks": list(spec.tasks),
                              "episodes_per_task": spec.episodes, "eval_seeds": [spec.eval_seed, spec.eval_seed + spec.episodes],
                              "pose_band": list(spec.pose_band), "reference_band": list(spec.reference_band),
                              "n_execute": spec.n_execute, "max_steps": spec.max_steps, "processes": spec.processes,
                              "caches": list(spec.caches), "min_similarity": spec.min_similarity,
                              "first_scene_floor": spec.first_scene_floor, "max_end_matches": spec.max_end_matches,
                              "reference_tail_calls": spec.reference_tail_calls, "modes": {}}
    repository = None
    if "cached" in spec.modes:
        # built and timed at the pipeline's thread count, so the halves' timing is the pipeline's
        with _torch_threads(spec.engine.threads):
            repository, report["repository"] = build_reference_repository(spec, log, progress)
            report["auto"], runtime = auto_choice(spec, repository, report["repository"]["rho_p"],
                                                  report["repository"]["built"], log, progress)
            if spec.caches == (AUTO,):   # what the pipeline's own start-up resolves
                report["cached_halves"] = _halves_dict(runtime)
                log(f"the cached mode runs (auto): {runtime.reason}")
        if spec.first_scene_floor:
            report["repository"]["first_call_floors"] = first_call_floors(ReferenceRepository.open(repository))
    per_episode: dict[str, list[EpisodeResult]] = {m: [] for m in spec.modes}
    # Every mode runs each (task, seed) in turn, one right after the other, so a load that comes
    # and goes on the machine slows both modes alike and the speed ratio stays side by side; which
    # mode goes first alternates from seed to seed (``mode_order``), so neither gains from its place.
    with contextlib.ExitStack() as stack:
        rho_p = report.get("repository", {}).get("rho_p", DEFAULT_RHO_P)
        pipelines = {m: stack.enter_context(_pipeline(spec, m, repository, f"ev{m}{os.getpid()}", rho_p))
                     for m in spec.modes}
        bar = stack.enter_context(progress(f"evaluation ({', '.join(spec.modes)} in turn)",
                                           len(spec.tasks) * spec.episodes * len(spec.modes), "episode"))
        for task in spec.tasks:
            env = task_harness(spec, task, spec.pose_band)
            try:
                for i in range(spec.episodes):
                    for mode in mode_order(spec.modes, i):
                        pipeline = pipelines[mode]
                        r = run_episode(env, pipeline, spec.eval_seed + i, spec.n_execute)
                        per_episode[mode].append(r)
                        done = [x for x in per_episode[mode] if x.task == task]
                        bar.set_postfix_str(
                            f"{mode} {task} {len(done)}/{spec.episodes} {'success' if r.success else 'failure'}; "
                            "successes " + ", ".join(f"{m} {sum(x.success for x in rs)}/{len(rs)}"
                                                     for m, rs in per_episode.items()), refresh=False)
                        bar.update()
            finally:
                env.close()
    for mode, results in per_episode.items():
        cached = mode == "cached"
        report["modes"][mode] = {"overall": aggregate(results, cached),
                                 "per_task": {t: aggregate([r for r in results if r.task == t], cached)
                                              for t in spec.tasks}}
    if {"dense", "cached"} <= set(spec.modes):
        report["comparison"] = compare(report["modes"]["dense"], report["modes"]["cached"], spec.tasks)
        report["comparison"]["paired"] = paired_by_task(per_episode["dense"], per_episode["cached"], spec.tasks)
        report["comparison"]["by_seed"] = speed_by_seed(per_episode["dense"], per_episode["cached"])
    if {"dense", "resampled"} <= set(spec.modes):   # how much other noise alone changes, for scale
        report["noise_baseline"] = paired_by_task(per_episode["dense"], per_episode["resampled"], spec.tasks)
    report["wall_s"] = time.perf_counter() - t0
    report["episodes"] = {m: [r.summary() for r in rs] for m, rs in per_episode.items()}
    (spec.out / "eval.json").write_text(json.dumps(report, indent=2, default=float))
    (spec.out / "eval.md").write_text(table(report))
    plot(report, spec.out / "eval.png")
    return report


def mode_order(modes: tuple[str, ...], episode: int) -> tuple[str, ...]:
    """The order the modes run the ``episode``-th seed in: as given on even seeds, reversed on odd
    ones. A mode always run second could gain or lose from its place (caches warm, a core just
    woken): with dense always first, the vision tower, the same work in both modes, measured 1.03x
    faster in the cached runs of 150 seeds. Alternating cancels what of that the order causes."""
    return modes if episode % 2 == 0 else modes[::-1]


def same_seeds(dense: list[EpisodeResult], other: list[EpisodeResult]) -> list[tuple[EpisodeResult, EpisodeResult]]:
    """(dense, other) episode pairs of the same task and seed, in ``other``'s order."""
    by_key = {(r.task, r.seed): r for r in dense}
    return [(by_key[(o.task, o.seed)], o) for o in other if (o.task, o.seed) in by_key]


def speed_by_seed(dense: list[EpisodeResult], other: list[EpisodeResult]) -> dict[str, Any]:
    """Dense against another mode's call time seed by seed: for each seed both ran, the dense
    episode's mean call time over the other's, then the median of those ratios with its
    distribution-free 95 % interval (``median_interval``). The two episodes of a seed ran one right
    after the other, so a machine that slows down and speeds up over the run moves both alike,
    which the ratio of the two modes' overall means does not cancel.

    The vision phase does the same work in both modes: its ratio, taken the same way, is the
    control, and shows how far the machine alone moves a ratio between the two runs of a seed."""
    calls, vision = [], []
    for d, o in same_seeds(dense, other):
        if not d.call_s or not o.call_s:
            continue
        calls.append(statistics.fmean(d.call_s) / statistics.fmean(o.call_s))
        if d.phase_s.get("vision") and o.phase_s.get("vision"):
            vision.append(statistics.fmean(d.phase_s["vision"]) / statistics.fmean(o.phase_s["vision"]))

    def figure(ratios: list[float]) -> dict[str, Any] | None:
        if not ratios:
            return None
        median, low, high = median_interval(ratios)
        return {"pairs": len(ratios), "median": median, "interval95": None if low is None else [low, high]}
    return {"per_call": figure(calls), "vision": figure(vision)}


def compare(dense: dict, cached: dict, tasks: tuple[str, ...]) -> dict[str, Any]:
    """Cached against dense on the same seeds: success difference and speed-ups."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    d, c = dense["overall"], cached["overall"]
    return {"success_points": 100 * ((c["success_rate"] or 0) - (d["success_rate"] or 0)),
            "speedup_per_call": ratio(d["mean_call_s"], c["mean_call_s"]),
            "speedup_policy_time_per_success": ratio(d["policy_s_per_success"], c["policy_s_per_success"]),
            "speedup_per_phase": {p: ratio(d["mean_phase_s"].get(p), c["mean_phase_s"].get(p))
                                  for p in d["mean_phase_s"] if p != "upkeep"},
            "cached_overheads_s": {**{p: c["mean_phase_s"][p] for p in ("select", "upkeep") if p in c["mean_phase_s"]},
                                   "episode_start": c["mean_episode_start_s"]},
            "per_task_success_points": {t: 100 * ((cached["per_task"][t]["success_rate"] or 0)
                                                  - (dense["per_task"][t]["success_rate"] or 0)) for t in tasks},
            "fallback_rate": c["fallback_rate"], "fallback_rate_in_successes": c["fallback_rate_in_successes"],
            "episodes_with_fallback": c["episodes_with_fallback"]}


def paired(dense: list[EpisodeResult], other: list[EpisodeResult]) -> dict[str, Any]:
    """Success of dense and another mode seed by seed: which episodes only one of them solved, and
    the other-minus-dense difference with the standard error of a paired difference (the pose and,
    for the cache, the noise are shared, so only the discordant seeds carry information)."""
    matched = same_seeds(dense, other)
    pairs = [(d.success, o.success) for d, o in matched]
    n = len(pairs)
    dense_only = sum(d and not o for d, o in pairs)
    other_only = sum(o and not d for d, o in pairs)
    diff = (other_only - dense_only) / n if n else None
    se = None
    if n > 1:   # sample variance of the per-seed differences (each -1, 0 or +1)
        var = ((dense_only + other_only) / n - diff ** 2) * n / (n - 1)
        se = (max(var, 0.0) / n) ** 0.5
    return {"pairs": n, "both": sum(d and o for d, o in pairs), "dense_only": dense_only, "other_only": other_only,
            "neither": sum(not d and not o for d, o in pairs),
            "identical_episodes": sum(d.steps == o.steps and d.final_state == o.final_state for d, o in matched),
            "difference_points": None if diff is None else 100 * diff,
            "standard_error_points": None if se is None else 100 * se,
            "interval95_points": None if se is None else [100 * (diff - 1.96 * se), 100 * (diff + 1.96 * se)]}


def paired_by_task(dense: list[EpisodeResult], other: list[EpisodeResult], tasks: tuple[str, ...]) -> dict[str, Any]:
    return {"overall": paired(dense, other),
            "per_task": {t: paired([r for r in dense if r.task == t], [r for r in other if r.task == t]) for t in tasks}}


def load_episodes(run: Path, mode: str) -> tuple[dict[str, Any], list[EpisodeResult]]:
    """An ``eval`` run's report and its episodes of ``mode``, read back from ``eval.json``."""
    path = Path(run) / "eval.json"
    if not path.is_file():
        raise ValueError(f"{run}: no eval.json (not an eval output folder)")
    report = json.loads(path.read_text())
    if mode not in report.get("episodes", {}):
        raise ValueError(f"{run}: no {mode!r} episodes (modes run: {sorted(report.get('episodes', {}))})")
    names = {f.name for f in dataclasses.fields(EpisodeResult)}
    return report, [EpisodeResult(**{k: v for k, v in e.items() if k in names}) for e in report["episodes"][mode]]


def pool(dense_runs: list[Path], other_runs: list[Path] | None = None, other_mode: str = "cached") -> dict[str, Any]:
    """Dense against another mode seed by seed over several ``eval`` runs of one checkpoint, e.g.
    more seeds run side by side (``--eval-seed``), or dense on other noise (``--seed 1``, mode
    dense) as the scale. ``other_runs`` defaults to the dense runs themselves; then the call time
    is compared seed by seed too (``speed_by_seed``: within one run the two episodes of a seed ran
    one after the other; across runs they did not, so no speed is compared there)."""
    def gather(runs: list[Path], mode: str) -> tuple[set[str], list[str], list[EpisodeResult]]:
        checkpoints, tasks, episodes = set(), [], []
        for run in runs:
            report, eps = load_episodes(run, mode)
            checkpoints.add(report["checkpoint"])
            tasks += [t for t in report["tasks"] if t not in tasks]
            episodes += eps
        keys = [(e.task, e.seed) for e in episodes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{mode} episodes of the same task and seed appear twice: each seed may be pooled once")
        return checkpoints, tasks, episodes

    if not dense_runs:
        raise ValueError("at least one eval run is needed")
    ck_d, tasks, dense = gather(dense_runs, "dense")
    ck_o, _, other = gather(other_runs or dense_runs, other_mode)
    if len(ck_d | ck_o) != 1:
        raise ValueError(f"the runs evaluated different checkpoints {sorted(ck_d | ck_o)}: not comparable")
    return {"checkpoint": ck_d.pop(), "tasks": tasks, "other_mode": other_mode,
            "dense": {"episodes": len(dense), "successes": sum(e.success for e in dense)},
            "other": {"episodes": len(other), "successes": sum(e.success for e in other)},
            "paired": paired_by_task(dense, other, tuple(tasks)),
            "by_seed": speed_by_seed(dense, other) if other_runs is None else None}


def pool_table(pooled: dict[str, Any]) -> str:
    d, o, mode = pooled["dense"], pooled["other"], pooled["other_mode"]
    speed = _by_seed_text(pooled.get("by_seed"))
    return (f"dense {d['successes']}/{d['episodes']}, {mode} {o['successes']}/{o['episodes']}"
            + (f"; call time dense over {mode}, {speed}" if speed else "") + "\n\n"
            + paired_table(pooled["tasks"], pooled["paired"], mode))


def _fmt(x: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if x is None else pattern.format(x)


def success_table(report: dict[str, Any]) -> str:
    """Success, calls per success, call time (and the cached mode's fallback) per task and overall."""
    modes = report["modes"]

    def columns(m: str) -> list[str]:
        return [f"{m} success", f"{m} calls/success", f"{m} ms/call"] + (["fallback"] if m == "cached" else [])

    header = [c for m in modes for c in columns(m)]
    rows = ["| task | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for task in [*report["tasks"], "overall"]:
        cells = []
        for m in modes:
            a = modes[m]["overall"] if task == "overall" else modes[m]["per_task"][task]
            cells += [f"{a['successes']}/{a['episodes']} ({_fmt(a['success_rate'], '{:.0%}')})",
                      _fmt(a["mean_calls_per_success"], "{:.1f}"), _fmt(a["mean_call_s"] and 1e3 * a["mean_call_s"], "{:.1f}")]
            if m == "cached":
                cells.append(_fmt(a["fallback_rate"], "{:.0%}"))
        rows.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _ms(x: float | None) -> str:
    return _fmt(None if x is None else 1e3 * x, "{:.1f} ms")


def reading(report: dict[str, Any]) -> str:
    """One paragraph that reads the success table for the user, every figure taken from the report.

    What the paired interval allows one to conclude at this number of seeds; the call time;
    and why the cache gains what it gains here: the time of the two phases it shortens
    (prefill, denoise) against what it saved there and what selecting a reference adds to
    each call, with the profile's FLOP count of a cached call when the repository was profiled.
    """
    modes = report["modes"]
    d = modes["dense"]["overall"] if "dense" in modes else None
    c = modes["cached"]["overall"] if "cached" in modes else None
    per_task = report["episodes_per_task"]
    if d is None or c is None or "comparison" not in report:
        m = next(iter(modes))
        a = modes[m]["overall"]
        return (f"The {m} policy succeeded on {a['successes']} of {a['episodes']} episodes ({per_task} per task) "
                f"at {_ms(a['mean_call_s'])} per policy call.")
    comp = report["comparison"]
    pr = comp["paired"]["overall"]
    parts = [f"On the same {pr['pairs']} seeds ({per_task} per task) dense solved {d['successes']} and cached "
             f"{c['successes']}; {pr['dense_only'] + pr['other_only']} seed(s) ended differently "
             f"({pr['dense_only']} solved only dense, {pr['other_only']} only cached)."]
    ci = pr["interval95_points"]
    if ci is not None and ci[0] <= 0 <= ci[1]:
        half = (ci[1] - ci[0]) / 2
        parts.append(f"The difference, {pr['difference_points']:+.0f} points (95 % interval {ci[0]:+.0f} to "
                     f"{ci[1]:+.0f}), is within chance: "
                     + (f"at {pr['pairs']} seeds only an effect of about {half:.0f} points or more would show "
                        "(more episodes narrow the interval)." if half > 0 else
                        "every seed ended alike in both modes, which says little at this number of seeds."))
    elif ci is not None:
        parts.append(f"The difference, {pr['difference_points']:+.0f} points with a 95 % interval of {ci[0]:+.0f} "
                     f"to {ci[1]:+.0f}, is larger than chance at these {pr['pairs']} seeds.")
    by_seed = _by_seed_text(comp.get("by_seed"))
    parts.append(f"A cached call took {_ms(c['mean_call_s'])} against {_ms(d['mean_call_s'])} dense "
                 f"({_fmt(comp['speedup_per_call'])}x{'; ' + by_seed if by_seed else ''}), "
                 f"{_fmt(c['fallback_rate'], '{:.0%}')} of its calls ran dense (fallback).")
    dp, cp = d["mean_phase_s"], c["mean_phase_s"]
    if all(p in dp and p in cp for p in ("prefill", "denoise")) and d["mean_call_s"]:
        shortened = dp["prefill"] + dp["denoise"]
        saved = shortened - cp["prefill"] - cp["denoise"]
        select = cp.get("select", 0.0)
        text = (f"The cache shortens only the prefill and the denoising, {_ms(shortened)} of a dense call "
                f"({shortened / d['mean_call_s']:.0%}); it {'saved' if saved >= 0 else 'added'} "
                f"{_ms(abs(saved))} there, and choosing the reference holds a call that chooses one up {_ms(select)} "
                "after the vision tower")
        repo = report.get("repository", {})
        point = next((p for p in repo.get("profile") or [] if (p["rho_p"], p["rho_n"]) ==
                      (repo.get("rho_p"), repo.get("rho_n"))), None)
        if point is not None and point["hits"]:
            ideal = 1 / point["flops_fraction"]
            text += (f"; by the profile's FLOP count a cached call at rho_p {point['rho_p']:g}, rho_n "
                     f"{point['rho_n']:g} needs {point['flops_fraction']:.0%} of a dense call's work ({ideal:.2f}x "
                     f"at best) and measured {point['median_speedup']:.2f}x when profiled"
                     + (": at this size picking out the rows and neurons to skip, and reading the Action Cache's "
                        "compact copies of their weights, costs much of what skipping them saves"
                        if point["median_speedup"] < ideal else ""))
        # the selection runs beside the vision tower: what it takes from the tower shows in the vision phase
        beside = cp.get("vision", 0.0) - dp.get("vision", 0.0)
        net = saved - select - beside
        text += (f"; the vision phase took {_ms(abs(beside))} {'longer' if beside >= 0 else 'less'} than dense"
                 f". Net, the cache {'saves' if net > 0 else 'costs'} {_ms(abs(net))} per call here; it saves "
                 "feed-forward work, which grows with the model's width (full-width figures: docs/cache.md).")
        parts.append(text)
    if (auto := report.get("auto")) is not None:
        on = [h.replace("_", " ") for h in ("context_cache", "action_cache") if auto[h]]
        text = (f"With the profile's `auto`, this machine would run {' and '.join(on) if on else 'neither half'} "
                "(each half timed against dense on the repository's calls)")
        select, served = c["mean_phase_s"].get("select"), 1 - (c["fallback_rate"] or 0.0)
        if auto.get("saving_s") is not None and select is not None:
            verdict = ("keep it" if selection_pays(auto["saving_s"], served, select)
                       else f"run dense after its first {SELECTION_CHECK_CALLS} calls")
            text += (f"; they save {_ms(auto['saving_s'])} a call where a reference serves it ({served:.0%} of "
                     f"the calls here) and choosing one cost {_ms(select)}, so by this run a pipeline with "
                     f"`auto` would {verdict} (it decides on its own first calls: cache.selection_check_calls)")
        parts.append(text + ".")
    return " ".join(parts)


def _by_seed_text(by_seed: dict[str, Any] | None) -> str:
    """'seed by seed 1.02x (95 % interval 1.01-1.04) over 150 seeds, the vision phase (the same
    work in both) 1.00x (...)', or '' for a report without the figure."""
    def one(f: dict[str, Any]) -> str:
        ci = f["interval95"]
        return f"{f['median']:.2f}x" + ("" if ci is None else f" (95 % interval {ci[0]:.2f}-{ci[1]:.2f})")
    if not by_seed or by_seed.get("per_call") is None:
        return ""
    text = f"seed by seed {one(by_seed['per_call'])} over {by_seed['per_call']['pairs']} seeds"
    if by_seed.get("vision") is not None:
        text += f", the vision phase (the same work in both) {one(by_seed['vision'])}"
    return text


def summary(report: dict[str, Any], out: Path) -> str:
    """What ``vla-runtime eval`` prints: the table, the paragraph reading it, where the files are."""
    return (success_table(report) + "\n" + textwrap.fill(reading(report), 100, break_on_hyphens=False) + "\n\n"
            f"details (ratios, fallback rule, seed by seed): {out / 'eval.md'}\n"
            f"every episode and aggregate (JSON): {out / 'eval.json'}\n"
            f"plot (success per task, latency per phase): {out / 'eval.png'}\n")


def table(report: dict[str, Any]) -> str:
    """``eval.md``: the success table, its reading, then the comparison's details."""
    modes = report["modes"]
    repo = report.get("repository", {})
    text = success_table(report) + "\n" + reading(report) + "\n"
    if "comparison" in report:
        c = report["comparison"]
        phases = ", ".join(f"{k} {_fmt(v)}x" for k, v in sorted(c["speedup_per_phase"].items()))
        text += (f"\ncached vs dense: success {c['success_points']:+.1f} points, speed-up per call "
                 f"{_fmt(c['speedup_per_call'])}x ({phases}), policy time per success "
                 f"{_fmt(c['speedup_policy_time_per_success'])}x, "
                 f"fallback rate {_fmt(c['fallback_rate'], '{:.0%}')} of the calls "
                 f"({_fmt(c.get('fallback_rate_in_successes'), '{:.0%}')} in successful episodes; "
                 f"{c.get('episodes_with_fallback')} of {report['modes']['cached']['overall']['episodes']} episodes "
                 f"ran a call dense); outside the calls: episode start "
                 f"{_fmt(c['cached_overheads_s'].get('episode_start') and 1e3 * c['cached_overheads_s']['episode_start'], '{:.0f}')} ms"
                 f" per episode, window upkeep {_fmt(c['cached_overheads_s'].get('upkeep') and 1e3 * c['cached_overheads_s']['upkeep'], '{:.0f}')}"
                 " ms per call (overlapping the chunk's execution on a robot)\n")
    if "cached" in modes:
        if "rho_p" in repo:
            groups = repo.get("mask_groups")
            groups_text = "" if not groups else f", Action Cache mask groups {' '.join(f'{a}-{b}' for a, b in groups)}"
            text += (f"\nratios of the cached mode: rho_p {repo['rho_p']:g}, rho_n {repo['rho_n']:g}{groups_text} "
                     f"({repo['ratios_from']})\n")
        auto = report.get("auto")
        if (halves := report.get("cached_halves")) is not None:
            text += (f"\nthe cached mode runs what `auto` picks at the pipeline's start-up, as on a robot: "
                     f"{_auto_line(halves)}\n")
        elif auto is not None:
            text += (f"\nthe cached mode forces the halves it runs ({', '.join(report.get('caches', []))}); with "
                     f"`auto` on this machine the runtime would run: {_auto_line(auto)} "
                     f"(timing {auto['timing_source']})\n")
        rule = fallback_rule(report.get("min_similarity", 0.8), repo.get("first_call_floors"),
                             report.get("max_end_matches", 0))
        text += f"\nfallback to dense for the rest of an episode: {rule}\n"
    if "comparison" in report:
        c = report["comparison"]
        if (pr := c.get("paired")) is not None:
            text += ("\nseed by seed (both modes drew the same noise on each seed; an identical episode took "
                     "the same steps to the same final state):\n\n" + paired_table(report["tasks"], pr, "cached"))
    if (nb := report.get("noise_baseline")) is not None:
        text += ("\nfor scale, the dense policy against itself drawing other noise (mode resampled, seed "
                 "+1), seed by seed: how many outcomes other noise alone changes\n\n"
                 + paired_table(report["tasks"], nb, "resampled"))
    refs = repo.get("reference_successes")
    if refs is not None and (missing := [t for t in report["tasks"] if not refs.get(t)]):
        one = len(missing) == 1
        text += (f"\nno reference episode succeeded for {', '.join(missing)}: the repository has nothing for "
                 f"{'it' if one else 'them'}, so {'its' if one else 'their'} cached episodes ran dense (fallback)\n")
    return text


def _auto_line(auto: dict[str, Any]) -> str:
    on = [h for h in ("context_cache", "action_cache") if auto[h]]
    picked = " and ".join(h.replace("_", " ") for h in on) if on else "neither half (dense)"
    return f"{picked}; {auto['reason']}"


def paired_table(tasks: list[str], pr: dict[str, Any], other: str) -> str:
    """Dense against ``other`` seed by seed: same pose and, for the cache, same noise, so a
    difference is the cache's doing (or chance once the trajectories part)."""
    rows = [f"| task | both | dense only | {other} only | neither | identical episodes | {other} - dense (95 % interval) |",
            "|---|---|---|---|---|---|---|"]
    for task in [*tasks, "overall"]:
        a = pr["overall"] if task == "overall" else pr["per_task"][task]
        ci = a["interval95_points"]
        diff = _fmt(a["difference_points"], "{:+.1f}") + ("" if ci is None else f" ({ci[0]:+.1f} to {ci[1]:+.1f})")
        rows.append(f"| {task} | {a['both']} | {a['dense_only']} | {a['other_only']} | {a['neither']} | "
                    f"{a['identical_episodes']}/{a['pairs']} | {diff} |")
    return "\n".join(rows) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    tasks = list(report["tasks"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(modes)
    for k, m in enumerate(modes):
        rates = [report["modes"][m]["per_task"][t]["success_rate"] or 0 for t in tasks]
        ax1.bar(np.arange(len(tasks)) + k * width, rates, width, label=m)
    ax1.set_xticks(np.arange(len(tasks)) + width * (len(modes) - 1) / 2, [t.removesuffix("-v3") for t in tasks],
                   rotation=30, ha="right")
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("success rate")
    ax1.legend()
    # the window upkeep is not part of a call (it overlaps the chunk's execution on a robot): noted, not stacked
    phases = sorted({p for m in modes for p in report["modes"][m]["overall"]["mean_phase_s"]} - {"upkeep"})
    bottom = np.zeros(len(modes))
    for p in phases:
        vals = np.array([1e3 * (report["modes"][m]["overall"]["mean_phase_s"].get(p) or 0) for m in modes])
        ax2.bar(modes, vals, bottom=bottom, label=p)
        bottom += vals
    for k, m in enumerate(modes):
        if upkeep := report["modes"][m]["overall"]["mean_phase_s"].get("upkeep"):
            ax2.annotate(f"+{1e3 * upkeep:.0f} ms upkeep\nbetween calls", (k, bottom[k]), ha="center", va="bottom",
                         fontsize=8)
    ax2.set_ylim(0, 1.25 * max(bottom.max(), 1e-3))
    ax2.set_ylabel("mean ms per policy call")
    ax2.legend()
    noise = "; dense and cached on the same noise" if "cached" in modes else ""
    fig.suptitle(f"closed loop, {report['episodes_per_task']} episodes per task, same seeds{noise}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
