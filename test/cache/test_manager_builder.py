"""build-cache and the cache manager end to end, on bags the test writes (tiny preset)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from vla_runtime.cache.builder import BuildConfig, admit_episode, build_repository, model_summary
from vla_runtime.cache.manager import CacheManager, ManagerConfig, model_images_to_stored, stored_images_to_model
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.cli import main
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.io.bags import list_episode_bags, read_episode
from vla_runtime.sim.scenes import SceneConfig, make_episode
from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

CAMS = ("top", "wrist")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("demo")
    info = make_demo(root, DemoSpec(preset="pi05-tiny", episodes=4, held_out=1, steps_per_episode=45), log=lambda m: None)
    info["root"] = root
    return info


@pytest.fixture(scope="module")
def policy(demo) -> Pi05Policy:
    return Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))


@pytest.fixture(scope="module")
def repo(demo, policy, tmp_path_factory) -> ReferenceRepository:
    out = tmp_path_factory.mktemp("repo") / "repo"
    bags = list_episode_bags(demo["references"])
    summary = build_repository(policy, policy.checkpoint_hash, bags, out, demo_topics(CAMS), call_period=0.5,
                               cfg=BuildConfig(rho_n=0.5), profile_held_out=1, log=lambda m: None)
    assert summary.episodes == 3 and summary.calls > 0
    assert [(p["rho_p"], p["rho_n"]) for p in summary.profile] == [(0.2, 0.25), (0.4, 0.5), (0.6, 0.75), (1.0, 1.0)]
    full = summary.profile[-1]
    assert full["hits"] > 0 and full["mean_deviation"] < 1e-4   # rho = 1 reproduces dense
    assert summary.rho_n == 0.5                                  # not adopted without adopt_profiled
    return ReferenceRepository.open(out, expect_checkpoint_hash=policy.checkpoint_hash,
                                    expect_model=model_summary(policy.engine.cfg))


def test_build_cache_round_trip(repo, demo, policy):
    eps = repo.episodes()
    assert len(eps) == 3 and repo.tasks() == [demo["task"]]
    bag = list_episode_bags(demo["references"])[0]
    episode = read_episode(bag, demo_topics(CAMS), call_period=0.5)
    stored = repo.load_episode(eps[0].episode_id)
    assert stored.num_calls == len(episode.frames)
    call = stored.call(2)
    inputs = policy.prepare(Observation(episode.frames[2].images, episode.frames[2].state, episode.task))
    # compact images are the model's input to within uint8 quantisation
    assert (stored_images_to_model(call.images) - inputs.images[0]).abs().max() <= 1 / 127.5 + 1e-6
    assert torch.equal(model_images_to_stored(inputs.images[0]), call.images)
    cfg = policy.engine.cfg
    assert tuple(call.masks.shape) == (2, cfg.expert.depth, cfg.expert.mlp_dim // 2)
    torch.testing.assert_close(call.state_history[-1], torch.as_tensor(episode.frames[2].state))
    torch.testing.assert_close(call.state_history[0], torch.as_tensor(episode.frames[0].state))  # padded with the first
    assert repo.meta.checkpoint_hash == policy.checkpoint_hash


def test_manager_serves_cached_calls_on_a_held_out_episode(repo, demo, policy):
    manager = CacheManager(policy.engine.model, repo, ManagerConfig())
    report = manager.start_episode(demo["task"])
    assert report.added == len(manager.entries) > 0
    engine = CachedEngine(policy.engine.model, CacheConfig(rho_p=0.4, rho_n=repo.meta.rho_n))
    episode = read_episode(list_episode_bags(demo["held_out"])[0], demo_topics(CAMS), call_period=0.5)
    hits = 0
    for frame in episode.frames:
        inputs = policy.prepare(Observation(frame.images, frame.state, episode.task))
        manager.observe_state(torch.as_tensor(frame.state))
        noise = policy.engine.make_noise(1, torch.Generator().manual_seed(0))
        out = engine.infer(inputs, noise=noise, select=manager.select)
        dense = policy.engine.infer(inputs, noise=noise)
        assert torch.isfinite(out.actions).all()
        if out.reference is not None:
            hits += 1
            assert out.reference.key == manager.last_match.key
            assert float((out.actions - dense.actions).norm() / dense.actions.norm()) < 0.1
        prep = manager.prepare(time_available_s=10.0)
        assert len(manager.entries) <= manager.cfg.window.capacity + len(repo.episodes())
        assert prep.added <= prep.budget
    assert hits >= len(episode.frames) - 1
    mem = manager.memory_report()
    assert mem["bytes_per_prepared_entry"] > 0 and mem["working_set_bytes"] == sum(e.nbytes() for e in manager.entries.values())


def test_unfamiliar_scene_falls_back_to_dense(repo, demo, policy):
    manager = CacheManager(policy.engine.model, repo)
    manager.start_episode(demo["task"])
    other = make_episode(SceneConfig(image_size=policy.engine.cfg.vision.image_size, cameras=CAMS,
                                     task="push the green ball onto the plate", steps_per_episode=30, seed=9), 1)
    frame = other.frames[5]
    g = torch.Generator().manual_seed(0)
    noise_img = {c: (torch.rand(*frame.images[c].shape, generator=g) * 255).to(torch.uint8).numpy() for c in CAMS}
    inputs = policy.prepare(Observation(noise_img, frame.state, demo["task"]))
    manager.observe_state(torch.as_tensor(frame.state))
    engine = CachedEngine(policy.engine.model, CacheConfig(rho_n=repo.meta.rho_n))
    noise = policy.engine.make_noise(1, g)
    out = engine.infer(inputs, noise=noise, select=manager.select)
    assert out.reference is None and manager.retriever.fallback
    assert "fallback" in manager.retriever.reason
    assert torch.equal(out.actions, policy.engine.infer(inputs, noise=noise).actions)
    # dense for the rest of the episode, even for a familiar view
    assert manager.select(out.retrieval_features) is None
    assert manager.prepare().added == 0


def test_unknown_task_runs_dense(repo, policy):
    manager = CacheManager(policy.engine.model, repo)
    assert manager.start_episode("fold the towel").added == 0
    manager.observe_state(torch.zeros(7))
    assert manager.select(torch.zeros(repo.call_layout["retrieval"])) is None


def test_damaged_or_mismatched_repository_runs_dense(repo, policy, tmp_path, caplog):
    model = policy.engine.model
    with caplog.at_level(logging.WARNING):
        assert CacheManager.open(model, repo.root, "sha256:" + "0" * 64) is None
    assert "running dense" in caplog.text and "checkpoint" in caplog.text
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(repo.root, broken)
    f = next((broken / "episodes").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    assert CacheManager.open(model, broken, policy.checkpoint_hash) is None
    assert CacheManager.open(model, repo.root, policy.checkpoint_hash) is not None


def test_online_admission_is_bounded(repo, demo, policy, tmp_path):
    import shutil
    root = tmp_path / "repo"
    shutil.copytree(repo.root, root)
    r = ReferenceRepository.open(root, expect_checkpoint_hash=policy.checkpoint_hash)
    bag = list_episode_bags(demo["held_out"])[0]
    evicted = admit_episode(policy, r, bag, demo_topics(CAMS), 0.5, max_episodes_per_task=3, log=lambda m: None)
    assert len(evicted) == 1 and len(r.episodes()) == 3
    assert any(e.admitted_online for e in r.episodes())


def test_cli_build_cache_and_cache_bench(demo, tmp_path, capsys):
    cams = [f"--camera={c}={t}" for c, t in demo["topics"]["cameras"].items()]
    out = tmp_path / "repo"
    assert main(["build-cache", "--checkpoint", demo["checkpoint"], "--bags", demo["references"], "--out", str(out),
                 *cams]) == 0
    capsys.readouterr()
    assert main(["bench", "--cache", str(out), "--checkpoint", demo["checkpoint"], "--bags", demo["held_out"],
                 *cams, "--out", str(tmp_path / "b.json")]) == 0
    r = json.loads((tmp_path / "b.json").read_text())
    held_out = [read_episode(b, demo_topics(CAMS), call_period=r["spec"]["call_period"])
                for b in list_episode_bags(demo["held_out"])]
    assert r["calls"] == sum(len(e.frames) for e in held_out)                    # one call per frame
    assert 0 < r["cached_calls"] and r["cached_calls"] + sum(r["dense_reasons"].values()) == r["calls"]
    assert set(r["speedup"]) == {"vision", "prefill", "denoise", "total"}
    dev = r["deviation"]
    assert 0 < dev["mean_relative_l2"] <= dev["worst_relative_l2"] < float("inf")   # cached calls differ from dense
    assert r["memory"]["bytes_per_stored_call"] == ReferenceRepository.open(out).nbytes_per_call()["total"]
    # an existing repository is never overwritten
    assert main(["build-cache", "--checkpoint", demo["checkpoint"], "--bags", demo["references"], "--out", str(out),
                 *cams]) == 2


def test_the_retriever_knows_which_entries_are_last_calls(repo, demo, policy):
    """The past-the-references rule counts matches to last calls: the manager tells the retriever
    each reference episode's length at every episode start."""
    manager = CacheManager(policy.engine.model, repo)
    manager.start_episode(demo["task"])
    assert manager.retriever.last_index == {e.episode_id: e.num_calls - 1 for e in repo.episodes(demo["task"])}
    assert len(manager.retriever.last_index) == 3


def test_stall_is_reported_and_resets_the_episode(repo, demo, policy, caplog):
    manager = CacheManager(policy.engine.model, repo)
    manager.start_episode(demo["task"])
    episode = read_episode(list_episode_bags(demo["held_out"])[0], demo_topics(CAMS), call_period=0.5)
    frame = episode.frames[0]
    inputs = policy.prepare(Observation(frame.images, frame.state, episode.task))
    feats = policy.engine.model.embed_images(inputs.images, policy.engine.cfg.retrieval_layer)[1]
    max_calls = manager.retriever.max_calls
    with caplog.at_level(logging.WARNING):
        results = []
        for _ in range(max_calls + 1):   # the robot stands still: the same observation every call
            manager.observe_state(torch.as_tensor(frame.state))
            results.append(manager.select(feats))
    assert all(r is not None for r in results[:max_calls]) and results[-1] is None
    assert manager.stalls == 1 and "stall" in caplog.text
    assert manager.retriever.reason.startswith("stall: reference")   # the dense call says why
    assert not manager.retriever.stalled and len(manager.entries) > 0   # reset: ready to serve again
    manager.observe_state(torch.as_tensor(frame.state))
    assert manager.select(feats) is not None
