"""The three stages without ROS: in one process and in three, with the muscle-memory cache.

The chunks equal an independent in-process computation (cached engine + cache manager on one
model), the three-process pipeline equals the one-process one, and a cache that is refused or
dies mid-run turns calls dense instead of stopping them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.cache.manager import CacheManager
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.cache.retrieval import first_call_floors
from vla_runtime.cli import main as cli_main
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.io.bags import list_episode_bags
from vla_runtime.nodes.pipeline import LocalPipeline, PipelineSpec, ProcessPipeline
from vla_runtime.nodes.profile import CacheSpec
from vla_runtime.nodes.stages import CacheStage, RingNames, episode_noise_key, manager_config

CAMS = ("top", "wrist")


def _rings(tag: str) -> RingNames:
    return RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_q", f"t{os.getpid()}_{tag}_w")


def _spec(demo: dict, tag: str, repository: str | None = None, enabled: bool = True, **halves: bool) -> PipelineSpec:
    cache = CacheSpec(enabled=enabled, repository=repository or str(demo["repo"]), reference_timeout_s=60.0, **halves)
    return PipelineSpec(Path(demo["checkpoint"]), CAMS, cache, rings=_rings(tag), seed=3, time_available_s=10.0)


def _run(pipeline, episode) -> list[tuple[np.ndarray, bool, object]]:
    out = []
    for frame in episode.frames:
        res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
        choice = pipeline.last_choice
        out.append((res.chunk, res.used_reference, None if choice is None else (choice.episode, choice.index)))
    return out


def _expected(demo: dict, seed: int, **halves: bool) -> list[tuple[np.ndarray, object]]:
    """The same calls through the cached engine and the cache manager, on one model in this process."""
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    repo = ReferenceRepository.open(demo["repo"])
    # the cache manager stage's own configuration (fallback rules included)
    manager = CacheManager(policy.engine.model, repo,
                           manager_config(CacheSpec(enabled=True, repository=str(demo["repo"])), repo))
    engine = CachedEngine(policy.engine.model, CacheConfig(rho_p=0.4, rho_n=repo.meta.rho_n,
                                                           groups=tuple(tuple(g) for g in repo.meta.mask_groups),
                                                           **halves))
    episode = demo["episode"]
    manager.start_episode(episode.task)
    out = []
    for i, frame in enumerate(episode.frames):
        manager.observe_state(torch.as_tensor(frame.state))
        noise = policy.engine.make_noise(1, torch.Generator().manual_seed(seed * 1_000_003 + i))
        res = engine.infer(policy.prepare(Observation(frame.images, frame.state, episode.task)), noise=noise,
                           select=manager.select)
        out.append((policy.action_norm.unnormalize(res.actions[0]).numpy(),
                    None if res.reference is None else res.reference.key))
        manager.prepare(10.0)
    return out


def test_one_process_pipeline_equals_the_cached_engine(demo):
    with LocalPipeline(_spec(demo, "local")) as pipeline:
        got = _run(pipeline, demo["episode"])
    expected = _expected(demo, seed=3)
    assert sum(used for _, used, _ in got) >= len(got) - 1          # the cache served the calls
    for (chunk, used, key), (want, want_key) in zip(got, expected):
        assert (key if used else None) == want_key
        np.testing.assert_allclose(chunk, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("half", ["context_cache", "action_cache"])
def test_one_half_of_the_cache_alone_equals_the_engine_with_that_half(demo, half):
    """``cache.context_cache`` / ``cache.action_cache`` off: the pipeline runs the other half only,
    as the cached engine configured so does; a call counts as cached when either half served it."""
    with LocalPipeline(_spec(demo, f"half{half}", **{half: False})) as pipeline:
        results = [pipeline.call(f.images, np.asarray(f.state), demo["episode"].task) for f in demo["episode"].frames]
    expected = _expected(demo, seed=3, **{half: False})
    for res, (want, _) in zip(results, expected):
        np.testing.assert_allclose(res.chunk, want, rtol=0, atol=1e-6)
    assert any(r.cached for r in results)
    assert all(r.used_reference == (half == "context_cache") for r in results if r.cached)
    assert all(bool(r.meta.context_cache) == (half == "action_cache") for r in results if r.cached)


def test_three_processes_equal_one_process(demo):
    with LocalPipeline(_spec(demo, "one")) as pipeline:
        one = _run(pipeline, demo["episode"])
    with ProcessPipeline(_spec(demo, "three")) as pipeline:
        three = _run(pipeline, demo["episode"])
        assert set(pipeline.last_times) >= {"vision", "retrieve", "prefill", "denoise"}
    assert [(u, k) for _, u, k in three] == [(u, k) for _, u, k in one]
    for (a, _, _), (b, _, _) in zip(three, one):
        np.testing.assert_array_equal(a, b)


def test_episode_prepared_ahead_gives_the_same_chunks_with_its_window_loaded_before_the_first_call(demo):
    """``start_episode(task)``: the cache manager loads the task pack and the initial window when
    the episode is announced (a robot resetting), not inside the first call; the calls are the
    same, and the first one no longer pays for the window (nor starts the episode again)."""
    episode = demo["episode"]
    with LocalPipeline(_spec(demo, "ahead")) as pipeline:
        pipeline.start_episode(episode.task)
        worker = pipeline.cache.worker
        assert worker.episodes_started == 1 and worker.manager.task == episode.task
        assert len(worker.manager.entries) > 0                 # the window is there before any call
        ahead = _run(pipeline, episode)
        assert worker.episodes_started == 1
        pipeline.start_episode()                        # no task: the next call starts the episode itself
        assert worker.episodes_started == 1
    with ProcessPipeline(_spec(demo, "ahead3")) as pipeline:
        pipeline.start_episode(episode.task)
        three = _run(pipeline, episode)
    with LocalPipeline(_spec(demo, "lazy")) as pipeline:
        lazy = _run(pipeline, episode)
    for got in (ahead, three):
        assert [(u, k) for _, u, k in got] == [(u, k) for _, u, k in lazy]
        for (a, _, _), (b, _, _) in zip(got, lazy):
            np.testing.assert_array_equal(a, b)


def test_without_the_cache_the_pipeline_is_the_dense_policy(demo):
    episode = demo["episode"]
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    with ProcessPipeline(_spec(demo, "dense", enabled=False)) as pipeline:
        assert set(pipeline.processes) == {"vision", "policy"}
        for i, frame in enumerate(episode.frames[:2]):
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
            want = policy.predict(Observation(frame.images, frame.state, episode.task),
                                  generator=torch.Generator().manual_seed(3 * 1_000_003 + i)).actions
            assert not res.used_reference and pipeline.last_choice is None
            np.testing.assert_allclose(res.chunk, want, rtol=0, atol=1e-5)


def test_a_seeded_episode_draws_its_own_noise_whatever_ran_before(demo):
    """``start_episode(noise_seed=s)``: call i of the episode denoises from the noise of
    ``episode_noise_key(s, i)``, in one process or three, however many calls the pipeline made
    before; so dense and cached runs of one seeded episode start from the same noise (eval)."""
    episode = demo["episode"]
    frames = episode.frames
    assert len(frames) >= 2
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    want = [policy.predict(Observation(f.images, f.state, episode.task),
                           generator=torch.Generator().manual_seed(3 * 1_000_003 + episode_noise_key(7, i))).actions
            for i, f in enumerate(frames)]

    def seeded(pipeline, seed: int) -> list[np.ndarray]:
        pipeline.start_episode(episode.task, noise_seed=seed)
        return [pipeline.call(f.images, np.asarray(f.state), episode.task).chunk for f in frames]

    with LocalPipeline(_spec(demo, "noise1", enabled=False)) as pipeline:
        first = seeded(pipeline, 7)
        other = seeded(pipeline, 8)
    with ProcessPipeline(_spec(demo, "noise3", enabled=False)) as pipeline:
        pipeline.start_episode(episode.task)                 # an unseeded episode of 2 calls first
        for f in episode.frames[:2]:
            pipeline.call(f.images, np.asarray(f.state), episode.task)
        later = seeded(pipeline, 7)
        assert pipeline.numbering.seq == 2 + len(frames) and pipeline.episode == 2
    for a, b, w in zip(first, later, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, w, rtol=0, atol=1e-5)
    assert not np.allclose(first[0], other[0])               # another seed, other noise
    with LocalPipeline(_spec(demo, "noisebad", enabled=False)) as pipeline:
        with pytest.raises(ValueError, match="episode seed"):
            pipeline.start_episode(episode.task, noise_seed=-1)


def test_the_profiles_fallback_settings_reach_the_retriever(demo):
    repo = ReferenceRepository.open(demo["repo"])
    default = manager_config(CacheSpec(enabled=True, repository=str(demo["repo"])), repo).retrieval
    assert default.min_similarity == 0.8 and default.first_call_floor == {} and default.max_end_matches == 3
    tuned = manager_config(CacheSpec(enabled=True, repository=str(demo["repo"]), min_similarity=0.7,
                                     first_scene_floor=True, max_end_matches=5), repo).retrieval
    assert tuned.min_similarity == 0.7 and tuned.max_end_matches == 5
    assert tuned.first_call_floor == first_call_floors(repo) and set(tuned.first_call_floor) == set(repo.tasks())
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    stage = CacheStage(policy, CacheSpec(enabled=True, repository=str(demo["repo"]), first_scene_floor=True,
                                         max_end_matches=5), RingNames.tagged(f"floor{os.getpid()}"))
    try:   # what the cache manager node says at start-up
        assert stage.fallback_rule.startswith("a best visual similarity below 0.8; a first scene below the floor of ")
        assert all(repr(t) in stage.fallback_rule for t in repo.tasks())
        assert stage.fallback_rule.endswith("; more than 5 matches to a reference's last call (past the references)")
    finally:
        stage.close()


def test_a_refused_repository_runs_dense_and_says_why(demo, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "index.json").write_text("{not json")
    with LocalPipeline(_spec(demo, "refused", repository=str(tmp_path / "repo"))) as pipeline:
        frame = demo["episode"].frames[0]
        res = pipeline.call(frame.images, np.asarray(frame.state), demo["episode"].task)
        assert not res.used_reference and pipeline.cache is None    # refused at start: no cache stage at all
        assert np.isfinite(res.chunk).all()


def test_cache_manager_dying_mid_episode_turns_calls_dense(demo):
    episode = demo["episode"]
    with ProcessPipeline(_spec(demo, "kill")) as pipeline:
        frame = episode.frames[0]
        assert pipeline.call(frame.images, np.asarray(frame.state), episode.task).used_reference
        pipeline.processes["cache"].kill()
        pipeline.processes["cache"].join(10)
        for frame in episode.frames[1:]:
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
            choice = pipeline.last_choice   # None (no answer) or the reason the vision stage did not ask
            assert not res.used_reference and np.isfinite(res.chunk).all()
            assert choice is None or (not choice.found and "cache manager not running" in choice.reason)


def test_cli_run_writes_json(demo, tmp_path, capsys):
    import yaml

    root = Path(__file__).resolve().parents[2]
    profile = yaml.safe_load((root / "config" / "sim.yaml").read_text())
    profile["engine"]["checkpoint"] = demo["checkpoint"]
    profile["engine"]["preset"] = "pi05-tiny"   # the demo checkpoint's architecture
    profile["cache"] = {"enabled": True, "repository": str(demo["repo"]), "reference_timeout_s": 60.0}
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile))
    bag = list_episode_bags(demo["held_out"])[0]
    rc = cli_main(["run", str(bag), "--profile", str(tmp_path / "profile.yaml"), "--processes", "1",
                   "--out", str(tmp_path / "run.json")])
    assert rc == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["calls"] == len(demo["episode"].frames) and report["cached_calls"] >= 1
    assert report["per_call"][0]["reference"] and np.isfinite(np.asarray(report["per_call"][0]["actions"])).all()
    rc = cli_main(["run", str(tmp_path / "missing"), "--profile", str(tmp_path / "profile.yaml")])
    assert rc == 2 and "no episode bag" in capsys.readouterr().err
