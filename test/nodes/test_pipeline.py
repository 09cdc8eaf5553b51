"""The three stages without ROS: in one process and in three, with the muscle-memory cache.

The chunks equal an independent in-process computation (cached engine + cache manager on one
model), the three-process pipeline equals the one-process one, and a cache that is refused or
dies mid-run turns calls dense instead of stopping them."""

from __future__ import annotations

import json
import os
import signal
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
from vla_runtime.models.parts import ALL_PARTS, ROLE_PARTS, weight_bytes
from vla_runtime.nodes.pipeline import LocalPipeline, PipelineSpec, ProcessPipeline
from vla_runtime.nodes.profile import CacheSpec
from vla_runtime.nodes.stages import CacheStage, RingNames, episode_noise_key, manager_config
from vla_runtime.nodes.working_set import pin_entry

CAMS = ("top", "wrist")


def _rings(tag: str) -> RingNames:
    return RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_w")


def _spec(demo: dict, tag: str, repository: str | None = None, enabled: bool = True, **halves: bool) -> PipelineSpec:
    cache = CacheSpec(enabled=enabled, repository=repository or str(demo["repo"]), **halves)
    return PipelineSpec(Path(demo["checkpoint"]), CAMS, cache, rings=_rings(tag), seed=3, time_available_s=10.0)


def _run(pipeline, episode, announce: bool = True) -> list[tuple[np.ndarray, bool, object]]:
    """The episode's calls; ``announce``: the episode is started ahead (its window prepared), as
    a robot's reset does and as the in-process expectation's manager does."""
    if announce:
        pipeline.start_episode(episode.task)
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
        pipeline.start_episode(demo["episode"].task)
        results = [pipeline.call(f.images, np.asarray(f.state), demo["episode"].task) for f in demo["episode"].frames]
    expected = _expected(demo, seed=3, **{half: False})
    for res, (want, _) in zip(results, expected):
        np.testing.assert_allclose(res.chunk, want, rtol=0, atol=1e-6)
    assert any(r.cached for r in results)
    assert all(r.used_reference == (half == "context_cache") for r in results if r.cached)
    assert all(bool(r.meta.context_cache) == (half == "action_cache") for r in results if r.cached)


def test_three_processes_compute_what_their_reference_says_and_serve_from_the_window(demo, oracle):
    """Three processes: the vision process selects from the window the cache manager publishes,
    which slides asynchronously, so the reference of a call may differ from the one-process
    run's; what each call computes from its reference may not (the oracle rebuilds the reported
    entry itself). The selection's cost on the critical path is its own phase. Each stage process
    holds only its role's model parts (``engine.weights_per_role``); the oracle's full model says
    what it must compute. The policy process gathers each call's reference weights ahead of the
    call, when the vision process names the reference before its prefill."""
    episode = demo["episode"]
    with ProcessPipeline(_spec(demo, "three")) as pipeline:
        held = pipeline.weights
        assert {name: set(w.parts) for name, w in held.items()} == \
            {role: {p.value for p in parts} for role, parts in ROLE_PARTS.items()}
        full = weight_bytes(Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS)).engine.model)
        assert held["policy"].nbytes < held["vision"].nbytes < full
        pipeline.start_episode(episode.task)
        assert pipeline.last_episode_start_s > 0          # it waited for the initial window
        cached = 0
        for frame in episode.frames:
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
            oracle.check(res, pipeline.last_choice, frame, episode.task)
            cached += res.cached
            assert res.gathers == 0   # the reference's weights were gathered ahead, while the prefill ran
            assert set(pipeline.last_times) >= {"vision", "select", "prefill", "denoise"}
            assert "retrieve" not in pipeline.last_times   # no round trip to the cache manager any more
    assert cached >= len(episode.frames) - 1


def test_episode_not_announced_runs_its_first_call_dense_never_waiting(demo):
    """Without ``start_episode(task)`` the first call finds no window of its task: it runs dense at
    once (the reason says so) and its selection note starts the episode in the cache manager, so
    the following calls are served."""
    episode = demo["episode"]
    with LocalPipeline(_spec(demo, "lazy")) as pipeline:
        assert pipeline.vision.worker.engine.model.parts == ALL_PARTS   # one process runs every stage
        lazy = _run(pipeline, episode, announce=False)
        assert pipeline.cache.worker.episodes_started == 1
    with LocalPipeline(_spec(demo, "lazy2")) as pipeline:
        frame = episode.frames[0]
        pipeline.call(frame.images, np.asarray(frame.state), episode.task)
        assert pipeline.last_choice.reason.startswith("initial window still being prepared")
    assert not lazy[0][1]
    assert sum(used for _, used, _ in lazy[1:]) >= len(lazy) - 2


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
    # one process against three: the same noise, but another torch thread count and other buffer
    # addresses may reorder float32 reductions (a 1-ulp difference was seen on a CI machine), so
    # the bound of ``ReferenceOracle.check``; another seed moves the chunk by far more than that
    for a, b, w in zip(first, later, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        np.testing.assert_allclose(a, w, rtol=0, atol=1e-5)
    assert np.abs(first[0] - other[0]).max() > 1e-2          # another seed, other noise
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


def test_cache_manager_dying_mid_episode_never_holds_up_a_call(demo, oracle):
    """SIGKILL of the cache manager: its last window stays readable (nobody can rewrite a dead
    writer's slots), so calls go on selecting from it; each chunk is exactly what its reported
    reference (or dense) gives, and no call waits."""
    episode = demo["episode"]
    with ProcessPipeline(_spec(demo, "kill")) as pipeline:
        pipeline.start_episode(episode.task)
        frame = episode.frames[0]
        assert pipeline.call(frame.images, np.asarray(frame.state), episode.task).used_reference
        pipeline.processes["cache"].kill()
        pipeline.processes["cache"].join(10)
        for frame in episode.frames[1:]:
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=60.0)
            oracle.check(res, pipeline.last_choice, frame, episode.task)


def test_cli_run_writes_json(demo, tmp_path, capsys):
    import yaml

    root = Path(__file__).resolve().parents[2]
    profile = yaml.safe_load((root / "config" / "sim.yaml").read_text())
    profile["engine"]["checkpoint"] = demo["checkpoint"]
    profile["engine"]["preset"] = "pi05-tiny"   # the demo checkpoint's architecture
    profile["cache"] = {"enabled": True, "repository": str(demo["repo"])}
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


def test_a_cached_call_is_served_while_the_cache_manager_is_stopped(demo, oracle):
    """SIGSTOP of the cache manager for whole calls (a loaded machine, a debugger): the vision
    process selects from the published window without it, so calls are still served from the
    cache, at once, and exactly."""
    episode = demo["episode"]
    with ProcessPipeline(_spec(demo, "stop")) as pipeline:
        pipeline.start_episode(episode.task)
        pid = pipeline.processes["cache"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            served = []
            for frame in episode.frames[:3]:
                res = pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=60.0)
                oracle.check(res, pipeline.last_choice, frame, episode.task)
                served.append(res.cached)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(served)


def test_two_cameras_on_a_three_camera_model_through_build_cache_selection_and_prefill(tmp_path, monkeypatch,
                                                                                       oracle_for):
    """A robot with fewer cameras than the model's image slots: the repository records the two
    cameras, the working set holds entries of two of three slots, selection compares two-camera
    features and the Context Cache serves the two-camera prefix (the query path used to fail
    with 'size of tensor a (3) must match the size of tensor b (2)')."""
    import dataclasses

    import vla_runtime.commands.demo as demo_mod
    from vla_runtime.cache.builder import BuildConfig, build_repository
    from vla_runtime.io.bags import read_episode
    from vla_runtime.models.config import preset
    from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

    three = dataclasses.replace(preset("pi05-tiny"), num_cameras=3)
    monkeypatch.setattr(demo_mod, "preset", lambda name: three)
    info = make_demo(tmp_path, DemoSpec(preset="pi05-tiny", episodes=3, held_out=1, steps_per_episode=20),
                     log=lambda m: None)
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMS))
    assert policy.engine.cfg.num_cameras == 3
    build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), tmp_path / "repo",
                     demo_topics(CAMS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    assert ReferenceRepository.open(tmp_path / "repo").call_layout["image_mask"] == [2]
    episode = read_episode(list_episode_bags(info["held_out"])[0], demo_topics(CAMS), call_period=0.5)
    local = {**info, "repo": tmp_path / "repo", "episode": episode}
    check = oracle_for(local, 3)
    with LocalPipeline(_spec(local, "cams3")) as pipeline:
        pipeline.start_episode(episode.task)
        results = []
        for frame in episode.frames:
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
            check.check(res, pipeline.last_choice, frame, episode.task)
            results.append(res)
    assert sum(bool(r.meta.context_cache) and r.used_reference for r in results) >= len(results) - 1
    assert all(r.meta.cameras == 2 for r in results)


def test_a_reference_rewritten_during_the_prefill_is_not_used(demo, oracle, monkeypatch):
    """The chosen entry is read in place; if the cache manager rewrites its slot while the prefill
    reads it (the pin turns invalid), that prefill is void and the call is run again dense."""
    from types import SimpleNamespace

    from vla_runtime.nodes import selection

    episode = demo["episode"]
    real = selection.WindowSelector.choose

    def torn(self, *a, **kw):
        choice = real(self, *a, **kw)
        if choice.pin is not None:   # what a pin reports once its slot was written after it was taken
            choice.pin = SimpleNamespace(valid=lambda: False)
        return choice

    with LocalPipeline(_spec(demo, "torn")) as pipeline:
        pipeline.start_episode(episode.task)
        monkeypatch.setattr(selection.WindowSelector, "choose", torn)
        frame = episode.frames[0]
        res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
        assert not res.cached and pipeline.vision.selector.torn == 1
        assert pipeline.last_choice.reason == "reference rewritten during the prefill"
        oracle.check(res, pipeline.last_choice, frame, episode.task)       # exactly the dense chunk


def test_a_reference_dropped_before_the_policy_denoises_still_serves_the_action_cache(demo, oracle, monkeypatch):
    """The vision process runs calls ahead of the policy, so the cache manager may slide a call's
    reference out of the window before the policy denoises that call: the masks travel in the
    call's prefix slot, and the call still denoises with them (it used to run its denoising dense,
    0.3 ms of action error away from what it reported)."""
    from vla_runtime.nodes.stages import VisionStage

    episode = demo["episode"]
    real = VisionStage.encode

    def then_dropped(self, req, images):
        note = real(self, req, images)
        choice = self.last_choice
        if choice is not None and choice.found:   # the entry leaves the window, its slot is cleared
            manager = pipeline.cache.worker.manager
            key = (choice.episode, choice.index)
            del manager.entries[key]
            assert pin_entry(self.selector.ring, choice.slot, choice.seq) is None
        return note

    with LocalPipeline(_spec(demo, "dropped")) as pipeline:
        pipeline.start_episode(episode.task)
        monkeypatch.setattr(VisionStage, "encode", then_dropped)
        frame = episode.frames[0]
        res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
        assert res.cached and res.used_reference and res.meta.context_cache
        oracle.check(res, pipeline.last_choice, frame, episode.task)
