"""build-cache from a LeRobot v3.0 dataset written by the test: the same repository as from bags,
episode selection, profiling, online admission, and the CLI's refusals."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from vla_runtime.cache.builder import BuildConfig, build_repository_from
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.cli import main
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.dataset_features import checkpoint_features
from vla_runtime.io.episode_sources import dataset_refs
from vla_runtime.io.lerobot_dataset import LeRobotDatasetReader
from vla_runtime.testing.lerobot_data import CAMERAS, TASKS, synthetic_episodes, write_test_checkpoint, write_test_dataset

CALLS_PER_EPISODE = 4   # 20 frames at 10 fps span 1.9 s: calls at 0, 0.5, 1.0 and 1.5 s


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsbuild")
    eps = synthetic_episodes()
    return {"episodes": eps, "checkpoint": str(write_test_checkpoint(root / "ckpt", eps)),
            "dataset": str(write_test_dataset(root / "ds", episodes=eps))}


def test_build_cache_cli(files, tmp_path, capsys):
    out, written = tmp_path / "repo", tmp_path / "build.json"
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--out", str(out),
                 "--episodes", "0-2", "--call-period", "0.5", "--summary", str(written)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(written.read_text())
    assert summary["episodes"] == 3 and summary["calls"] == 3 * CALLS_PER_EPISODE and summary["skipped"] == []
    # progress on stderr (the recording bar's last state: 3 of 3 episodes), a short summary on stdout
    assert "recording references" in captured.err and "3/3" in captured.err
    assert f"repository {out}: 3 episode(s), {3 * CALLS_PER_EPISODE} calls" in captured.out
    assert str(written) in captured.out and "{" not in captured.out
    policy = Pi05Policy.from_checkpoint(files["checkpoint"], camera_names=list(CAMERAS[:2]))
    repo = ReferenceRepository.open(out, expect_checkpoint_hash=policy.checkpoint_hash)
    assert sorted(repo.tasks()) == sorted(TASKS)
    recs = {r.episode_id: r for r in repo.episodes()}
    assert sorted(recs) == ["episode_000000", "episode_000001", "episode_000002"]
    assert recs["episode_000001"].task == TASKS[1] and recs["episode_000001"].source.endswith("#episode=1")
    # the stored state of each call is the dataset's state at the frame the call saw (every 5th)
    stored = repo.load_episode("episode_000002")
    for i in range(CALLS_PER_EPISODE):
        np.testing.assert_array_equal(stored.call(i).state.numpy(), files["episodes"][2].state[5 * i].astype(np.float32))


def test_same_repository_as_the_api(files, tmp_path):
    """The CLI and build_repository_from over dataset_refs store the same calls (the dataset is
    just another EpisodeRef underneath the one builder)."""
    policy = Pi05Policy.from_checkpoint(files["checkpoint"], camera_names=list(CAMERAS[:2]))
    refs = dataset_refs(LeRobotDatasetReader(files["dataset"]), checkpoint_features(files["checkpoint"]), "1")
    build_repository_from(policy, policy.checkpoint_hash, refs, tmp_path / "a", 0.5, BuildConfig(), log=lambda m: None)
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "b"), "--episodes", "1"]) == 0
    a = ReferenceRepository.open(tmp_path / "a").load_episode("episode_000001")
    b = ReferenceRepository.open(tmp_path / "b").load_episode("episode_000001")
    for i in range(CALLS_PER_EPISODE):
        ca, cb = a.call(i), b.call(i)
        assert torch.equal(ca.images, cb.images) and torch.equal(ca.masks, cb.masks)
        assert torch.equal(ca.retrieval, cb.retrieval)


def test_mask_groups_set_the_action_caches_groups(files, tmp_path):
    """``--mask-groups 1``: one mask per layer shared by every denoising step, recorded in the
    repository, the same masks the API builds with that one group (the default two differ)."""
    policy = Pi05Policy.from_checkpoint(files["checkpoint"], camera_names=list(CAMERAS[:2]))
    steps = policy.engine.model.cfg.num_steps
    refs = dataset_refs(LeRobotDatasetReader(files["dataset"]), checkpoint_features(files["checkpoint"]), "1")
    build_repository_from(policy, policy.checkpoint_hash, refs, tmp_path / "api", 0.5,
                          BuildConfig(groups=((0, steps),)), log=lambda m: None)
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "one"), "--episodes", "1", "--mask-groups", "1"]) == 0
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "two"), "--episodes", "1"]) == 0
    one, api, two = (ReferenceRepository.open(tmp_path / n) for n in ("one", "api", "two"))
    assert one.meta.mask_groups == [[0, steps]] and two.meta.mask_groups == [[0, steps // 2], [steps // 2, steps]]
    for i in range(CALLS_PER_EPISODE):
        masks = one.load_call("episode_000001", i).masks
        assert masks.shape[0] == 1 and torch.equal(masks, api.load_call("episode_000001", i).masks)
        assert two.load_call("episode_000001", i).masks.shape[0] == 2


def test_profile_and_admit(files, tmp_path, capsys):
    out = tmp_path / "repo"
    # task 0 has episodes 0 and 2: one is held out to profile against the other
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--out", str(out),
                 "--episodes", "0,2", "--profile", "1", "--summary", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)    # --summary -: the JSON on stdout, for a pipe
    assert summary["episodes"] == 2 and len(summary["profile"]) == 4
    assert summary["profile"][-1]["hits"] > 0 and summary["profile"][-1]["mean_deviation"] < 1e-4  # rho 1 == dense
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--out", str(out),
                 "--episodes", "1", "--admit"]) == 0
    repo = ReferenceRepository.open(out)
    assert sorted(r.episode_id for r in repo.episodes()) == ["episode_000000", "episode_000001", "episode_000002"]
    assert repo.episodes(TASKS[1])[0].admitted_online


@pytest.mark.parametrize("extra, message", [
    (["--bags", "x"], "--dataset reads a LeRobot dataset: drop --bags"),
    (["--episodes", "5"], r"no episode\(s\) \[5\]"),
    (["--feature", "observation.images.cam1=observation.images.side"],
     r"camera 'observation.images.cam1': the dataset has no feature 'observation.images.side'"),
    (["--feature", "observation.state=action"], "one part only"),
    (["--mask-groups", "0"], "mask groups must be a whole number from 1 to the 10 denoising steps, got 0"),
    (["--mask-groups", "1", "--admit"], "--mask-groups sets a new repository's masks"),
])
def test_cli_refusals(files, tmp_path, capsys, extra, message):
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "r"), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


def test_cli_refuses_other_versions(files, tmp_path, capsys):
    ds = tmp_path / "old"
    shutil.copytree(files["dataset"], ds)
    info = json.loads((ds / "meta" / "info.json").read_text())
    (ds / "meta" / "info.json").write_text(json.dumps(info | {"codebase_version": "v2.1"}))
    assert main(["build-cache", "--dataset", str(ds), "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "r")]) == 2
    assert "codebase version 'v2.1' is not supported" in capsys.readouterr().err


def test_bench_cache_on_dataset_episodes(files, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["build-cache", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--out", str(repo),
                 "--episodes", "0,1"]) == 0
    out = tmp_path / "bench.json"
    assert main(["bench", "--cache", str(repo), "--checkpoint", files["checkpoint"], "--dataset", files["dataset"],
                 "--episodes", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["calls"] == CALLS_PER_EPISODE and r["spec"]["dataset"] == files["dataset"]
    assert r["cached_calls"] + sum(r["dense_reasons"].values()) == r["calls"]
    assert set(r["median_s"]["dense"]) >= {"vision", "prefill", "denoise", "total"}
    assert "[1/1] episode_000002" in capsys.readouterr().err
    assert main(["bench", "--cache", str(repo), "--checkpoint", files["checkpoint"], "--dataset", files["dataset"],
                 "--bags", "x"]) == 2
    assert "drop --bags and --camera" in capsys.readouterr().err
