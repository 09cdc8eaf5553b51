"""build-cache's builder on episodes the test makes in memory (tiny preset, episodes of 1 to 6 calls).

Each episode is an :class:`EpisodeRef` over an :class:`Episode` held in memory (random images, so
two scenes are about 0.4 apart in cosine and a nudged copy of an episode matches its original),
so no bag or dataset is written and a whole build with profiling takes a few seconds: what
mutation testing pays for every mutant. What the builder stores is compared with an independent
computation: the policy's own inputs, a dense engine's retrieval features and actions, the
contribution scores of a plain dense denoising run. ``test_manager_builder.py`` and
``test_builder_dataset.py`` run the same builder end to end on bags and on a LeRobot dataset.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from vla_runtime.cache import builder as builder_mod
from vla_runtime.cache.builder import (DEFAULT_GRID, BuildConfig, BuildSummary, EpisodeRecorder, ProfilePoint,
                                       admit_episode, admit_reference, build_repository, build_repository_from,
                                       choose_ratios, model_summary, time_profiled_halves, with_masks)
from vla_runtime.cache.entry import reconstruct_entry
from vla_runtime.cache.manager import model_images_to_stored, stored_images_to_model
from vla_runtime.cache.masks import DEFAULT_GROUPS, ContributionRecorder, group_masks
from vla_runtime.cache.repository import ReferenceRepository, RepositoryError
from vla_runtime.cache.retrieval import RetrievalConfig
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.dense import DenseEngine
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.engine.timing import PhaseTimes
from vla_runtime.io.bags import BagTopics, Episode, EpisodeFrame
from vla_runtime.io.episode_sources import BagRef
from vla_runtime.models.flops import cached_flops, dense_flops
from vla_runtime.progress import silent

CAMS = ("top", "wrist")
PICK, STACK = "pick up the red cube", "stack the blocks"
SIZE, STATE_DIM = 56, 4            # the tiny preset's image size; the tiny checkpoint's state statistics
GROUPS = ((0, 3), (3, 10))         # not the default groups: every use of cfg.groups shows
HIST, SEED = 3, 7                  # history_len and noise_seed of the main build (not the defaults)
HASH = "sha256:" + "c" * 64
CALL_PERIOD = 0.5


# ------------------------------------------------------------------------------------ episodes
@dataclass
class MemoryRef:
    """An EpisodeRef over an episode held in memory; records the arguments each load got."""

    label: str
    source: str
    episode: Episode
    loads: list = field(default_factory=list)

    def load(self, call_period: float, state_dim: int | None = None) -> Episode:
        self.loads.append((call_period, state_dim))
        return self.episode


def scene_frames(seed: int, n: int, cams=CAMS, instruction: dict[int, str] | None = None) -> list[EpisodeFrame]:
    rng = np.random.default_rng(seed)
    return [EpisodeFrame(t=CALL_PERIOD * i,
                         images={c: rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for c in cams},
                         state=rng.uniform(-0.9, 0.9, STATE_DIM).astype(np.float32),
                         instruction=(instruction or {}).get(i))
            for i in range(n)]


def episode(name: str, task: str, frames: list[EpisodeFrame], success: bool | None = None) -> Episode:
    return Episode(episode_id=name, task=task, success=success, frames=frames)


def nudged(frames: list[EpisodeFrame], seed: int) -> list[EpisodeFrame]:
    """The same scene seen again: every pixel moved by at most 6 levels (cosine near 1, not 1)."""
    rng = np.random.default_rng(seed)
    return [EpisodeFrame(t=f.t, state=f.state, instruction=f.instruction,
                         images={c: np.clip(img.astype(np.int16) + rng.integers(-6, 7, img.shape), 0, 255)
                                 .astype(np.uint8) for c, img in f.images.items()})
            for f in frames]


# A: two cameras, its third call under another instruction; B: the top camera only; F: failed;
# C: the other task, longer than any of PICK's; A again (A_2, label "A", each image nudged: it matches
# A call for call, and its prefix differs, so rho_p changes what the cached call computes), with A's
# last frame seen twice (the second match to a reference's last call is past the references, with
# max_end_matches 1); "hold still": B's first frame six times (it matches B's call 0 until the
# retriever calls it a stall: more than 4 repeats, the length of PICK's longest reference, not C's 5;
# the stall then holds for the sixth call).
A_FRAMES = scene_frames(1, 4, instruction={2: "put the cube into the bowl"})
B_FRAMES = scene_frames(2, 2, cams=("top",))
EPISODES = {
    "A": episode("A", PICK, A_FRAMES),
    "B": episode("B", PICK, B_FRAMES, success=True),
    "F": episode("F", PICK, scene_frames(3, 2), success=False),
    "C": episode("C", STACK, scene_frames(4, 5), success=True),
    "A_2": episode("A_2", PICK, nudged(A_FRAMES + [EpisodeFrame(t=2.0, images=A_FRAMES[3].images,
                                                               state=A_FRAMES[3].state)], 5)),
    "hold_still": episode("hold_still", PICK, [EpisodeFrame(t=CALL_PERIOD * i, images=B_FRAMES[0].images,
                                                            state=B_FRAMES[0].state) for i in range(6)]),
}
LABELS = {"A": "A", "B": "B", "F": "F", "C": "C", "A_2": "A", "hold_still": "hold still"}   # A's copy: same label


def refs(*names: str) -> list[MemoryRef]:
    return [MemoryRef(LABELS[n], f"mem/{n}", EPISODES[n]) for n in names]


# ------------------------------------------------------------------------------------ fakes
class FakeBar:
    def __init__(self, desc: str, total: int | None, unit: str):
        self.desc, self.total, self.unit = desc, total, unit
        self.n, self.postfix, self.closed = 0, [], False

    def __enter__(self) -> "FakeBar":
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix.append((s, refresh))


class Bars:
    """A Progress that keeps every bar it made."""

    def __init__(self):
        self.bars: list[FakeBar] = []

    def __call__(self, desc: str, total: int | None, unit: str = "it") -> FakeBar:
        self.bars.append(FakeBar(desc, total, unit))
        return self.bars[-1]


def dense_times(k: int) -> dict[str, float]:
    """The k-th profiling dense call's phase seconds (binary fractions: every ratio is exact)."""
    return {"vision": 0.5, "prefill": 2.0 + k, "denoise": 8.0 - 0.5 * k}


def cached_times(j: int) -> dict[str, float]:
    return {"vision": 0.5, "retrieve": 0.25, "prefill": 1.0 + 0.25 * j, "denoise": 2.0 + j}


def scripted(engine: type, times) -> type:
    """``engine`` whose k-th call reports the phase seconds ``times(k)`` (its actions untouched)."""

    class Scripted(engine):
        def infer(self, *args, **kw):
            out = super().infer(*args, **kw)
            self.calls = getattr(self, "calls", 0) + 1
            out.times = PhaseTimes(times(self.calls - 1))
            return out

    return Scripted


# ------------------------------------------------------------------------------------ oracle
def contribution_scores(model, inputs, noise) -> torch.Tensor:
    """Eq. 1 scores of one call from a plain dense run: vision, prefill, denoise with a recorder."""
    image_tokens, _ = model.embed_images(inputs.images)
    prefix = model.build_prefix(image_tokens, inputs.image_mask, inputs.tokens, inputs.token_mask)
    model.prefill(prefix)
    rec = ContributionRecorder(model)
    model.denoise(prefix, noise, ffn=rec)
    return rec.scores.clone()


@dataclass
class Expected:
    inputs: object
    noise: torch.Tensor
    actions: torch.Tensor
    retrieval: torch.Tensor
    scores: torch.Tensor
    state: torch.Tensor
    state_history: torch.Tensor


def expected_calls(policy: Pi05Policy, ep: Episode, seed: int, history_len: int) -> list[Expected]:
    """Each call of ``ep`` as the builder should see it, worked out without the builder: the
    instruction in effect, the policy's inputs, the noise of generator ``seed + i``, a dense engine's
    retrieval features and actions, and the history of the last ``history_len`` states with the
    first state repeated before the episode's start."""
    model = policy.engine.model
    tap = DenseEngine(model, tap_retrieval_features=True)
    states = [torch.as_tensor(f.state, dtype=torch.float32) for f in ep.frames]
    out = []
    for i, frame in enumerate(ep.frames):
        task = frame.instruction if frame.instruction is not None else ep.task
        inputs = policy.prepare(Observation(frame.images, frame.state, task))
        noise = tap.make_noise(1, torch.Generator().manual_seed(seed + i))
        dense = tap.infer(inputs, noise=noise)
        hist = torch.stack([states[max(j, 0)] for j in range(i - history_len + 1, i + 1)])
        out.append(Expected(inputs, noise, dense.actions, dense.retrieval_features[0].flatten(0, 1).half(),
                            contribution_scores(model, inputs, noise), states[i], hist))
    return out


def assert_stored(call, exp: Expected, rho_n: float, groups=GROUPS) -> None:
    assert torch.equal(call.images, model_images_to_stored(exp.inputs.images[0]))
    assert torch.equal(call.image_mask, exp.inputs.image_mask[0])
    assert torch.equal(call.tokens, exp.inputs.tokens[0]) and torch.equal(call.token_mask, exp.inputs.token_mask[0])
    assert torch.equal(call.state, exp.state) and torch.equal(call.state_history, exp.state_history)
    assert call.retrieval.dtype == torch.float16 and torch.equal(call.retrieval, exp.retrieval)
    assert call.masks.dtype == torch.int32
    assert torch.equal(call.masks, group_masks(exp.scores, groups, rho_n).to(torch.int32))


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(autouse=True)
def one_thread():
    """One thread in every test and fixture that computes (conftest restores the count after each
    test): a recomputation then repeats the builder's reductions in the same order, bit for bit."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint_dir) -> Pi05Policy:
    return Pi05Policy.from_checkpoint(tiny_checkpoint_dir, camera_names=list(CAMS))


@pytest.fixture(scope="module")
def expected(policy) -> dict[str, list[Expected]]:
    torch.set_num_threads(1)
    return {n: expected_calls(policy, EPISODES[n], SEED, HIST) for n in ("A", "B", "C", "A_2", "hold_still")}


MAIN_GRID = ((0.5, 0.25), (1.0, 1.0))


@pytest.fixture(scope="module")
def main_build(policy, tmp_path_factory):
    """A build of every episode with profiling (2 held out for PICK: A's copy and "hold still"), the
    ratios adopted, the profiling engines' times scripted, and ``time_halves`` watched."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("build") / "repo"
    episodes = refs("A", "B", "F", "C", "A_2", "hold_still")
    bars, lines, halves = Bars(), [], []
    real_time_halves = builder_mod.time_halves

    def watch_time_halves(*args, **kw):
        timing = real_time_halves(*args, **kw)
        halves.append((args, kw, timing))
        return timing

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_mod, "DenseEngine", scripted(DenseEngine, dense_times))
        mp.setattr(builder_mod, "CachedEngine", scripted(CachedEngine, cached_times))
        mp.setattr(builder_mod, "time_halves", watch_time_halves)
        t0 = time.perf_counter()
        summary = build_repository_from(
            policy, HASH, episodes, out, CALL_PERIOD, BuildConfig(rho_n=0.5, groups=GROUPS, history_len=HIST,
                                                                 noise_seed=SEED),
            profile_held_out=2, grid=MAIN_GRID, tolerance=1e9,
            retrieval=RetrievalConfig(history_len=HIST, max_end_matches=1),
            adopt_profiled=True, half_repeats=1, log=lines.append, progress=bars)
        elapsed = time.perf_counter() - t0
    return {"summary": summary, "out": out, "refs": episodes, "progress": bars, "bars": bars.bars, "log": lines,
            "halves": halves, "elapsed": elapsed}


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("rho_n", [0.0, -0.25, 1.5])
def test_rho_n_outside_0_1_is_refused_with_its_value(rho_n):
    with pytest.raises(ValueError, match=rf"^rho_n must be in \(0, 1\], got {rho_n}$"):
        BuildConfig(rho_n=rho_n).validate(10)


def test_build_config_bounds_and_defaults():
    cfg = BuildConfig(rho_n=1.0, groups=((0, 5), (5, 10)), history_len=1)
    assert cfg.validate(10) is cfg                                  # both bounds are inside
    with pytest.raises(ValueError, match=r"^history_len must be >= 1$"):
        BuildConfig(history_len=0).validate(10)
    with pytest.raises(ValueError, match=r"mask groups \(\(0, 5\), \(5, 10\)\) must tile the 12 denoising steps"):
        BuildConfig(groups=((0, 5), (5, 10))).validate(12)          # given groups are checked against num_steps
    assert BuildConfig() == BuildConfig(rho_n=0.5, groups=None, history_len=4, noise_seed=0, skip_failed=True)


@pytest.mark.parametrize("num_steps, groups", [(10, ((0, 5), (5, 10))), (12, ((0, 6), (6, 12))), (5, ((0, 3), (3, 5)))])
def test_unset_groups_are_two_even_groups_over_the_models_steps(num_steps, groups):
    """A library caller building for a model of another step count than pi0.5's ten gets rMuscle's
    two groups over its steps, not a validation error about groups it never chose; the build and
    cache configs resolve them alike, so a repository's masks match the engine's groups."""
    assert BuildConfig().validate(num_steps).groups == groups
    assert CacheConfig().validate(num_steps).groups == groups
    assert BuildConfig(groups=((0, 1), (1, num_steps))).validate(num_steps).groups == ((0, 1), (1, num_steps))


def test_model_summary_names_the_architecture(policy):
    cfg = policy.engine.cfg
    assert model_summary(cfg) == {
        "vision_depth": 4, "vision_width": 64, "vlm_depth": 3, "vlm_width": 96, "expert_depth": 3,
        "expert_mlp": 128, "num_image_tokens": (56 // 14) ** 2, "chunk_size": 10, "num_steps": 10}


def test_episode_ids_are_file_names_and_unique():
    eid = builder_mod._episode_id
    assert eid("run 1/a:b", {}) == "run_1_a_b"
    assert eid("ok.name-1_x", {}) == "ok.name-1_x"              # '.', '-' and '_' are kept
    assert eid("x" * 150, {}) == "x" * 100
    assert eid("", {}) == "episode"
    assert eid("_hidden", {}) == "e_hidden" and eid(".x", {}) == "e.x"
    assert eid("9lives", {}) == "9lives"
    assert eid("a", {"a": None}) == "a_2"
    assert eid("a", {"a", "a_2", "a_3"}) == "a_4"


def test_held_out_takes_the_last_episodes_of_each_task_that_keeps_a_reference():
    task_of = {"p1": "pick", "s1": "stack", "p2": "pick", "s2": "stack", "p3": "pick", "o1": "open"}
    recorded = dict.fromkeys(task_of)
    held = builder_mod._held_out
    assert held(recorded, task_of, 1) == ["p3", "s2"]             # tasks in order of first appearance
    assert held(recorded, task_of, 2) == ["p2", "p3"]             # stack has 2: none left as a reference
    assert held(recorded, task_of, 3) == []


def point(rho_p, rho_n, hits, dev, flops) -> ProfilePoint:
    return ProfilePoint(rho_p, rho_n, 4, hits, dev, dev, flops, 1.0, 1.0, 1.0)


def test_choose_ratios_takes_the_cheapest_point_within_tolerance():
    pts = [point(1.0, 1.0, 3, 0.0, 0.9), point(0.6, 0.75, 3, 0.05, 0.6), point(0.4, 0.5, 3, 0.0500001, 0.4),
           point(0.2, 0.25, 0, 0.0, 0.1)]                         # no hits: its deviation means nothing
    assert choose_ratios(pts, 0.05) is pts[1]                      # exactly at the tolerance counts
    assert choose_ratios(pts, 0.06) is pts[2]
    assert choose_ratios(pts[2:], 0.05) is None
    assert choose_ratios([], 1.0) is None


def test_relative_deviation_is_relative_to_the_dense_chunk():
    rel = builder_mod._relative_l2
    assert rel(torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0])) == 1.0           # a chunk of norm below 1
    assert rel(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == pytest.approx(5.0 / 1e-12)   # no 0 / 0


def test_summary_as_dict():
    s = BuildSummary("r", 2, 7)
    assert s.as_dict() == {"repository": "r", "episodes": 2, "calls": 7, "skipped": [], "rho_p": None, "rho_n": 0.5,
                           "profile": [], "half_timing": None, "bytes_per_call": {}, "seconds": 0.0}


# ------------------------------------------------------------------------------------ recording
def test_recorder_runs_each_call_densely_as_the_policy_would(policy, expected):
    cfg = BuildConfig(rho_n=0.5, groups=GROUPS, history_len=HIST, noise_seed=SEED)
    recorded = EpisodeRecorder(policy, cfg).record(EPISODES["A"])
    assert len(recorded) == 4
    for rec, exp in zip(recorded, expected["A"]):
        for name in ("images", "image_mask", "tokens", "token_mask"):
            assert torch.equal(getattr(rec.inputs, name), getattr(exp.inputs, name))
        assert torch.equal(rec.noise, exp.noise)
        # the same float32 operations as the dense engine; only the FFN of the denoising steps goes
        # through the recorder (which computes the same product), so equal to float32 rounding
        torch.testing.assert_close(rec.actions, exp.actions, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec.scores, exp.scores, rtol=1e-5, atol=1e-6)
        assert_stored(rec.call, exp, 0.5)
    # the third call's prompt is its own instruction, the others the episode's task
    other = policy.prepare(Observation(A_FRAMES[2].images, A_FRAMES[2].state, PICK)).tokens
    assert not torch.equal(recorded[2].inputs.tokens, other)


def test_recorder_validates_its_config(policy):
    with pytest.raises(ValueError, match=r"mask groups \(\(0, 4\), \(5, 10\)\)"):
        EpisodeRecorder(policy, BuildConfig(groups=((0, 4), (5, 10))))
    with pytest.raises(ValueError, match=r"got 2\.0$"):
        EpisodeRecorder(policy, BuildConfig(rho_n=2.0))


def test_with_masks_rebuilds_only_the_masks(policy, expected):
    recorded = EpisodeRecorder(policy, BuildConfig(groups=GROUPS, history_len=HIST, noise_seed=SEED)).record(
        EPISODES["C"])
    rebuilt = with_masks(recorded, GROUPS, 0.25)
    for r, call, exp in zip(recorded, rebuilt, expected["C"]):
        assert_stored(call, exp, 0.25)
        assert torch.equal(r.call.masks, group_masks(exp.scores, GROUPS, 0.5).to(torch.int32))   # left as it was
        assert call.masks.shape[-1] == math.ceil(0.25 * 128) != r.call.masks.shape[-1]


# ------------------------------------------------------------------------------------ the main build
def check_build_stores_every_successful_episode(main_build, policy, expected):
    repo = ReferenceRepository.open(main_build["out"], expect_checkpoint_hash=HASH,
                                    expect_model=model_summary(policy.engine.cfg))
    got = {r.episode_id: (r.task, r.source, r.num_calls) for r in repo.episodes()}
    assert got == {"A": (PICK, "mem/A", 4), "B": (PICK, "mem/B", 2), "C": (STACK, "mem/C", 5),
                   "A_2": (PICK, "mem/A_2", 5), "hold_still": (PICK, "mem/hold_still", 6)}
    # masks stored at the adopted rho_n (0.25, not the configured 0.5)
    for eid in got:
        stored = repo.load_episode(eid)
        for i, exp in enumerate(expected[eid]):
            assert_stored(stored.call(i), exp, 0.25)
    # B and "hold still" have one camera: the other is stored blank and masked out
    assert repo.load_episode("B").tensors["image_mask"].tolist() == [[True, False]] * 2
    assert all(r.loads == [(CALL_PERIOD, STATE_DIM)] for r in main_build["refs"])


def check_build_records_the_model_and_cache_parameters(main_build, policy):
    repo = ReferenceRepository.open(main_build["out"])
    meta, cfg = repo.meta, policy.engine.cfg
    assert meta.checkpoint_hash == HASH and meta.model == model_summary(cfg)
    assert meta.retrieval_layer == cfg.retrieval_layer == 2
    assert meta.rho_n == 0.25 and meta.mask_groups == [[0, 3], [3, 10]] and meta.history_len == HIST
    timing = main_build["halves"][0][2]
    assert meta.half_timing == timing


def check_build_summary(main_build):
    s, out = main_build["summary"], main_build["out"]
    repo = ReferenceRepository.open(out)
    assert (s.repository, s.episodes, s.calls, s.skipped) == (str(out), 5, 4 + 2 + 5 + 5 + 6, ["mem/F"])
    assert (s.rho_p, s.rho_n) == (0.5, 0.25)
    assert s.bytes_per_call == repo.nbytes_per_call() and s.bytes_per_call["total"] > 0
    assert s.half_timing == main_build["halves"][0][2].as_dict()
    assert 0 < s.seconds <= main_build["elapsed"]
    assert main_build["log"] == ["1 episode(s) with outcome 'failure' skipped: mem/F"]


# the held-out calls of the main build, in order: A_2 matches A call for call, then runs dense (a
# second match to A's last call); "hold still" matches B's call 0 four times (PICK's longest
# reference, A, has 4 calls), then stalls for good
HELD = [("A_2", i) for i in range(5)] + [("hold_still", i) for i in range(6)]
MATCHES = [("A", i) for i in range(4)] + [None] + [("B", 0)] * 4 + [None, None]


def check_profile_replays_the_held_out_calls_against_their_matches(main_build, policy, expected):
    model, cfg = policy.engine.model, policy.engine.cfg
    dense = DenseEngine(model)
    entries = {}
    rows = []
    for (ep, i), match in zip(HELD, MATCHES):
        exp = expected[ep][i]
        if match is None:
            continue
        ref = expected[match[0]][match[1]]
        stored = model_images_to_stored(ref.inputs.images[0])
        entries.setdefault(match, reconstruct_entry(model, match, stored_images_to_model(stored),
                                                    ref.inputs.image_mask[0], ref.inputs.tokens[0],
                                                    ref.inputs.token_mask[0], None))
        rows.append((exp, ref, entries[match]))
    want_points = []
    for j, (rho_p, rho_n) in enumerate(MAIN_GRID):
        engine = CachedEngine(model, CacheConfig(rho_p=rho_p, rho_n=rho_n, groups=GROUPS))
        devs, flops = [], []
        for exp, ref, base in rows:
            e = type(base)(base.key, base.ffn_in, base.ffn_out, base.image_mask, group_masks(ref.scores, GROUPS, rho_n))
            cached = engine.infer(exp.inputs, noise=exp.noise, select=lambda f, x, e=e: e).actions
            want = dense.infer(exp.inputs, noise=exp.noise).actions
            devs.append(float((cached - want).norm() / want.norm()))
            cams = int(exp.inputs.image_mask.sum())
            prefix = cams * cfg.num_image_tokens + int(exp.inputs.token_mask.sum())
            flops.append(cached_flops(cfg, prefix, cams * cfg.num_image_tokens, rho_p, rho_n, 2)
                         / dense_flops(cfg, prefix, cams))
        want_points.append((devs, flops))
    profile = main_build["summary"].profile
    assert [(p["rho_p"], p["rho_n"], p["calls"], p["hits"]) for p in profile] == [
        (0.5, 0.25, 11, 8), (1.0, 1.0, 11, 8)]
    for p, (devs, flops) in zip(profile, want_points):
        # the same float32 operations on the same inputs in one process (one thread): the same bits
        assert p["mean_deviation"] == statistics.fmean(devs) and p["worst_deviation"] == max(devs)
        assert p["flops_fraction"] == pytest.approx(statistics.fmean(flops), rel=1e-12)   # float64 sums
    assert profile[1]["worst_deviation"] < 1e-6 < profile[0]["mean_deviation"]    # rho = 1 reproduces dense


def check_profile_reports_the_median_speedups_of_the_matched_calls(main_build):
    matched = [k for k, m in enumerate(MATCHES) if m is not None]     # the dense call k of each cached call
    for p in main_build["summary"].profile:
        total = [sum(dense_times(k).values()) / sum(cached_times(j).values()) for j, k in enumerate(matched)]
        prefill = [dense_times(k)["prefill"] / cached_times(j)["prefill"] for j, k in enumerate(matched)]
        denoise = [dense_times(k)["denoise"] / cached_times(j)["denoise"] for j, k in enumerate(matched)]
        assert p["median_speedup"] == statistics.median(total)
        assert p["median_prefill_speedup"] == statistics.median(prefill)
        assert p["median_denoise_speedup"] == statistics.median(denoise)
        assert len({p["median_speedup"], p["median_prefill_speedup"], p["median_denoise_speedup"]}) == 3


def check_halves_are_timed_on_the_matched_calls_at_the_chosen_ratios(main_build, policy, expected):
    (args, kw, timing), = main_build["halves"]
    model, cases, rho_p, rho_n, groups = args[:5]
    assert model is policy.engine.model and (rho_p, rho_n, tuple(groups)) == (0.5, 0.25, GROUPS)
    assert kw == {"repeats": 1, "progress": main_build["progress"]}
    assert (timing.rho_p, timing.rho_n, timing.calls, timing.repeats) == (0.5, 0.25, 8, 1)
    held = [(ep, i) for (ep, i), m in zip(HELD, MATCHES) if m is not None]
    assert len(cases) == len(held)
    for case, (ep, i), match in zip(cases, held, [m for m in MATCHES if m is not None]):
        exp, ref = expected[ep][i], expected[match[0]][match[1]]
        assert torch.equal(case.inputs.tokens, exp.inputs.tokens) and torch.equal(case.noise, exp.noise)
        assert case.entry.key == match
        assert torch.equal(case.entry.masks, group_masks(ref.scores, GROUPS, 0.25))


def check_build_progress(main_build):
    bars = main_build["bars"]
    rec, prof = bars[0], bars[1]
    assert (rec.desc, rec.total, rec.unit, rec.n, rec.closed) == ("recording references", 6, "episode", 6, True)
    assert rec.postfix == [("A: 4 calls", False), ("B: 2 calls", False), ("F: 2 calls", False),
                           ("C: 5 calls", False), ("A: 5 calls", False), ("hold still: 6 calls", False)]
    assert (prof.desc, prof.total, prof.unit, prof.n, prof.closed) == ("profiling rho_p/rho_n", 11, "call", 11, True)
    assert prof.postfix == [(f"A_2, matched {k}/{k}", False) for k in range(1, 5)] + [
        ("A_2, matched 4/5", False)] + [(f"hold_still, matched {k}/{k + 1}", False) for k in range(5, 9)] + [
        ("hold_still, matched 8/10", False), ("hold_still, matched 8/11", False)]
    # the third bar is time_halves' (one repeat), given the same progress
    assert len(bars) == 3 and (bars[2].n, bars[2].closed) == (1, True)


def test_a_profiled_build(main_build, policy, expected):
    """Every check of the main build in one test. mutmut maps each function to the tests that ran
    it, and a module fixture runs inside the first test that asks for it: checks spread over
    several tests would see a mutant of the build only through the first of them."""
    check_build_stores_every_successful_episode(main_build, policy, expected)
    check_build_records_the_model_and_cache_parameters(main_build, policy)
    check_build_summary(main_build)
    check_profile_replays_the_held_out_calls_against_their_matches(main_build, policy, expected)
    check_profile_reports_the_median_speedups_of_the_matched_calls(main_build)
    check_halves_are_timed_on_the_matched_calls_at_the_chosen_ratios(main_build, policy, expected)
    check_build_progress(main_build)


# ------------------------------------------------------------------------------------ other builds
def test_no_successful_episode_is_refused(policy, tmp_path):
    lines = []
    failed = [*refs("F"), MemoryRef("F", "mem/F again", EPISODES["F"])]
    with pytest.raises(ValueError, match=r"^no successful episode to build a repository from$"):
        build_repository_from(policy, HASH, failed, tmp_path / "r", CALL_PERIOD, log=lines.append)
    assert lines == ["2 episode(s) with outcome 'failure' skipped: mem/F, mem/F again"]
    assert not (tmp_path / "r").exists()


def test_failed_episodes_are_kept_when_asked_and_profiling_needs_a_reference(policy, tmp_path):
    lines = []
    s = build_repository_from(policy, HASH, refs("F", "C"), tmp_path / "r", CALL_PERIOD,
                              BuildConfig(rho_n=0.75, skip_failed=False), profile_held_out=1, log=lines.append)
    assert lines == ["profiling skipped: every task needs at least one reference episode besides the held-out ones"]
    assert (s.episodes, s.calls, s.skipped, s.profile, s.half_timing, s.rho_p) == (2, 7, [], [], None, None)
    assert s.rho_n == 0.75                                          # the configured ratio, stored
    repo = ReferenceRepository.open(tmp_path / "r")
    assert [r.episode_id for r in repo.episodes()] == ["F", "C"]
    assert repo.meta.half_timing is None and repo.meta.rho_n == 0.75
    assert repo.load_episode("F").tensors["masks"].shape[-1] == math.ceil(0.75 * 128)
    assert repo.meta.mask_groups == [list(g) for g in DEFAULT_GROUPS] and repo.meta.history_len == 4


def test_a_held_out_episode_that_matches_nothing_is_not_timed(policy, tmp_path):
    novel = episode("N", STACK, scene_frames(9, 2))    # another scene: about 0.4 from C in cosine
    lines = []
    s = build_repository_from(policy, HASH, [*refs("C"), MemoryRef("N", "mem/N", novel)], tmp_path / "r",
                              CALL_PERIOD, profile_held_out=1, grid=((1.0, 1.0),), log=lines.append)
    assert lines == ["halves not timed: retrieval matched no held-out call"]
    (p,) = s.profile
    assert (p["rho_p"], p["rho_n"], p["calls"], p["hits"]) == (1.0, 1.0, 2, 0)
    for k in ("mean_deviation", "worst_deviation", "flops_fraction", "median_speedup", "median_prefill_speedup",
              "median_denoise_speedup"):
        assert math.isnan(p[k]), k
    assert (s.rho_p, s.rho_n, s.half_timing) == (None, 0.5, None)
    assert ReferenceRepository.open(tmp_path / "r").meta.half_timing is None


def test_a_build_with_the_defaults_does_not_profile(policy, tmp_path):
    """Defaults: no profiling, rho_n 0.5, pi0.5's two groups, a history of 4 calls, noise seed 0."""
    s = build_repository_from(policy, HASH, refs("B", "hold_still"), tmp_path / "r", CALL_PERIOD,
                              log=lambda m: None)
    assert (s.profile, s.rho_p, s.rho_n, s.half_timing) == ([], None, 0.5, None)
    repo = ReferenceRepository.open(tmp_path / "r")
    assert (repo.meta.rho_n, repo.meta.mask_groups, repo.meta.history_len) == (0.5, [[0, 5], [5, 10]], 4)
    stored = repo.load_episode("hold_still")
    for i, exp in enumerate(expected_calls(policy, EPISODES["hold_still"], 0, 4)):
        assert_stored(stored.call(i), exp, 0.5, DEFAULT_GROUPS)


@pytest.mark.parametrize("tolerance", [-1.0, 1e9])
def test_ratios_are_reported_not_adopted_by_default(policy, tmp_path, tolerance):
    """Without adopt_profiled the configured rho_n is stored; with no point within the tolerance
    no rho_p is suggested and the halves are timed at the engine's default rho_p."""
    s = build_repository_from(policy, HASH, refs("A", "A_2"), tmp_path / "r", CALL_PERIOD,
                              BuildConfig(groups=GROUPS, history_len=HIST), profile_held_out=1,
                              grid=((0.5, 0.25),), tolerance=tolerance, retrieval=RetrievalConfig(history_len=HIST),
                              half_repeats=1, log=lambda m: None)
    assert s.profile[0]["hits"] == 5 and s.rho_n == 0.5       # no limit on matches to a last call here
    assert s.rho_p == (None if tolerance < 0 else 0.5)
    assert s.half_timing["rho_p"] == (CacheConfig.rho_p if tolerance < 0 else 0.5)
    assert s.half_timing["rho_n"] == 0.5
    repo = ReferenceRepository.open(tmp_path / "r")
    assert repo.meta.rho_n == 0.5 and repo.load_episode("A").tensors["masks"].shape[-1] == 64


def test_profiling_defaults_are_the_commands(policy, tmp_path, monkeypatch):
    """A profiled build left to its defaults: the ratios within 0.05 (build-cache's --tolerance),
    each half timed with 3 repeats, the ratios reported, not adopted."""
    seen = {}
    real_choose, real_time = builder_mod.choose_ratios, builder_mod.time_profiled_halves

    def choose(points, tolerance):
        seen["tolerance"] = tolerance
        return real_choose(points, tolerance)

    def timed(model, matched, rho_p, rho_n, groups, repeats, progress):
        seen["repeats"] = repeats
        return real_time(model, matched, rho_p, rho_n, groups, repeats, progress)

    monkeypatch.setattr(builder_mod, "choose_ratios", choose)
    monkeypatch.setattr(builder_mod, "time_profiled_halves", timed)
    s = build_repository_from(policy, HASH, refs("A", "A_2"), tmp_path / "r", CALL_PERIOD, profile_held_out=1,
                              grid=((1.0, 1.0),), log=lambda m: None)
    assert seen == {"tolerance": 0.05, "repeats": 3} and s.half_timing["repeats"] == 3
    assert (s.rho_p, s.rho_n) == (1.0, 0.5)


def test_time_profiled_halves_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(builder_mod, "time_halves", lambda *a, **kw: seen.append((a, kw)) or "timing")
    assert time_profiled_halves("model", [], 0.5, 0.25, GROUPS) == "timing"
    assert seen == [(("model", [], 0.5, 0.25, GROUPS), {"repeats": 3, "progress": silent})]


def test_build_repository_reads_bags_with_the_topics(monkeypatch, tmp_path):
    """The bag front end hands every argument on, with a BagRef per bag."""
    seen = []
    monkeypatch.setattr(builder_mod, "build_repository_from", lambda *a: seen.append(a) or "summary")
    topics = BagTopics(cameras={"top": "/cam/top"}, joint_states="/joints", instruction="/task")
    args = [object() for _ in range(9)]   # cfg ... progress
    assert build_repository("policy", HASH, [tmp_path / "b1", str(tmp_path / "b2")], tmp_path / "out", topics, 0.25,
                            *args) == "summary"
    (got,) = seen
    assert got[:3] == ("policy", HASH, [BagRef(tmp_path / "b1", topics), BagRef(tmp_path / "b2", topics)])
    assert got[3:5] == (tmp_path / "out", 0.25) and list(got[5:]) == args
    # left out, the arguments are build_repository_from's defaults (build-cache's documented ones)
    build_repository("policy", HASH, [], tmp_path / "out", topics, 0.25)
    assert seen[1][2:] == ([], tmp_path / "out", 0.25, BuildConfig(), 0, DEFAULT_GRID, 0.05, RetrievalConfig(), False,
                           3, print, silent)


# ------------------------------------------------------------------------------------ admission
@pytest.fixture
def built_copy(main_build, tmp_path) -> ReferenceRepository:
    root = tmp_path / "repo"
    shutil.copytree(main_build["out"], root)
    return ReferenceRepository.open(root)


def test_admission_records_with_the_repository_parameters(built_copy, policy):
    lines = []
    evicted = admit_reference(policy, built_copy, MemoryRef("C", "mem/C again", EPISODES["C"]), CALL_PERIOD,
                              max_episodes_per_task=1, log=lines.append)
    assert evicted == ["C"] and lines == ["admitted C_2 (5 calls); evicted ['C']"]
    repo = ReferenceRepository.open(built_copy.root)
    (rec,) = repo.episodes(STACK)
    assert (rec.episode_id, rec.source, rec.admitted_online, rec.num_calls) == ("C_2", "mem/C again", True, 5)
    # recorded with the repository's rho_n (0.25), groups and history, and the default noise seed 0
    stored = repo.load_episode("C_2")
    for i, exp in enumerate(expected_calls(policy, EPISODES["C"], 0, HIST)):
        assert_stored(stored.call(i), exp, 0.25)


def test_admission_within_the_bound_evicts_nothing(built_copy, policy):
    lines = []
    ref = MemoryRef("hold still", "mem/h", episode("H", PICK, B_FRAMES[:1]))
    assert admit_reference(policy, built_copy, ref, CALL_PERIOD, max_episodes_per_task=5, log=lines.append) == []
    assert lines == ["admitted hold_still_2 (1 calls); evicted none"] and ref.loads == [(CALL_PERIOD, STATE_DIM)]
    with pytest.raises(RepositoryError, match=r"alone is \d+ bytes, above max_bytes=1000"):
        admit_reference(policy, built_copy, MemoryRef("x", "mem/x", EPISODES["C"]), CALL_PERIOD, 9, 1000,
                        log=lines.append)


def test_a_failed_episode_is_not_admitted(built_copy, policy):
    before = [r.episode_id for r in built_copy.episodes()]
    with pytest.raises(ValueError, match=r"^mem/F: outcome 'failure'; only successful episodes are admitted$"):
        admit_reference(policy, built_copy, refs("F")[0], CALL_PERIOD, 5, log=lambda m: None)
    assert [r.episode_id for r in ReferenceRepository.open(built_copy.root).episodes()] == before


def test_admit_episode_reads_one_bag(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(builder_mod, "admit_reference", lambda *a: seen.append(a) or ["old"])
    topics = BagTopics(cameras={"top": "/cam/top"}, joint_states="/joints", instruction="/task")
    log = object()
    assert admit_episode("policy", "repo", tmp_path / "bag", topics, 0.25, 3, 4096, log) == ["old"]
    assert seen == [("policy", "repo", BagRef(tmp_path / "bag", topics), 0.25, 3, 4096, log)]
