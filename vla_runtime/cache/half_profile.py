"""Timing each half of the cache against dense on this machine, for this model (``HalfTiming``).

``build-cache --profile`` times the halves on the held-out calls it profiled (each with the
reference retrieval matched it to); ``eval`` and any caller holding only a repository time them
on the repository's own calls (``cases_from_repository``). Both go through ``time_halves``:
dense and cached run the same call back to back, repeated, after a warm-up, and each half's
figure is the median over those pairs of the dense / cached time of its phase (prefill for the
Context Cache, denoise for the Action Cache), with a 95 % interval: a load that comes and goes on
the machine slows both sides of a pair alike, and ``auto`` runs a half only where the interval
lies above 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..engine.cached import CacheConfig, CachedEngine, same_camera_layout
from ..engine.dense import DenseEngine, ModelInputs
from ..models.pi05 import Pi05Model
from ..progress import Progress, silent
from .entry import PreparedEntry, reconstruct_entry
from .halves import HALVES, PHASE_OF, HalfTiming, PhaseTiming
from .manager import stored_images_to_model
from .masks import Groups
from .repository import ReferenceRepository

@dataclass(frozen=True)
class TimingCase:
    """One call to time: its model inputs and noise, and the reference entry (masks at rho_n)."""

    inputs: ModelInputs
    noise: Tensor
    entry: PreparedEntry


@torch.no_grad()
def time_halves(model: Pi05Model, cases: Sequence[TimingCase], rho_p: float, rho_n: float, groups: Groups,
                repeats: int = 3, warmup: int = 1, progress: Progress = silent) -> HalfTiming:
    """Prefill and denoise timed dense and cached over ``cases`` x ``repeats`` (``PhaseTiming.paired``).

    The cached engine runs both halves at once: they touch different phases (the Context Cache the
    prefill, the Action Cache the denoising, which reads the prefix K/V whichever way it was
    computed), so one cached call times both. The order of dense and cached alternates per repeat.
    A case whose reference cannot serve it (another camera layout: the Context Cache would not
    run) is left out, and one without masks is refused: its time would be a dense time counted
    as cached.
    """
    cases = [c for c in cases if same_camera_layout(c.entry, c.inputs.image_mask)]
    if not cases:
        raise ValueError("no call to time the halves on (none whose reference has its camera layout)")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    dense = DenseEngine(model)
    cached = CachedEngine(model, CacheConfig(rho_p=rho_p, rho_n=rho_n, groups=groups))

    def run(engine: DenseEngine, case: TimingCase) -> dict[str, float]:
        select = None if engine is dense else (lambda f, x, e=case.entry: e)
        out = engine.infer(case.inputs, noise=case.noise, select=select)
        if engine is cached and (cached.last_context is None or case.entry.masks is None):
            raise ValueError(f"reference {case.entry.key} did not serve both halves (camera layout or masks): "
                             "it cannot time them")
        return out.times.seconds

    for _ in range(warmup):
        run(dense, cases[0])
        run(cached, cases[0])
    samples: dict[str, dict[str, list[float]]] = {m: {PHASE_OF[h]: [] for h in HALVES} for m in ("dense", "cached")}
    with progress(f"timing the halves ({len(cases)} calls x {repeats})", repeats, "repeat") as bar:
        for r in range(repeats):
            order = (("dense", dense), ("cached", cached)) if r % 2 == 0 else (("cached", cached), ("dense", dense))
            for case in cases:
                for mode, engine in order:
                    seconds = run(engine, case)
                    for phase in samples[mode]:
                        samples[mode][phase].append(seconds[phase])
            bar.update()
    p = next(model.parameters())
    # sample i of each mode is the same call in the same repeat, run back to back: paired
    phases = {h: PhaseTiming.paired(samples["dense"][PHASE_OF[h]], samples["cached"][PHASE_OF[h]]) for h in HALVES}
    return HalfTiming(phases["context_cache"], phases["action_cache"], device=str(p.device),
                      threads=torch.get_num_threads(), dtype=str(p.dtype).removeprefix("torch."), rho_p=rho_p,
                      rho_n=rho_n, calls=len(cases), repeats=repeats)


def cases_from_repository(model: Pi05Model, repo: ReferenceRepository, calls_per_task: int = 4,
                          seed: int = 0) -> list[TimingCase]:
    """Calls to time taken from the repository itself, for a caller with no held-out episodes.

    Per task, the first ``calls_per_task`` calls of its last episode are the queries; each is
    served by the most similar call (cosine of the stored retrieval features) of the task's other
    episodes, or of the same episode when the task has one (then a call can be its own reference:
    the time of a half depends on the shapes and ratios, not on which reference it reads).
    """
    cases = []
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for task in repo.tasks():
        query = repo.episodes(task)[-1].episode_id   # a listed task has an episode (the index drops empty ones)
        keys, feats = repo.retrieval_matrix(task)
        pool = [k for k, (e, _) in enumerate(keys) if e != query] or list(range(len(keys)))
        cand = torch.nn.functional.normalize(feats[pool].float(), dim=1)
        for i in range(min(calls_per_task, repo.episode(query).num_calls)):
            call = repo.load_call(query, i)
            q = torch.nn.functional.normalize(call.retrieval.float().flatten(), dim=0)
            ref_key = keys[pool[int((cand @ q).argmax())]]
            ref = repo.load_call(*ref_key)
            entry = reconstruct_entry(model, ref_key, stored_images_to_model(ref.images).to(device), ref.image_mask,
                                      ref.tokens, ref.token_mask, ref.masks)
            inputs = ModelInputs(stored_images_to_model(call.images)[None], call.image_mask[None], call.tokens[None],
                                 call.token_mask[None])
            noise = torch.randn(1, model.cfg.chunk_size, model.cfg.action_dim, generator=gen)
            cases.append(TimingCase(inputs, noise, entry))
    return cases


def time_repository_halves(model: Pi05Model, repo: ReferenceRepository, rho_p: float, repeats: int = 3,
                           record: bool = False, progress: Progress = silent) -> HalfTiming:
    """``time_halves`` on the repository's own calls at its rho_n; ``record`` writes it in."""
    cases = cases_from_repository(model, repo)
    timing = time_halves(model, cases, rho_p, repo.meta.rho_n, tuple(tuple(g) for g in repo.meta.mask_groups),
                         repeats=repeats, progress=progress)
    if record:
        repo.record_half_timing(timing)
    return timing
