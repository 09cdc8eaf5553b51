"""Building the reference repository from recorded episodes, and profiling rho_p / rho_n.

``vla-runtime build-cache`` runs here: each successful episode (a rosbag2 bag, or an episode of a
LeRobot dataset: any :class:`~vla_runtime.io.episode_sources.EpisodeRef`) is replayed as the
policy calls it would have made; every call is run densely once to record its compact inputs,
its retrieval features and its neuron contribution scores, from which the Action Cache masks are
built. Profiling replays held-out episodes against the others, dense and cached side by side,
and picks the cheapest ratios whose action deviation stays within a tolerance.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..engine.cached import CacheConfig, CachedEngine
from ..engine.dense import DenseEngine, ModelInputs
from ..engine.policy import Observation, Pi05Policy
from ..io.bags import BagTopics, Episode
from ..io.episode_sources import EpisodeRef, bag_refs
from ..models.config import Pi05Config
from ..models.gemma import DenoiseFFN
from ..models.pi05 import Pi05Model
from ..progress import Progress, silent
from ..models.flops import cached_flops, dense_flops
from .entry import PreparedEntry, reconstruct_entry
from .half_profile import TimingCase, time_halves
from .halves import DEFAULT_RHO_N, DEFAULT_RHO_P, HalfTiming
from .manager import model_images_to_stored
from .masks import ContributionRecorder, Groups, group_masks, resolve_groups
from .repository import ReferenceCall, ReferenceRepository, RepositoryMeta
from .retrieval import CandidateMatrix, RetrievalConfig, Retriever, TaskPacks

Log = Callable[[str], None]
# (rho_p, rho_n) points profiled. No point between (0.4, 0.5) and (0.6, 0.75): at ``pi05-mw``
# (0.5, 0.625) kept the profile's mean deviation within the default tolerance (0.042) and ran a
# call 1.05x faster through the pipeline, yet lost 9 points of closed-loop success, and rho_n
# 0.625 alone (at rho_p 0.6) 7; one call's deviation does not see what a coarser denoising costs
# over an episode (docs/cache.md, "Finer ratios at pi05-mw").
DEFAULT_GRID: tuple[tuple[float, float], ...] = ((0.2, 0.25), (0.4, 0.5), (0.6, 0.75), (1.0, 1.0))


@dataclass(frozen=True)
class BuildConfig:
    rho_n: float = DEFAULT_RHO_N
    groups: Groups | None = None   # None: rMuscle's two even groups over the model's steps (``validate``)
    history_len: int = 4
    noise_seed: int = 0
    skip_failed: bool = True  # episodes whose outcome says "failure" are not references

    def validate(self, num_steps: int) -> "BuildConfig":
        """This config for a model of ``num_steps`` denoising steps, its groups resolved."""
        if not 0.0 < self.rho_n <= 1.0:
            raise ValueError(f"rho_n must be in (0, 1], got {self.rho_n}")
        if self.history_len < 1:
            raise ValueError("history_len must be >= 1")
        groups = resolve_groups(self.groups, num_steps)
        return self if self.groups is not None else replace(self, groups=groups)


def model_summary(cfg: Pi05Config) -> dict:
    """What a repository must agree with to be reused (architecture, not weights: see the hash)."""
    return {"vision_depth": cfg.vision.depth, "vision_width": cfg.vision.width, "vlm_depth": cfg.vlm.depth,
            "vlm_width": cfg.vlm.width, "expert_depth": cfg.expert.depth, "expert_mlp": cfg.expert.mlp_dim,
            "num_image_tokens": cfg.num_image_tokens, "chunk_size": cfg.chunk_size, "num_steps": cfg.num_steps}


@dataclass
class RecordedCall:
    """A call as stored, plus what profiling needs and the repository does not keep."""

    call: ReferenceCall
    scores: Tensor           # [steps, expert depth, H] contribution scores (Eq. 1)
    inputs: ModelInputs
    noise: Tensor
    actions: Tensor          # dense actions (model space)


class _ProfilingEngine(DenseEngine):
    """The dense engine with a contribution recorder in the denoising loop."""

    def __init__(self, model: Pi05Model):
        super().__init__(model, max_batch=1, tap_retrieval_features=True)
        self.recorder: ContributionRecorder | None = None

    def _denoise_ffn(self, reference: object | None) -> DenoiseFFN | None:
        self.recorder = ContributionRecorder(self.model)
        return self.recorder


class EpisodeRecorder:
    def __init__(self, policy: Pi05Policy, cfg: BuildConfig):
        self.policy = policy
        self.cfg = cfg.validate(policy.engine.cfg.num_steps)
        self.engine = _ProfilingEngine(policy.engine.model)

    def record(self, episode: Episode) -> list[RecordedCall]:
        out: list[RecordedCall] = []
        states: list[Tensor] = []
        n = self.cfg.history_len
        for i, frame in enumerate(episode.frames):
            task = getattr(frame, "instruction", None) or episode.task
            inputs = self.policy.prepare(Observation(images=frame.images, state=frame.state, task=task))
            noise = self.engine.make_noise(1, torch.Generator().manual_seed(self.cfg.noise_seed + i))
            result = self.engine.infer(inputs, noise=noise)
            scores = self.engine.recorder.scores.clone()
            state = torch.as_tensor(frame.state, dtype=torch.float32)
            states.append(state)
            hist = states[-n:]
            call = ReferenceCall(
                images=model_images_to_stored(inputs.images[0]), image_mask=inputs.image_mask[0].clone(),
                tokens=inputs.tokens[0].clone(), token_mask=inputs.token_mask[0].clone(), state=state.clone(),
                state_history=torch.stack([hist[0]] * (n - len(hist)) + hist),
                retrieval=result.retrieval_features[0].flatten(0, 1).to(torch.float16).cpu(),
                masks=group_masks(scores, self.cfg.groups, self.cfg.rho_n).to(torch.int32).cpu())
            out.append(RecordedCall(call, scores, inputs, noise, result.actions))
        return out


def with_masks(recorded: Sequence[RecordedCall], groups: Groups, rho_n: float) -> list[ReferenceCall]:
    """The calls with masks rebuilt at ``rho_n`` (from the recorded scores)."""
    out = []
    for r in recorded:
        fields = {k: getattr(r.call, k) for k in r.call.__dataclass_fields__}
        fields["masks"] = group_masks(r.scores, groups, rho_n).to(torch.int32)
        out.append(ReferenceCall(**fields))
    return out


# --------------------------------------------------------------------------- profiling
@dataclass
class ProfilePoint:
    rho_p: float
    rho_n: float
    calls: int
    hits: int
    mean_deviation: float        # relative L2 of the chunk vs dense, mean over cached calls
    worst_deviation: float
    flops_fraction: float        # estimated useful FLOPs of a cached call / dense call
    median_speedup: float        # measured dense / cached total per call (this machine)
    median_prefill_speedup: float
    median_denoise_speedup: float


@dataclass(frozen=True)
class ProfiledCall:
    """A held-out call that retrieval matched, with its reference (reconstructed, no masks)."""

    held_out: RecordedCall
    reference: RecordedCall
    entry: PreparedEntry


def _relative_l2(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@torch.no_grad()
def profile_ratios(model: Pi05Model, references: dict[str, list[RecordedCall]], held_out: dict[str, list[RecordedCall]],
                   task_of: dict[str, str], grid: Sequence[tuple[float, float]], groups: Groups,
                   retrieval: RetrievalConfig, progress: Progress = silent
                   ) -> tuple[list[ProfilePoint], list[ProfiledCall]]:
    """Replay held-out episodes against the references: dense vs cached at every grid point.

    Every reference call is a candidate (the whole task pack, as if prepared); the matched
    reference is reconstructed once and reused across grid points. Also returns the matched
    calls, on which ``time_profiled_halves`` times each half at the chosen ratios.
    """
    packs: dict[str, CandidateMatrix] = {}
    for task in set(task_of[e] for e in references):
        keys = [(e, i) for e, calls in references.items() if task_of[e] == task for i in range(len(calls))]
        feats = torch.stack([references[e][i].call.retrieval.float().flatten() for e, i in keys])
        hists = torch.stack([references[e][i].call.state_history for e, i in keys])
        packs[task] = CandidateMatrix.from_tensors(keys, feats, hists)
    retriever = Retriever(retrieval, TaskPacks(packs))
    engines = {p: CachedEngine(model, CacheConfig(rho_p=p[0], rho_n=p[1], groups=groups)) for p in grid}
    dense = DenseEngine(model, tap_retrieval_features=True)
    entries: dict[tuple[str, int], PreparedEntry] = {}
    devs: dict[tuple[float, float], list[float]] = {p: [] for p in grid}
    speed: dict[tuple[float, float], list[float]] = {p: [] for p in grid}
    phase_speed: dict[tuple[float, float], dict[str, list[float]]] = {p: {"prefill": [], "denoise": []} for p in grid}
    flops: dict[tuple[float, float], list[float]] = {p: [] for p in grid}
    cfg = model.cfg
    calls = 0
    matched: list[ProfiledCall] = []
    with progress("profiling rho_p/rho_n", sum(len(r) for r in held_out.values()), "call") as bar:
        for eid, recs in held_out.items():
            task = task_of[eid]
            # as the runtime's selector starts an episode: repeats of one reference bounded by the
            # task's longest reference episode, and its episodes' lengths for the past-the-end rule
            lengths = {e: len(c) for e, c in references.items() if task_of[e] == task}
            retriever.start_episode(task, max(lengths.values(), default=1), lengths)
            for rec in recs:
                calls += 1
                bar.update()
                d = dense.infer(rec.inputs, noise=rec.noise)
                match = retriever.query(d.retrieval_features, rec.call.state_history)
                bar.set_postfix_str(f"{eid}, matched {len(matched) + (match is not None)}/{calls}", refresh=False)
                if match is None:
                    continue
                ref = references[match.episode_id][match.index]
                if match.key not in entries:
                    c = ref.call
                    entries[match.key] = reconstruct_entry(
                        model, match.key, (c.images.permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(d.actions.device),
                        c.image_mask, c.tokens, c.token_mask, None)
                base = entries[match.key]
                matched.append(ProfiledCall(rec, ref, base))
                for rho_p, rho_n in grid:
                    entry = PreparedEntry(base.key, base.ffn_in, base.ffn_out, base.image_mask,
                                          group_masks(ref.scores, groups, rho_n))
                    out = engines[(rho_p, rho_n)].infer(rec.inputs, noise=rec.noise, select=lambda f, x, e=entry: e)
                    devs[(rho_p, rho_n)].append(_relative_l2(out.actions, d.actions))
                    speed[(rho_p, rho_n)].append(d.times.total / out.times.total)
                    for ph in ("prefill", "denoise"):
                        phase_speed[(rho_p, rho_n)][ph].append(d.times.seconds[ph] / out.times.seconds[ph])
                    cams = int(rec.inputs.image_mask.sum())
                    visual = cams * cfg.num_image_tokens
                    prefix = visual + int(rec.inputs.token_mask.sum())
                    flops[(rho_p, rho_n)].append(cached_flops(cfg, prefix, visual, rho_p, rho_n, len(groups))
                                                 / dense_flops(cfg, prefix, cams))
    points = []
    for p in grid:
        v = devs[p]
        points.append(ProfilePoint(
            rho_p=p[0], rho_n=p[1], calls=calls, hits=len(v),
            mean_deviation=statistics.fmean(v) if v else float("nan"), worst_deviation=max(v) if v else float("nan"),
            flops_fraction=statistics.fmean(flops[p]) if flops[p] else float("nan"),
            median_speedup=statistics.median(speed[p]) if speed[p] else float("nan"),
            median_prefill_speedup=statistics.median(phase_speed[p]["prefill"]) if v else float("nan"),
            median_denoise_speedup=statistics.median(phase_speed[p]["denoise"]) if v else float("nan")))
    return points, matched


def time_profiled_halves(model: Pi05Model, matched: Sequence[ProfiledCall], rho_p: float, rho_n: float,
                         groups: Groups, repeats: int = 3, progress: Progress = silent) -> HalfTiming:
    """Each half against dense on the profiled calls, the reference masks rebuilt at ``rho_n``."""
    cases = [TimingCase(m.held_out.inputs, m.held_out.noise,
                        PreparedEntry(m.entry.key, m.entry.ffn_in, m.entry.ffn_out, m.entry.image_mask,
                                      group_masks(m.reference.scores, groups, rho_n)))
             for m in matched]
    return time_halves(model, cases, rho_p, rho_n, groups, repeats=repeats, progress=progress)


def choose_ratios(points: Sequence[ProfilePoint], tolerance: float) -> ProfilePoint | None:
    """The cheapest point (estimated FLOPs) whose mean deviation is within ``tolerance``."""
    ok = [p for p in points if p.hits and p.mean_deviation <= tolerance]
    return min(ok, key=lambda p: p.flops_fraction) if ok else None


# --------------------------------------------------------------------------- the command
@dataclass
class BuildSummary:
    repository: str
    episodes: int
    calls: int
    skipped: list[str] = field(default_factory=list)
    rho_p: float | None = None
    rho_n: float = DEFAULT_RHO_N
    profile: list[dict] = field(default_factory=list)
    half_timing: dict | None = None   # HalfTiming.as_dict() (None: not profiled)
    bytes_per_call: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def build_repository(policy: Pi05Policy, checkpoint_hash: str, bags: Sequence[Path], out: Path, topics: BagTopics,
                     call_period: float, cfg: BuildConfig = BuildConfig(), profile_held_out: int = 0,
                     grid: Sequence[tuple[float, float]] = DEFAULT_GRID, tolerance: float = 0.05,
                     retrieval: RetrievalConfig = RetrievalConfig(), adopt_profiled: bool = False,
                     half_repeats: int = 3, log: Log = print, progress: Progress = silent) -> BuildSummary:
    """:func:`build_repository_from` over rosbag2 bags read with ``topics``."""
    return build_repository_from(policy, checkpoint_hash, bag_refs(bags, topics), out, call_period, cfg,
                                 profile_held_out, grid, tolerance, retrieval, adopt_profiled, half_repeats, log,
                                 progress)


def build_repository_from(policy: Pi05Policy, checkpoint_hash: str, episodes: Sequence[EpisodeRef], out: Path,
                          call_period: float, cfg: BuildConfig = BuildConfig(), profile_held_out: int = 0,
                          grid: Sequence[tuple[float, float]] = DEFAULT_GRID, tolerance: float = 0.05,
                          retrieval: RetrievalConfig = RetrievalConfig(), adopt_profiled: bool = False,
                          half_repeats: int = 3, log: Log = print, progress: Progress = silent) -> BuildSummary:
    """Record every successful episode, optionally profile the ratios, write the repository.

    Episodes are read one at a time (a bag or a dataset episode alike); one with an unknown
    outcome (``success is None``, every dataset episode) is a reference. With ``adopt_profiled``
    the masks are stored at the profiled rho_n (and the profiled rho_p is reported for the
    runtime); otherwise the configured rho_n is kept and the curve is a report. Profiling also
    times each half against dense (``half_repeats`` repeats) at the rho_p it suggests (the engine
    default when none qualifies) and the stored rho_n, and records it in the repository: what
    ``cache.context_cache: auto`` / ``action_cache: auto`` decide from. ``log`` gets the few lines
    worth keeping (the profile table, the result); ``progress`` one bar per phase (recording,
    profiling, timing).
    """
    t0 = time.perf_counter()
    model = policy.engine.model
    cfg = cfg.validate(model.cfg.num_steps)
    recorder = EpisodeRecorder(policy, cfg)
    recorded: dict[str, list[RecordedCall]] = {}
    task_of: dict[str, str] = {}
    source: dict[str, str] = {}
    skipped = []
    with progress("recording references", len(episodes), "episode") as bar:
        for ref in episodes:
            episode = ref.load(call_period, state_dim=policy.state_dim)
            bar.set_postfix_str(f"{ref.label}: {len(episode.frames)} calls", refresh=False)
            if episode.success is False and cfg.skip_failed:
                skipped.append(ref.source)
            else:
                eid = _episode_id(ref.label, recorded)
                recorded[eid] = recorder.record(episode)
                task_of[eid] = episode.task
                source[eid] = ref.source
            bar.update()
    if skipped:
        log(f"{len(skipped)} episode(s) with outcome 'failure' skipped: {', '.join(skipped)}")
    if not recorded:
        raise ValueError("no successful episode to build a repository from")

    summary = BuildSummary(str(out), len(recorded), sum(len(v) for v in recorded.values()), skipped, rho_n=cfg.rho_n)
    timing: HalfTiming | None = None
    if profile_held_out > 0:
        held = _held_out(recorded, task_of, profile_held_out)
        if not held:
            log("profiling skipped: every task needs at least one reference episode besides the held-out ones")
        else:
            refs = {e: v for e, v in recorded.items() if e not in held}
            points, matched = profile_ratios(model, refs, {e: recorded[e] for e in held}, task_of, grid,
                                             cfg.groups, retrieval, progress)
            summary.profile = [asdict(p) for p in points]
            best = choose_ratios(points, tolerance)
            if best is not None:
                summary.rho_p = best.rho_p
                if adopt_profiled:
                    summary.rho_n = best.rho_n
            if matched:
                rho_p = summary.rho_p if summary.rho_p is not None else DEFAULT_RHO_P
                timing = time_profiled_halves(model, matched, rho_p, summary.rho_n, cfg.groups, half_repeats,
                                              progress)
                summary.half_timing = timing.as_dict()
            else:
                log("halves not timed: retrieval matched no held-out call")
    meta = RepositoryMeta(checkpoint_hash=checkpoint_hash, model=model_summary(model.cfg),
                          retrieval_layer=model.cfg.retrieval_layer, rho_n=summary.rho_n,
                          mask_groups=[list(g) for g in cfg.groups], history_len=cfg.history_len,
                          half_timing=timing)
    repo = ReferenceRepository.create(out, meta)
    for eid, calls in recorded.items():
        repo.add_episode(eid, task_of[eid], with_masks(calls, cfg.groups, summary.rho_n), source=source[eid])
    summary.bytes_per_call = repo.nbytes_per_call()
    summary.seconds = time.perf_counter() - t0
    return summary


def admit_episode(policy: Pi05Policy, repo: ReferenceRepository, bag: Path, topics: BagTopics, call_period: float,
                  max_episodes_per_task: int, max_bytes: int | None = None, log: Log = print) -> list[str]:
    """:func:`admit_reference` of one bag."""
    return admit_reference(policy, repo, bag_refs([bag], topics)[0], call_period, max_episodes_per_task, max_bytes, log)


def admit_reference(policy: Pi05Policy, repo: ReferenceRepository, ref: EpisodeRef, call_period: float,
                    max_episodes_per_task: int, max_bytes: int | None = None, log: Log = print) -> list[str]:
    """Online admission of a new successful episode, keeping the task within its bound."""
    meta = repo.meta
    cfg = BuildConfig(rho_n=meta.rho_n, groups=tuple(tuple(g) for g in meta.mask_groups), history_len=meta.history_len)
    episode = ref.load(call_period, state_dim=policy.state_dim)
    if episode.success is False:
        raise ValueError(f"{ref.source}: outcome 'failure'; only successful episodes are admitted")
    recorded = EpisodeRecorder(policy, cfg).record(episode)
    eid = _episode_id(ref.label, {e.episode_id: None for e in repo.episodes()})
    evicted = repo.admit(eid, episode.task, [r.call for r in recorded], max_episodes_per_task, max_bytes,
                         source=ref.source)
    log(f"admitted {eid} ({len(recorded)} calls); evicted {evicted or 'none'}")
    return evicted


def _episode_id(label: str, taken) -> str:
    base = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in label)[:100] or "episode"
    base = base if base[0].isalnum() else "e" + base
    eid, n = base, 1
    while eid in taken:
        n += 1
        eid = f"{base}_{n}"
    return eid


def _held_out(recorded: dict, task_of: dict[str, str], per_task: int) -> list[str]:
    held = []
    for task in dict.fromkeys(task_of.values()):
        eps = [e for e in recorded if task_of[e] == task]
        if len(eps) > per_task:
            held += eps[-per_task:]
    return held
