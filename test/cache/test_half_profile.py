"""Timing the halves of the cache against dense: build-cache --profile records it, the repository's
own calls time it too (eval), and a call a half cannot serve is never timed as cached. Only the
bookkeeping is asserted; the figures themselves come from ``build-cache --profile`` runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.half_profile import TimingCase, cases_from_repository, time_halves, time_repository_halves
from vla_runtime.cache.halves import HalfTiming
from vla_runtime.cache.manager import stored_images_to_model
from vla_runtime.cache.repository import ReferenceCall, ReferenceRepository
from vla_runtime.cli import main
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import list_episode_bags
from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo
from vla_runtime.progress import silent

CAMS = ("top", "wrist")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("halves")
    info = make_demo(root, DemoSpec(preset="pi05-tiny", episodes=4, held_out=1, steps_per_episode=24), log=lambda m: None)
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMS))
    summary = build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), root / "repo",
                               demo_topics(CAMS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), profile_held_out=1,
                               half_repeats=2, log=lambda m: None)
    return {**info, "root": root, "policy": policy, "summary": summary,
            "repo": ReferenceRepository.open(root / "repo", expect_checkpoint_hash=policy.checkpoint_hash)}


def test_profiling_records_each_half_timed_in_the_repository(demo):
    summary, repo = demo["summary"], demo["repo"]
    timing = repo.meta.half_timing
    assert timing is not None and summary.half_timing == timing.as_dict()
    hits = {(p["rho_p"], p["rho_n"]): p["hits"] for p in summary.profile}
    rho_p = summary.rho_p if summary.rho_p is not None else 0.4
    assert (timing.rho_p, timing.rho_n) == (rho_p, repo.meta.rho_n)
    # every profiled call that retrieval matched, x the repeats, behind each median
    assert timing.calls == hits[(0.4, 0.5)] > 0 and timing.repeats == 2
    for half in ("context_cache", "action_cache"):
        t = getattr(timing, half)
        assert t.samples == timing.calls * 2 and t.dense_s > 0 and t.cached_s > 0
        # the figure recorded is the paired one, with its interval where there are calls enough to bound it
        assert t.ratio is not None and t.speedup == t.ratio
        assert (t.ratio_low is None) == (t.samples < 6)
        assert t.ratio_low is None or t.ratio_low <= t.ratio <= t.ratio_high
    assert timing.device == "cpu" and timing.dtype == "float32" and timing.threads == torch.get_num_threads()


def test_cli_build_cache_profile_writes_the_timing_into_the_summary_and_the_index(demo, tmp_path, capsys):
    cams = [f"--camera={c}={t}" for c, t in demo["topics"]["cameras"].items()]
    out, summary = tmp_path / "repo", tmp_path / "build.json"
    assert main(["build-cache", "--checkpoint", demo["checkpoint"], "--bags", demo["references"], "--out", str(out),
                 *cams, "--profile", "1", "--summary", str(summary)]) == 0
    assert "each half against dense: context cache " in capsys.readouterr().out   # the printed summary
    written = json.loads(summary.read_text())["half_timing"]
    assert written == json.loads((out / "index.json").read_text())["half_timing"]
    assert HalfTiming.from_dict(written) == ReferenceRepository.open(out).meta.half_timing
    # without --profile nothing is measured
    assert main(["build-cache", "--checkpoint", demo["checkpoint"], "--bags", demo["references"],
                 "--out", str(tmp_path / "plain"), *cams]) == 0
    assert ReferenceRepository.open(tmp_path / "plain").meta.half_timing is None


def test_the_repository_s_own_calls_are_timed_against_other_episodes(demo, tmp_path):
    repo, model = demo["repo"], demo["policy"].engine.model
    last = repo.episodes()[-1]
    cases = cases_from_repository(model, repo, calls_per_task=1)
    assert len(cases) == 1 and cases[0].entry.key[0] != last.episode_id   # the reference: another episode's call
    assert cases[0].entry.masks is not None
    timing = time_repository_halves(model, repo, rho_p=0.6, repeats=1)
    # the first calls_per_task (4) calls of the task's last episode are the queries
    assert (timing.rho_p, timing.rho_n, timing.repeats, timing.calls) == (0.6, repo.meta.rho_n, 1,
                                                                          min(4, last.num_calls))
    assert ReferenceRepository.open(repo.root).meta.half_timing == demo["repo"].meta.half_timing   # not recorded


def test_a_call_no_half_can_serve_is_not_timed_as_cached(demo):
    repo, model = demo["repo"], demo["policy"].engine.model
    case = cases_from_repository(model, repo, calls_per_task=1)[0]
    groups = tuple(tuple(g) for g in repo.meta.mask_groups)
    e = case.entry
    other_layout = TimingCase(case.inputs, case.noise, PreparedEntry(e.key, e.ffn_in, e.ffn_out, ~e.image_mask, e.masks))
    timing = time_halves(model, [case, other_layout], 0.4, repo.meta.rho_n, groups, repeats=1, warmup=0)
    assert timing.calls == 1 and timing.context_cache.samples == 1          # the other layout left out
    with pytest.raises(ValueError, match="no call to time the halves on"):
        time_halves(model, [other_layout], 0.4, repo.meta.rho_n, groups)
    no_masks = TimingCase(case.inputs, case.noise, PreparedEntry(e.key, e.ffn_in, e.ffn_out, e.image_mask, None))
    with pytest.raises(ValueError, match="did not serve both halves"):
        time_halves(model, [no_masks], 0.4, repo.meta.rho_n, groups, warmup=0)


# ---------------------------------------------------------------- cases_from_repository, against a
# repository whose retrieval features are chosen so that the right reference is known


def _synthetic_repository(demo, root) -> tuple[ReferenceRepository, dict[tuple[str, int], np.ndarray]]:
    """Task "a": episodes a0, a1 (5 calls) and a2 (6 calls, the last: the queries); task "b": one
    episode b0 (3 calls). Every call is a copy of one demo call with its own images (so the
    reconstructed entry and the inputs tell which call they came from) and its own retrieval features:
    - each call lies near one of 8 orthonormal directions; a2's queries alternate between a0's and
      a1's calls; a call of b is nearer still to a2's call 0, so a search that crossed tasks would
      pick it;
    - a long vector of lower cosine sits in a's pool, so an unnormalised dot product would pick it.
    """
    base = demo["repo"].load_call(demo["repo"].episodes()[0].episode_id, 0)
    shape = base.retrieval.shape
    gen = torch.Generator().manual_seed(7)
    directions = torch.nn.functional.normalize(torch.randn(8, shape.numel(), generator=gen, dtype=torch.float64), dim=1)
    features: dict[tuple[str, int], np.ndarray] = {}

    def call(key: tuple[str, int], feature: torch.Tensor) -> ReferenceCall:
        features[key] = feature.to(torch.float16).double().numpy()
        k = len(features)
        images = ((base.images.int() + 37 * k) % 256).to(torch.uint8)
        return dataclasses.replace(base, images=images, retrieval=feature.to(torch.float16).reshape(shape))

    def noise() -> torch.Tensor:   # a small perturbation: 0.05 of a unit direction's length
        return 0.05 * torch.nn.functional.normalize(torch.randn(shape.numel(), generator=gen, dtype=torch.float64),
                                                    dim=0)

    repo = ReferenceRepository.create(root, dataclasses.replace(demo["repo"].meta, half_timing=None))
    # pool of task a: a0 calls j near direction j; a1 call j near direction j + 4 (j < 4), call 4: long, off-axis
    for eid, offset in (("a0", 0), ("a1", 4)):
        calls = [call((eid, j), directions[(j + offset) % 8] + noise()) for j in range(4)]
        calls.append(call((eid, 4), 40.0 * (directions[0] + directions[1] + directions[2]) + noise()))
        repo.add_episode(eid, "a", calls)
    # queries: a2 call i near direction (2 i + 1) % 8, so they alternate between a0's and a1's calls
    repo.add_episode("a2", "a", [call(("a2", i), directions[(2 * i + 1) % 8] + noise()) for i in range(6)])
    # task b: its call 0 is nearer to a2's call 0 than any call of a is
    repo.add_episode("b0", "b", [call(("b0", 0), directions[1] + 0.01 * noise())]
                     + [call(("b0", j), directions[j + 5] + noise()) for j in (1, 2)])
    return repo, features


def _nearest(features: dict, query: tuple[str, int], pool: list[tuple[str, int]]) -> tuple[str, int]:
    q = features[query] / np.linalg.norm(features[query])
    return max(pool, key=lambda k: float(features[k] @ q) / np.linalg.norm(features[k]))


@pytest.fixture(scope="module")
def synthetic(demo, tmp_path_factory):
    return _synthetic_repository(demo, tmp_path_factory.mktemp("synthetic") / "repo")


def test_cases_query_the_last_episode_and_take_the_nearest_call_of_the_task_s_other_episodes(demo, synthetic):
    repo, features = synthetic
    model = demo["policy"].engine.model
    cases = cases_from_repository(model, repo)          # defaults: 4 calls per task, seed 0
    # task a: a2's first 4 calls; task b: its only episode's 3 calls, each served from b0 itself
    queries = [("a2", i) for i in range(4)] + [("b0", i) for i in range(3)]
    pools = {"a": [k for k in features if k[0] in ("a0", "a1")], "b": [k for k in features if k[0] == "b0"]}
    want = [_nearest(features, q, pools["a" if q[0] == "a2" else "b"]) for q in queries]
    assert want[:4] == [("a0", 1), ("a0", 3), ("a1", 1), ("a1", 3)]   # the design of the features holds
    assert [c.entry.key for c in cases] == want
    gen = torch.Generator().manual_seed(0)
    for case, query, ref in zip(cases, queries, want):
        stored = repo.load_call(*query)
        assert torch.equal(case.inputs.images[0], stored_images_to_model(stored.images))   # the query's own call
        assert torch.equal(case.inputs.tokens[0], stored.tokens)
        # the entry holds the reference's states: its reconstruction from the stored call, bit for bit
        r = repo.load_call(*ref)
        again = reconstruct_entry(model, ref, stored_images_to_model(r.images), r.image_mask, r.tokens, r.token_mask,
                                  r.masks)
        assert torch.equal(case.entry.ffn_out, again.ffn_out) and torch.equal(case.entry.masks, r.masks)
        # noise: the seeded generator's draws, in call order
        assert torch.equal(case.noise, torch.randn(1, model.cfg.chunk_size, model.cfg.action_dim, generator=gen))
    assert len(cases_from_repository(model, repo, calls_per_task=6)) == 6 + 3
    other_seed = cases_from_repository(model, repo, calls_per_task=1, seed=1)[0].noise
    assert not torch.equal(other_seed, cases[0].noise)


def test_repository_timing_uses_its_calls_and_records_only_when_asked(demo, synthetic):
    repo, _ = synthetic
    model = demo["policy"].engine.model
    bars = []

    def progress(desc, total, unit="it"):
        bars.append((desc, total, unit))
        return silent(desc, total, unit)

    index = repo.root / "index.json"
    timing = time_repository_halves(model, repo, rho_p=0.5, progress=progress)   # default: 3 repeats, not recorded
    assert (timing.calls, timing.repeats, timing.rho_p, timing.rho_n) == (4 + 3, 3, 0.5, repo.meta.rho_n)
    assert bars == [("timing the halves (7 calls x 3)", 3, "repeat")]
    assert json.loads(index.read_text()).get("half_timing") is None
    recorded = time_repository_halves(model, repo, rho_p=0.5, repeats=1, record=True)
    assert HalfTiming.from_dict(json.loads(index.read_text())["half_timing"]) == recorded
    assert ReferenceRepository.open(repo.root).meta.half_timing == recorded
