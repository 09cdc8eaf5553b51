"""Timing the halves of the cache against dense: build-cache --profile records it, the repository's
own calls time it too (eval), and a call a half cannot serve is never timed as cached. Only the
bookkeeping is asserted; the figures themselves come from ``build-cache --profile`` runs."""

from __future__ import annotations

import json

import pytest
import torch

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.cache.entry import PreparedEntry
from vla_runtime.cache.half_profile import TimingCase, cases_from_repository, time_halves, time_repository_halves
from vla_runtime.cache.halves import HalfTiming
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.cli import main
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import list_episode_bags
from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

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
        assert t.speedup == pytest.approx(t.dense_s / t.cached_s)
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
