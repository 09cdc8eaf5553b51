"""``vla-runtime bench --cache``: dense vs cached, side by side, on the same recorded episodes.

Every call of every held-out episode runs twice on the same inputs and noise: once through the
dense engine, once through the cached engine with the cache manager choosing the reference
(retrieval, sliding window, fallback). Window reconstruction runs between calls, as it would
while the robot executes a chunk; it is timed and reported separately, not in call latency.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.builder import model_summary
from ..cache.halves import choose_rho_p
from ..cache.manager import CacheManager, ManagerConfig, PrepareReport
from ..cache.repository import ReferenceRepository, RepositoryError
from ..cache.retrieval import RetrievalConfig
from ..engine.cached import CacheConfig, CachedEngine
from ..engine.dense import EngineOutput
from ..engine.policy import Observation, Pi05Policy
from ..io.bags import BagTopics, list_episode_bags
from ..io.episode_sources import bag_refs
from ..progress import Progress, silent

PHASES = ("vision", "retrieve", "prefill", "denoise", "total")


@dataclass
class CacheBenchSpec:
    checkpoint: str
    repository: str
    bags: str | None = None
    cameras: dict[str, str] = field(default_factory=dict)
    call_period: float = 0.5
    rho_p: float | None = None      # None: the repository's profiled fraction
    time_available_s: float = 1.0
    threads: int | None = None
    seed: int = 0
    joint_states: str = "/joint_states"
    instruction: str = "/instruction"
    arm_slices: tuple[tuple[int, int], ...] = ()
    dataset: str | None = None       # a LeRobot dataset instead of bags (then cameras come from features)
    episodes: str | None = None      # with dataset: the selection, e.g. "40-49"
    features: tuple[str, ...] = ()   # with dataset: MODEL_KEY=DATASET_KEY overrides
    extra: dict = field(default_factory=dict)

    def dataset_refs(self):
        """The policy and the selected dataset episodes (features from the checkpoint + overrides)."""
        from ..io.episode_sources import open_dataset

        return open_dataset(self.dataset, self.checkpoint, None, self.features, self.episodes)


@dataclass
class SideBySide:
    """One call run dense and cached on the same inputs and noise, then the window's upkeep."""

    dense: EngineOutput
    cached: EngineOutput
    reason: str | None          # why the cached engine ran dense (None on a hit)
    prepare: PrepareReport

    @property
    def hit(self) -> bool:
        return self.cached.reference is not None


def side_by_side(policy: Pi05Policy, cached: CachedEngine, manager: CacheManager, obs: Observation, noise: torch.Tensor,
                 time_available_s: float) -> SideBySide:
    """Dense, then cached with the manager choosing the reference; the window slides after the
    call as it would while the robot executes the chunk (timed in ``prepare``, not in the call)."""
    inputs = policy.prepare(obs)
    manager.observe_state(torch.as_tensor(obs.state))
    d = policy.engine.infer(inputs, noise=noise)
    c = cached.infer(inputs, noise=noise, select=manager.select)
    reason = None if c.reference is not None else (manager.retriever.reason or "no prepared entry")
    return SideBySide(d, c, reason, manager.prepare(time_available_s))


def cache_engines(policy: Pi05Policy, repository: str | Path, rho_p: float | None, time_available_s: float,
                  arm_slices: tuple[tuple[int, int], ...] = ()) -> tuple[CacheManager, CachedEngine, ReferenceRepository]:
    """The manager and cached engine over ``repository``, refused unless it was built for this
    checkpoint; ``rho_p`` None: the repository's profiled fraction (``choose_rho_p``)."""
    model = policy.engine.model
    try:
        repo = ReferenceRepository.open(repository, expect_checkpoint_hash=policy.checkpoint_hash,
                                        expect_model=model_summary(model.cfg))
    except RepositoryError as e:
        raise RepositoryError(f"cannot use the repository, nothing to compare against dense: {e}") from None
    mcfg = ManagerConfig(retrieval=RetrievalConfig(history_len=repo.meta.history_len, arm_slices=arm_slices),
                         default_time_available_s=time_available_s)
    cache_cfg = CacheConfig(rho_p=choose_rho_p(rho_p, repo.meta.half_timing)[0], rho_n=repo.meta.rho_n,
                            groups=tuple(tuple(g) for g in repo.meta.mask_groups))
    return CacheManager(model, repo, mcfg), CachedEngine(model, cache_cfg), repo


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_cache_bench(spec: CacheBenchSpec, log=print, progress: Progress = silent) -> dict:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    load_before = os.getloadavg()
    if spec.dataset:
        policy, refs = spec.dataset_refs()
    else:
        policy = Pi05Policy.from_checkpoint(spec.checkpoint, camera_names=list(spec.cameras))
        topics = BagTopics(cameras=spec.cameras, joint_states=spec.joint_states, instruction=spec.instruction)
        refs = bag_refs(list_episode_bags(spec.bags), topics)
    manager, cached, repo = cache_engines(policy, spec.repository, spec.rho_p, spec.time_available_s, spec.arm_slices)

    dense_t: dict[str, list[float]] = {p: [] for p in PHASES}
    cached_t: dict[str, list[float]] = {p: [] for p in PHASES}
    hit_dense: dict[str, list[float]] = {p: [] for p in PHASES}
    hit_cached: dict[str, list[float]] = {p: [] for p in PHASES}
    devs, prep_s, initial_s, reasons = [], [], [], {}
    calls = hits = 0
    for k, ref in enumerate(refs, start=1):
        episode = ref.load(spec.call_period, state_dim=policy.state_dim)
        t0 = time.perf_counter()
        manager.start_episode(episode.task)
        initial_s.append(time.perf_counter() - t0)
        log(f"[{k}/{len(refs)}] {ref.label}: {len(episode.frames)} calls, initial window "
            f"{len(manager.entries)} entries in {initial_s[-1]:.1f} s")
        bar = progress(f"{ref.label} dense and cached", len(episode.frames), "call")
        for i, frame in enumerate(episode.frames):
            bar.update()
            noise = policy.engine.make_noise(1, torch.Generator().manual_seed(spec.seed + 1000 * k + i))
            obs = Observation(frame.images, frame.state, frame.instruction or episode.task)
            r = side_by_side(policy, cached, manager, obs, noise, spec.time_available_s)
            d, c = r.dense, r.cached
            calls += 1
            for p in PHASES:
                dt = d.times.as_dict().get(p, 0.0)
                ct = c.times.as_dict().get(p, 0.0)
                dense_t[p].append(dt)
                cached_t[p].append(ct)
                if r.hit:
                    hit_dense[p].append(dt)
                    hit_cached[p].append(ct)
            if r.hit:
                hits += 1
                devs.append(float((c.actions - d.actions).norm() / d.actions.norm().clamp_min(1e-12)))
            else:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
            prep_s.append(r.prepare.seconds)
            bar.set_postfix_str(f"cached {hits}/{calls}", refresh=False)
        bar.close()

    def med(t: dict[str, list[float]]) -> dict[str, float]:
        return {p: _median(v) for p, v in t.items()}

    dm, cm, hdm, hcm = med(dense_t), med(cached_t), med(hit_dense), med(hit_cached)
    speed = {p: dm[p] / cm[p] for p in ("vision", "prefill", "denoise", "total") if cm[p] > 0}
    hit_speed = {p: hdm[p] / hcm[p] for p in ("vision", "prefill", "denoise", "total") if hcm.get(p, 0) > 0}
    stats = manager.retriever.stats
    return {
        "spec": {**{k: v for k, v in spec.__dict__.items() if k != "extra"}, "rho_n": repo.meta.rho_n,
                 "rho_p": cached.cache.rho_p},
        "checkpoint_hash": policy.checkpoint_hash,
        "calls": calls, "cached_calls": hits, "hit_rate": hits / calls if calls else 0.0,
        "dense_reasons": reasons,
        "median_s": {"dense": dm, "cached": cm},
        "speedup": speed,
        "median_s_cached_calls_only": {"dense": hdm, "cached": hcm},
        "speedup_cached_calls_only": hit_speed,
        "deviation": {"mean_relative_l2": statistics.fmean(devs) if devs else None,
                      "worst_relative_l2": max(devs) if devs else None},
        "window": {"initial_prepare_s": initial_s, "median_prepare_between_calls_s": _median(prep_s),
                   "max_prepare_between_calls_s": max(prep_s) if prep_s else None},
        "retrieval": {"queries": stats.queries, "hits": stats.hits, "fallbacks": stats.fallbacks,
                      "stalls": stats.stalls},
        "memory": manager.memory_report() | {"action_cache_buffers_bytes": cached.buffers.nbytes()},
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        **spec.extra,
    }
