"""`vla-runtime eval` plumbing on Meta-World: a couple of short closed-loop episodes, dense and
cached on the same seeds, with a repository built from an expert demonstration. Random weights:
this checks that the harness, the recording and the evaluation bookkeeping agree with each
other, not that the policy succeeds."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import write_episode_bag
from vla_runtime.models.config import preset
from vla_runtime.nodes.profile import CacheSpec, EngineSpec
from vla_runtime.sim.metaworld_env import DEFAULT_CAMERAS, TASK_INSTRUCTIONS, MetaWorldConfig, MetaWorldTask, bag_topics
from vla_runtime.commands.demo import write_random_checkpoint
from vla_runtime.commands import eval as eval_tool
from vla_runtime.testing.progress import RecordingBars
from vla_runtime.commands.eval import (DEFAULT_REFERENCE_TAIL_CALLS, EpisodeResult, EvalSpec, evaluate, paired, pool,
                                       summary as eval_summary)
from vla_runtime.commands.eval import table as eval_table
from vla_runtime.training.metaworld_demos import ACTION_TOPIC, record_episode

TASK = "button-press-topdown-v3"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval")
    env = MetaWorldTask(MetaWorldConfig(TASK, image_size=32, max_steps=150))
    try:
        roll = record_episode(env, seed=3, call_every=4, tail_steps=0)
    finally:
        env.close()
    states = np.stack([f.state for f in roll.episode.frames])
    ckpt = root / "checkpoint"
    write_random_checkpoint(ckpt, preset("pi05-tiny"), list(TASK_INSTRUCTIONS.values()), states, roll.actions.values,
                            DEFAULT_CAMERAS)
    bag = root / "demo"
    write_episode_bag(bag, roll.episode, bag_topics(DEFAULT_CAMERAS), series={ACTION_TOPIC: roll.actions})
    policy = Pi05Policy.from_checkpoint(ckpt, camera_names=list(DEFAULT_CAMERAS))
    call_period = roll.episode.frames[1].t - roll.episode.frames[0].t
    build_repository(policy, policy.checkpoint_hash, [bag], root / "repo", bag_topics(DEFAULT_CAMERAS),
                     call_period, BuildConfig(rho_n=0.5), log=lambda m: None)
    return {"root": root, "checkpoint": ckpt, "repo": root / "repo", "bag": bag}


def test_eval_reports_consistent_numbers(setup):
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "out", tasks=(TASK,), episodes=2,
                    n_execute=4, max_steps=10, image_size=32, repository=setup["repo"])
    bars = RecordingBars()
    report = evaluate(spec, log=lambda m: None, progress=bars)
    # the modes take turns episode by episode, so their times are measured side by side, the one
    # that goes first alternating (the evaluation bar's postfix names each episode as it ends)
    evaluation = bars.postfixes["evaluation (dense, cached in turn)"]
    assert [p.split()[:3] for p in evaluation] == [["dense", TASK, "1/2"], ["cached", TASK, "1/2"],
                                                   ["cached", TASK, "2/2"], ["dense", TASK, "2/2"]]
    on_disk = json.loads((spec.out / "eval.json").read_text())
    lengths = {e.episode_id: e.num_calls for e in ReferenceRepository.open(setup["repo"]).episodes()}
    assert on_disk["max_steps"] == spec.max_steps and on_disk["n_execute"] == spec.n_execute
    assert on_disk["comparison"] == json.loads(json.dumps(report["comparison"], default=float))
    for mode in ("dense", "cached"):
        episodes = report["episodes"][mode]
        overall = report["modes"][mode]["overall"]
        assert [e["seed"] for e in episodes] == [spec.eval_seed, spec.eval_seed + 1]     # same seeds in both modes
        assert overall["episodes"] == 2 and overall["calls"] == sum(e["calls"] for e in episodes)
        assert overall["successes"] == sum(e["success"] for e in episodes)
        for e in episodes:
            assert e["steps"] <= spec.max_steps and e["calls"] == math.ceil(e["steps"] / spec.n_execute)
            assert len(e["call_s"]) == e["calls"] and 0 <= e["cached_calls"] <= e["calls"]
            # the reference that served each call: none in the dense mode, one per cached call
            assert len(e["references"]) == e["calls"]
            served = [r for r in e["references"] if r is not None]
            assert len(served) == (e["cached_calls"] if mode == "cached" else 0)
            assert all(0 <= r[1] < lengths[r[0]] and 0 < r[2] <= 1.0 + 1e-6 for r in served)
    cached = report["modes"]["cached"]["overall"]
    assert cached["fallback_rate"] == pytest.approx(1 - cached["cached_calls"] / cached["calls"])
    cached_episodes = report["episodes"]["cached"]
    assert cached["episodes_with_fallback"] == sum(e["cached_calls"] < e["calls"] for e in cached_episodes)
    ok = [e for e in cached_episodes if e["success"]]
    assert cached["fallback_rate_in_successes"] == (
        pytest.approx(1 - sum(e["cached_calls"] for e in ok) / sum(e["calls"] for e in ok)) if ok else None)
    assert report["modes"]["dense"]["overall"]["cached_calls"] == 0
    assert report["modes"]["dense"]["overall"]["fallback_rate"] is None
    assert report["modes"]["dense"]["overall"]["episodes_with_fallback"] is None
    assert report["modes"]["cached"]["overall"]["cached_calls"] >= 1       # the demo's pose is near enough
    assert "select" in report["modes"]["cached"]["overall"]["mean_phase_s"]       # in the vision stage, no round trip
    assert "retrieve" not in report["modes"]["cached"]["overall"]["mean_phase_s"]
    assert set(report["comparison"]["cached_overheads_s"]) >= {"select", "episode_start"}
    pr = report["comparison"]["paired"]["overall"]
    assert pr["pairs"] == 2 and pr["both"] + pr["dense_only"] + pr["other_only"] + pr["neither"] == 2
    assert pr["difference_points"] == pytest.approx(report["comparison"]["success_points"])   # same seeds
    assert report["comparison"]["paired"]["per_task"][TASK]["pairs"] == 2
    # the call time seed by seed: two seeds, too few for an interval
    by_seed = report["comparison"]["by_seed"]["per_call"]
    dense_eps, cached_eps = report["episodes"]["dense"], report["episodes"]["cached"]
    assert by_seed["pairs"] == 2 and by_seed["interval95"] is None
    assert by_seed["median"] == pytest.approx(np.mean([np.mean(d["call_s"]) / np.mean(c["call_s"])
                                                       for d, c in zip(dense_eps, cached_eps)]))
    table = (spec.out / "eval.md").read_text()
    assert TASK in table and "cached vs dense" in table and "| fallback |" in table and "seed by seed" in table
    assert "more than 3 matches to a reference's last call (past the references)" in table   # the default rule
    # a task none of whose reference episodes succeeded is named: its cached episodes ran dense
    assert "no reference episode succeeded" not in table
    unreferenced = eval_table({**report, "repository": {"reference_successes": {TASK: 0}}})
    assert f"no reference episode succeeded for {TASK}: the repository has nothing for it" in unreferenced
    assert (spec.out / "eval.png").stat().st_size > 1000
    # what `auto` would pick: the given repository records no timing, so eval timed the halves on its
    # calls, reports them, and leaves the repository it was given as it was
    auto = report["auto"]
    assert auto["timing_source"] == "timed by eval on the repository's calls"
    for half in ("context_cache", "action_cache"):
        h = auto["half_timing"][half]   # run where the paired ratio's interval lies above 1.0
        assert auto[half] == (h["ratio_low"] > 1.0 if h["ratio_low"] is not None else h["speedup"] > 1.0)
    assert ReferenceRepository.open(setup["repo"]).meta.half_timing is None
    assert on_disk["auto"]["reason"] == auto["reason"] and "with `auto` on this machine the runtime would run" in table
    # every bar ran to its total and was closed; what the command prints is the table, one
    # paragraph reading it with the report's own figures, and where the files are: no JSON
    assert all(b.closed and b.count == b.total for b in bars.bars)
    printed = eval_summary(report, spec.out)
    assert [line for line in printed.splitlines() if line.startswith("|")] == \
        [line for line in table.splitlines() if line.startswith("|")][:4]      # header, rule, the task, overall
    assert "{" not in printed and all(str(spec.out / f) in printed for f in ("eval.json", "eval.md", "eval.png"))
    # what a pipeline with `auto` would then do, by this run's own cost of choosing a reference
    assert report["modes"]["cached"]["overall"]["mean_phase_s"]["select"] > 0
    for saving_s, verdict in ((1e-9, "run dense after its first 50 calls"), (10.0, "keep it")):
        text = eval_tool.reading({**report, "auto": {**auto, "saving_s": saving_s}})
        assert f"by this run a pipeline with `auto` would {verdict}" in text
    paragraph = printed.split("\n\n")[1]
    assert "\n\n" not in paragraph.strip() and paragraph in printed and paragraph.replace("\n", " ") in table
    c, pr = report["comparison"], report["comparison"]["paired"]["overall"]
    bs = c["by_seed"]["per_call"]
    assert (f"({c['speedup_per_call']:.2f}x; seed by seed {bs['median']:.2f}x over 2 seeds, the vision phase (the "
            f"same work in both) {c['by_seed']['vision']['median']:.2f}x)") in paragraph.replace("\n", " ")
    assert f"On the same {pr['pairs']} seeds" in paragraph
    # the net per call counts what the selection, begun beside the vision tower, took from the tower
    dp, cp = (report["modes"][m]["overall"]["mean_phase_s"] for m in ("dense", "cached"))
    net = (dp["prefill"] + dp["denoise"] - cp["prefill"] - cp["denoise"] - cp.get("select", 0.0)
           - (cp["vision"] - dp["vision"]))
    assert f"Net, the cache {'saves' if net > 0 else 'costs'} {abs(net) * 1e3:.1f} ms per call" in \
        paragraph.replace("\n", " ")


def test_eval_refuses_overlapping_seeds(setup, tmp_path):
    with pytest.raises(ValueError, match="overlap"):
        EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path, eval_seed=10, episodes=5, reference_seed=12)


def test_a_cached_run_with_nothing_for_the_task_repeats_the_dense_run_seed_for_seed(setup):
    """Both modes draw the same noise on a seed: where the repository has nothing (another task),
    every cached call falls back to dense and each episode is the dense one, step for step. The
    resampled mode (the dense policy on other noise) is the scale: its episodes differ."""
    other = "drawer-close-v3"
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "out_other", tasks=(other,), episodes=2,
                    n_execute=4, max_steps=12, image_size=32, repository=setup["repo"],
                    modes=("dense", "cached", "resampled"))
    report = evaluate(spec, log=lambda m: None)
    assert report["modes"]["cached"]["overall"]["cached_calls"] == 0
    assert report["modes"]["cached"]["overall"]["fallback_rate"] == 1.0
    pr = report["comparison"]["paired"]["overall"]
    assert pr["identical_episodes"] == pr["pairs"] == 2 and pr["dense_only"] == pr["other_only"] == 0
    for d, c in zip(report["episodes"]["dense"], report["episodes"]["cached"]):
        assert d["seed"] == c["seed"] and d["steps"] == c["steps"] and len(d["final_state"]) == 4
        assert d["final_state"] == c["final_state"]
    baseline = report["noise_baseline"]["overall"]
    assert baseline["pairs"] == 2 and baseline["identical_episodes"] < 2
    assert report["noise_baseline"]["per_task"][other]["pairs"] == 2
    assert "| task | both | dense only | resampled only |" in (spec.out / "eval.md").read_text()


def test_a_threshold_no_reference_reaches_turns_every_cached_call_dense(setup):
    """--min-similarity reaches the cache manager's retrieval: at 1.0 every query falls back and the
    cached episode is the dense one, step for step (the same noise on the seed)."""
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "out_floor", tasks=(TASK,), episodes=1,
                    n_execute=4, max_steps=12, image_size=32, repository=setup["repo"], min_similarity=1.0,
                    first_scene_floor=True, max_end_matches=0)
    report = evaluate(spec, log=lambda m: None)
    assert report["min_similarity"] == 1.0 and report["first_scene_floor"] is True
    assert report["repository"]["first_call_floors"] == {}       # one reference episode: no floor to set
    cached = report["modes"]["cached"]["overall"]
    assert cached["cached_calls"] == 0 and cached["fallback_rate"] == 1.0
    assert report["episodes"]["cached"][0]["references"] == [None] * report["episodes"]["cached"][0]["calls"]
    assert report["comparison"]["paired"]["overall"]["identical_episodes"] == 1
    (reason,) = report["episodes"]["cached"][0]["dense_reasons"]
    assert reason.startswith("fallback: best visual similarity") and "< 1.0" in reason
    md = (spec.out / "eval.md").read_text()
    assert "similarity below 1; no first-scene floor (no task has two reference episodes)" in md
    assert "past the references" not in md and report["max_end_matches"] == 0      # 0: no limit
    with pytest.raises(ValueError, match="min_similarity"):
        EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "x", min_similarity=0.0)


def _episode(task: str, seed: int, success: bool) -> EpisodeResult:
    return EpisodeResult(task, seed, success, 10, 3, 0, [], {}, {})


def test_paired_difference_counts_discordant_seeds_and_its_standard_error():
    outcomes = [(True, True)] * 5 + [(True, False)] * 3 + [(False, True)] + [(False, False)]
    dense = [_episode("t", i, d) for i, (d, _) in enumerate(outcomes)]
    cached = [_episode("t", i, c) for i, (_, c) in reversed(list(enumerate(outcomes)))]   # matched by seed
    pr = paired(dense, cached)
    assert (pr["pairs"], pr["both"], pr["dense_only"], pr["other_only"], pr["neither"]) == (10, 5, 3, 1, 1)
    diffs = np.array([int(c) - int(d) for d, c in outcomes], dtype=float)
    assert pr["difference_points"] == pytest.approx(100 * diffs.mean())
    assert pr["standard_error_points"] == pytest.approx(100 * diffs.std(ddof=1) / np.sqrt(10))
    lo, hi = pr["interval95_points"]
    assert lo < pr["difference_points"] < hi
    assert paired(dense, [])["difference_points"] is None and paired(dense, [])["pairs"] == 0


def test_the_modes_take_turns_going_first():
    assert [eval_tool.mode_order(("dense", "cached"), i) for i in range(3)] == \
        [("dense", "cached"), ("cached", "dense"), ("dense", "cached")]
    assert eval_tool.mode_order(("dense",), 1) == ("dense",)


def _timed(task: str, seed: int, call_s: list[float], vision_s: list[float]) -> EpisodeResult:
    return EpisodeResult(task, seed, True, 10, len(call_s), 0, call_s, {"vision": vision_s}, {})


def test_speed_by_seed_is_the_median_of_each_seeds_mean_call_ratio_with_its_interval():
    """Seed i: dense calls of mean (1 + i) / 10 s against cached ones of mean (1 + i) / 11 s, a
    1.1x ratio on every seed whatever its length, except seeds 0 and 1 (3.0x and 0.5x, the tails)
    and seed 9, which only dense ran (no pair). The overall means would weigh the long seeds;
    the median of the 9 ratios is 1.1, and the interval at n = 9 is the 2nd smallest to the 2nd
    largest (P(B <= 1) = 10/512 <= 0.025 < P(B <= 2) = 46/512). The vision phase, its own
    control, is 1.05x on the 5 even seeds and 0.95x on the 4 odd ones."""
    dense, cached = [], []
    for i in range(10):
        d = (1 + i) / 10
        c = {0: d / 3.0, 1: d / 0.5}.get(i, d / 1.1)
        dense.append(_timed("t", i, [d * 0.5, d * 1.5], [0.01] * 2))
        if i < 9:
            cached.append(_timed("t", i, [c] * (i + 1), [0.01 / (1.05 if i % 2 == 0 else 0.95)] * (i + 1)))
    got = eval_tool.speed_by_seed(dense, list(reversed(cached)))
    call = got["per_call"]
    assert call["pairs"] == 9 and call["median"] == pytest.approx(1.1)
    assert call["interval95"] == pytest.approx([1.1, 1.1])
    vision = got["vision"]
    assert vision["pairs"] == 9 and vision["median"] == pytest.approx(1.05)
    assert vision["interval95"] == pytest.approx([0.95, 1.05])
    assert eval_tool.speed_by_seed(dense, []) == {"per_call": None, "vision": None}


def test_the_context_cache_alone_serves_the_prefill_and_denoises_dense(setup):
    """``caches=("context",)`` (``--caches context``): calls with a reference count as cached (the
    prefill reused it) while the Action Cache stays off; bad cache names are refused."""
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "out_context", tasks=(TASK,), episodes=1,
                    n_execute=4, max_steps=8, image_size=32, repository=setup["repo"], modes=("cached",),
                    caches=("context",))
    report = evaluate(spec, log=lambda m: None)
    assert report["caches"] == ["context"]
    assert report["modes"]["cached"]["overall"]["cached_calls"] >= 1
    # one mode alone: the paragraph reads its own success and call time (nothing to compare)
    a = report["modes"]["cached"]["overall"]
    assert f"The cached policy succeeded on {a['successes']} of {a['episodes']} episodes" in \
        (spec.out / "eval.md").read_text()
    with pytest.raises(ValueError, match="caches must be"):
        EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"], caches=("prefill",))
    with pytest.raises(ValueError, match="caches must be"):
        EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"], caches=())


def test_caches_auto_runs_what_the_runtime_picks_from_the_recorded_timing(setup, tmp_path, monkeypatch):
    """``--caches auto``: the cached mode's pipeline gets ``auto`` for both halves (it decides at
    start-up as on a robot), and the report says what that resolves to from the timing the
    repository records: here the Action Cache measured slower than dense, so it is off."""
    from vla_runtime.cache.halves import HalfTiming, PhaseTiming

    repo_dir = tmp_path / "repo"
    shutil.copytree(setup["repo"], repo_dir)
    ReferenceRepository.open(repo_dir).record_half_timing(HalfTiming(
        PhaseTiming(0.010, 0.008, 6), PhaseTiming(0.010, 0.012, 6), device="cpu", threads=1, dtype="float32",
        rho_p=0.4, rho_n=0.5, calls=2, repeats=3))
    settings = []
    real = eval_tool.CacheSpec

    def spy(**kw):
        settings.append((kw["enabled"], kw["context_cache"], kw["action_cache"]))
        return real(**kw)
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "out", tasks=(TASK,), episodes=1, n_execute=4,
                    max_steps=8, image_size=32, repository=repo_dir, modes=("cached",), caches=("auto",))
    monkeypatch.setattr(eval_tool, "CacheSpec", spy)
    report = evaluate(spec, log=lambda m: None)
    assert settings == [(True, "auto", "auto")]
    assert report["caches"] == ["auto"]
    halves = report["cached_halves"]
    assert (halves["context_cache"], halves["action_cache"]) == (True, False)
    assert "runs what `auto` picks" in (spec.out / "eval.md").read_text()
    assert eval_tool.half_settings(("context",)) == ("on", "off")
    for bad in (("auto", "context"), ("auto", "auto")):
        with pytest.raises(ValueError, match="caches must be"):
            EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path, caches=bad)


@pytest.mark.parametrize("given", [False, True])
def test_a_repository_built_by_eval_runs_at_profiled_ratios_unless_given(setup, tmp_path, monkeypatch, given):
    """Built by ``eval`` the repository's ratios are profiled on its own reference episodes (one
    held out per task here) and adopted: masks at the profiled rho_n, the cached mode at the
    profiled rho_p. Given ratios are used as they are, without profiling."""
    bags = []
    for k in range(2):   # two "successful reference episodes" of the task: the expert's demo, twice
        shutil.copytree(setup["bag"], tmp_path / f"ref{k}")
        bags.append(tmp_path / f"ref{k}")
    monkeypatch.setattr(eval_tool, "record_references", lambda spec, log, progress: (bags, {TASK: 2}))
    ratios = {"rho_p": 0.6, "rho_n": 0.75} if given else {}
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "out", tasks=(TASK,), episodes=1, n_execute=4,
                    max_steps=4, image_size=32, profile_episodes=1, engine=EngineSpec(threads=1), **ratios)
    report = evaluate(spec, log=lambda m: None)
    repo = report["repository"]
    assert repo["built"] and bool(repo["profile"]) != given
    # references recorded here go past their success, and then need no fallback past them
    assert (report["reference_tail_calls"], report["max_end_matches"]) == (DEFAULT_REFERENCE_TAIL_CALLS, 0)
    if given:
        assert (repo["rho_p"], repo["rho_n"]) == (0.6, 0.75)
    else:
        points = {(p["rho_p"], p["rho_n"]) for p in repo["profile"]}
        assert (repo["rho_p"], repo["rho_n"]) in points
        chosen = next(p for p in repo["profile"] if (p["rho_p"], p["rho_n"]) == (repo["rho_p"], repo["rho_n"]))
        assert chosen["mean_deviation"] <= spec.tolerance
    built = ReferenceRepository.open(tmp_path / "out" / "repository", verify=False)
    assert built.meta.rho_n == repo["rho_n"]
    # the masks were profiled at that rho_n: K = ceil(rho_n * H) neurons per layer (an effect of
    # the ratio, not its echo)
    episode = built.episodes()[0].episode_id
    assert built.load_call(episode, 0).masks.shape[-1] == math.ceil(repo["rho_n"] * preset("pi05-tiny").expert.mlp_dim)
    assert ("profiled on the reference episodes" in (tmp_path / "out" / "eval.md").read_text()) != given
    assert repo["ratios_from"] == ("given" if given else "profiled on the reference episodes")
    # the halves' timing: build-cache's own when it profiled, else eval's; in the repository either way
    recorded = ReferenceRepository.open(tmp_path / "out" / "repository", verify=False).meta.half_timing
    assert recorded is not None and report["auto"]["half_timing"] == recorded.as_dict()
    assert report["auto"]["timing_source"] == ("timed by eval on the repository's calls (now recorded in it)" if given
                                               else "recorded by build-cache --profile")
    assert recorded.rho_p == repo["rho_p"] and recorded.rho_n == repo["rho_n"]
    assert recorded.threads == 1      # timed at the pipeline's thread count (engine.threads)


def test_mask_groups_set_the_groups_of_the_repository_built_here(setup, tmp_path, monkeypatch):
    """``mask_groups`` reaches the repository eval builds (its masks, its index, the report and
    eval.md); a given repository keeps its own, so asking for both is refused, as is a count < 1."""
    shutil.copytree(setup["bag"], tmp_path / "ref0")
    monkeypatch.setattr(eval_tool, "record_references", lambda spec, log, progress: ([tmp_path / "ref0"], {TASK: 1}))
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "out", tasks=(TASK,), episodes=1, n_execute=4,
                    max_steps=4, image_size=32, rho_p=0.6, rho_n=0.75, mask_groups=1, modes=("cached",),
                    engine=EngineSpec(threads=1))
    report = evaluate(spec, log=lambda m: None)
    steps = preset("pi05-tiny").num_steps
    built = ReferenceRepository.open(tmp_path / "out" / "repository", verify=False)
    assert built.meta.mask_groups == report["repository"]["mask_groups"] == [[0, steps]]
    assert built.load_call(built.episodes()[0].episode_id, 0).masks.shape[0] == 1
    assert f"Action Cache mask groups 0-{steps}" in (tmp_path / "out" / "eval.md").read_text()
    with pytest.raises(ValueError, match="a given repository keeps its own"):
        EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path, repository=setup["repo"], mask_groups=1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="mask_groups must be a whole number >= 1"):
            EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path, mask_groups=bad)


def test_the_eval_command_passes_mask_groups_to_its_spec(tmp_path, monkeypatch):
    """``vla-runtime eval --mask-groups N`` reaches ``EvalSpec.mask_groups`` (None without it):
    the command line, not only the spec, sets a built repository's groups."""
    from vla_runtime.cli import main as cli_main

    specs: list[EvalSpec] = []
    monkeypatch.setattr(eval_tool, "evaluate", lambda spec, log, progress: specs.append(spec) or {})
    monkeypatch.setattr(eval_tool, "summary", lambda report, out: "")
    base = ["eval", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]
    assert cli_main([*base, "--mask-groups", "1"]) == 0
    assert cli_main(base) == 0
    assert [s.mask_groups for s in specs] == [1, None]


def test_the_cached_mode_forces_the_halves_whatever_auto_would_pick(setup, tmp_path):
    """A repository whose recorded timing has both halves slower than dense: ``auto`` would run
    dense, but the cached mode forces the halves ``caches`` names, so its success is the cache's."""
    from vla_runtime.cache.halves import HalfTiming, PhaseTiming

    repo = tmp_path / "repo"
    shutil.copytree(setup["repo"], repo)
    slow = PhaseTiming(0.01, 0.02, 2)
    ReferenceRepository.open(repo).record_half_timing(HalfTiming(slow, slow, "cpu", 1, "float32", 0.4, 0.5, 1, 2))
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "out", tasks=(TASK,), episodes=1, n_execute=4,
                    max_steps=8, image_size=32, repository=repo, modes=("cached",))
    report = evaluate(spec, log=lambda m: None)
    assert not report["auto"]["context_cache"] and not report["auto"]["action_cache"]
    assert "effectively dense" in report["auto"]["reason"]
    assert report["auto"]["timing_source"] == "recorded by build-cache --profile"
    assert report["modes"]["cached"]["overall"]["cached_calls"] >= 1
    with eval_tool._pipeline(spec, "cached", repo, f"force{os.getpid()}") as pipeline:
        assert (pipeline.spec.cache.context_cache, pipeline.spec.cache.action_cache) == ("on", "on")
        cc = pipeline.policy.worker.cache
        assert (cc.context_cache, cc.action_cache) == (True, True) and "forced by the profile" in cc.reason


def test_eval_pool_pairs_the_seeds_of_several_runs_once_each(setup, tmp_path, capsys):
    """``eval-pool``: runs on other seeds pool seed by seed (counts add up, each seed once);
    dense of one run against dense of another is the noise scale; a seed pooled twice or
    another checkpoint is refused."""
    from vla_runtime.cli import main as cli_main

    runs = []
    for first in (200_000, 200_001):   # two runs of one seed each, as extra seeds run side by side
        spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / f"run{first}", tasks=(TASK,), episodes=1,
                        eval_seed=first, n_execute=4, max_steps=8, image_size=32, repository=setup["repo"])
        evaluate(spec, log=lambda m: None)
        runs.append(spec.out)
    pooled = pool(runs)
    reports = [json.loads((r / "eval.json").read_text()) for r in runs]
    assert pooled["paired"]["overall"]["pairs"] == 2
    assert pooled["dense"]["successes"] == sum(r["modes"]["dense"]["overall"]["successes"] for r in reports)
    assert pooled["other"]["successes"] == sum(r["modes"]["cached"]["overall"]["successes"] for r in reports)
    # the call time seed by seed, each seed's two episodes from its own run (where they ran side by side)
    ratios = [np.mean(r["episodes"]["dense"][0]["call_s"]) / np.mean(r["episodes"]["cached"][0]["call_s"])
              for r in reports]
    assert pooled["by_seed"]["per_call"]["pairs"] == 2
    assert pooled["by_seed"]["per_call"]["median"] == pytest.approx(np.mean(ratios))
    across = pool([runs[0]], [runs[0]], other_mode="dense")      # a run against itself: every episode identical
    assert across["paired"]["overall"]["identical_episodes"] == 1
    assert across["by_seed"] is None                              # the sides were not timed side by side
    with pytest.raises(ValueError, match="appear twice"):
        pool([runs[0], runs[0]])
    with pytest.raises(ValueError, match="no 'resampled' episodes"):
        pool(runs, other_mode="resampled")
    other = json.loads((runs[1] / "eval.json").read_text())
    other["checkpoint"] = "/elsewhere"
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "eval.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different checkpoints"):
        pool([runs[0], tmp_path / "moved"])
    assert cli_main(["eval-pool", *map(str, runs), "--out", str(tmp_path / "pool.json")]) == 0
    printed = capsys.readouterr().out
    assert "| overall |" in printed
    assert f"call time dense over cached, seed by seed {pooled['by_seed']['per_call']['median']:.2f}x over 2 seeds" in printed
    assert json.loads((tmp_path / "pool.json").read_text())["paired"]["overall"]["pairs"] == 2


def test_repository_from_a_lerobot_dataset(setup, tmp_path):
    """eval --reference-dataset: the repository is built from an exported demonstration dataset,
    one reference call per dataset frame, the same calls (states) as the demonstration's bag."""
    from vla_runtime.io.bags import list_episode_bags, read_episode
    from vla_runtime.training.metaworld_demos import main as demos_main

    demos = tmp_path / "demos"
    assert demos_main(["--out", str(demos), "--tasks", TASK, "--episodes", "1", "--image-size", "32",
                       "--workers", "1", "--max-steps", "150", "--format", "lerobot"]) == 0
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "out", tasks=(TASK,), episodes=1, image_size=32,
                    reference_dataset=demos / "lerobot", rho_p=0.4, rho_n=0.5)
    repo_path, info = eval_tool.build_reference_repository(spec, log=lambda m: None)
    assert info["reference_successes"] == {TASK: 1} and info["reference_dataset"] == str(demos / "lerobot")
    repo = ReferenceRepository.open(repo_path)
    (rec,) = repo.episodes()
    bag = list_episode_bags(demos)[0]
    ep = read_episode(bag, bag_topics(DEFAULT_CAMERAS), call_period=4 * 0.0125)
    assert rec.num_calls == len(ep.frames) and rec.task == TASK_INSTRUCTIONS[TASK]
    stored = repo.load_episode(rec.episode_id)
    for i, frame in enumerate(ep.frames):
        np.testing.assert_array_equal(stored.call(i).state.numpy(), frame.state.astype(np.float32))
    with pytest.raises(ValueError, match="not both"):
        EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path / "x", repository=setup["repo"],
                 reference_dataset=demos / "lerobot")


class _ScriptedTask:
    """A task that succeeds from step ``succeed_at`` on (and stays so), with Meta-World's done rule
    (success, or the step limit): ``run_episode``'s bookkeeping without physics."""

    instruction = "press the button"

    def __init__(self, succeed_at: int | None, max_steps: int):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(task=TASK, max_steps=max_steps)
        self.succeed_at, self.steps = succeed_at, 0

    def reset(self, seed: int) -> np.ndarray:
        self.steps = 0
        return self._state()

    def _state(self) -> np.ndarray:
        return np.full(4, float(self.steps), np.float32)

    def render(self) -> dict:
        return {"corner": np.zeros((2, 2, 3), np.uint8)}

    def step(self, action):
        from vla_runtime.sim.metaworld_env import StepResult

        self.steps += 1
        success = self.succeed_at is not None and self.steps >= self.succeed_at
        return StepResult(self._state(), success, success or self.steps >= self.cfg.max_steps, {})


class _DensePipeline:
    """Zero chunks, every call dense: what ``run_episode`` asks of a pipeline."""

    last_episode_start_s, last_times, last_choice = 0.0, {}, None

    def start_episode(self, task: str, noise_seed: int) -> None:
        pass

    def call(self, images, state, task):
        from types import SimpleNamespace

        return SimpleNamespace(chunk=np.zeros((8, 4), np.float32), cached=False)


@pytest.mark.parametrize("succeed_at, max_steps, tail, calls, steps, frame_states", [
    (6, 40, 0, 2, 6, [0, 4]),               # stops at the success step
    (6, 40, 2, 4, 16, [0, 4, 8, 12]),       # the success call's chunk, then 2 calls more
    (6, 10, 2, 3, 10, [0, 4, 8]),           # the step limit ends the tail
    (None, 10, 2, 3, 10, [0, 4, 8]),        # a failure has no tail
])
def test_references_recorded_past_their_success_go_on_for_the_tail_calls(succeed_at, max_steps, tail, calls, steps,
                                                                         frame_states):
    env = _ScriptedTask(succeed_at, max_steps)
    r = eval_tool.run_episode(env, _DensePipeline(), seed=0, n_execute=4, record=True, tail_calls=tail)
    assert (r.calls, r.steps, r.success) == (calls, steps, succeed_at is not None)
    assert [float(f.state[0]) for f in r.frames] == frame_states   # a frame recorded at each call


def test_tail_calls_are_validated(tmp_path):
    with pytest.raises(ValueError, match="reference_tail_calls must be an int >= 0, got -1"):
        EvalSpec(checkpoint=tmp_path, out=tmp_path, reference_tail_calls=-1)


def test_the_fallback_past_the_references_is_off_only_for_references_recorded_here_past_their_success(setup):
    """References eval records go on ``DEFAULT_REFERENCE_TAIL_CALLS`` calls past their success, and
    then need no fallback past the references (at pi05-mw: 99.7 % of calls cached at the success
    of the run with the fallback, docs/cache.md); a given repository or dataset may hold references
    that end at their success, so it keeps the profile's default, as does a run recording up to
    the success; a value given always wins."""
    base = dict(checkpoint=setup["checkpoint"], out=setup["root"] / "x")
    assert EvalSpec(**base).reference_tail_calls == DEFAULT_REFERENCE_TAIL_CALLS > 0
    assert EvalSpec(**base).max_end_matches == 0
    assert EvalSpec(**base, reference_tail_calls=0).max_end_matches == CacheSpec.max_end_matches > 0
    assert EvalSpec(**base, repository=setup["repo"]).max_end_matches == CacheSpec.max_end_matches
    assert EvalSpec(**base, reference_dataset=setup["root"]).max_end_matches == CacheSpec.max_end_matches
    assert EvalSpec(**base, max_end_matches=2).max_end_matches == 2
    with pytest.raises(ValueError, match="max_end_matches"):
        EvalSpec(**base, max_end_matches=-1)
