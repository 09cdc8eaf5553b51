"""Training tool end to end on a trivial dataset: the loss falls, the checkpoint loads, and the
deployed inference path (``Pi05Policy.predict``) reproduces the action chunk it was trained on.

That last check is what proves the training forward, the flow-matching convention, the
normalisation and the prompt construction all agree with inference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.io.bags import BagTopics, Episode, EpisodeFrame, JointSeries, write_episode_bag
from vla_runtime.models.checkpoint import load_checkpoint
from vla_runtime.training.train import BatchSampler, TrainConfig, action_chunks, load_demos, train

CAMS = ("corner", "topview")
DT = 0.0125
CALL_EVERY = 5          # pi05-tiny's chunk is 10: two periods of the action pattern
SIZE = 56               # pi05-tiny's image size
TASK = "press the button"
PATTERN = np.array([[0.5, -0.3, 0.2, -1.0], [0.1, 0.4, -0.6, 1.0], [-0.5, 0.0, 0.3, 0.5],
                    [0.7, -0.7, 0.0, -0.5], [-0.2, 0.6, -0.4, 0.0]])


def _scene() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {c: rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for c in CAMS}


def _write_bags(root: Path, episodes: int = 2, calls: int = 6) -> None:
    """Episodes where every call sees the same scene and state, and the commanded actions
    repeat with the call period, so every frame's target chunk is the same."""
    topics = BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in CAMS})
    images = _scene()
    state = np.array([0.1, 0.6, 0.2, 1.0], np.float32)
    for e in range(episodes):
        frames = [EpisodeFrame(t=i * CALL_EVERY * DT, images=images, state=state + 0.001 * e) for i in range(calls)]
        ticks = calls * CALL_EVERY + 10
        series = JointSeries(np.arange(ticks) * DT, PATTERN[np.arange(ticks) % CALL_EVERY], ("a0", "a1", "a2", "a3"))
        write_episode_bag(root / f"ep{e}", Episode(f"ep{e}", TASK, True, frames), topics,
                          series={"/action_command": series})


def test_action_chunks_follow_the_tick_of_each_frame():
    t = np.arange(6) * DT
    acts = np.arange(6, dtype=np.float64)[:, None]
    got = action_chunks(np.array([0.0, 2 * DT, 4 * DT]), t, acts, chunk=3, dt=DT)
    assert got[:, :, 0].tolist() == [[0, 1, 2], [2, 3, 4], [4, 5, 5]]  # padded with the last action


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("train")
    _write_bags(root / "demos")
    cfg = TrainConfig(demos=str(root / "demos"), out=str(root / "run"), export=str(root / "checkpoint"),
                      preset="pi05-tiny", cameras=CAMS, call_period=CALL_EVERY * DT, control_dt=DT, batch=8,
                      draws=2, lr=2e-3, warmup=20, max_steps=350, minutes=10.0, threads=1, shift=0, log_every=1000,
                      val_fraction=0.0, export_dtype="float32", seed=0)
    info = train(cfg, log=lambda s: None)
    return root, info


def test_loss_falls_and_checkpoint_loads(trained):
    root, info = trained
    assert info["steps"] == 350
    assert info["final_train_loss_ema"] < 0.3 * info["first_train_loss"]
    ck = load_checkpoint(root / "checkpoint")
    assert ck.config.chunk_size == 10 and ck.config.num_cameras == 2
    assert (root / "checkpoint" / "tokenizer.model").is_file()


def test_inference_path_reproduces_the_trained_chunk(trained):
    root, _ = trained
    policy = Pi05Policy.from_checkpoint(root / "checkpoint", list(CAMS))
    obs = Observation(images=_scene(), state=np.array([0.1, 0.6, 0.2, 1.0], np.float32), task=TASK)
    want = np.concatenate([PATTERN, PATTERN])
    for seed in range(3):  # different noise: the flow must carry every draw to the same chunk
        out = policy.predict(obs, generator=torch.Generator().manual_seed(seed))
        assert out.actions.shape == (10, 4)
        np.testing.assert_allclose(out.actions, want, atol=0.1)


def test_resume_continues_from_the_saved_step(tmp_path):
    _write_bags(tmp_path / "demos", episodes=1, calls=3)
    base = dict(demos=str(tmp_path / "demos"), out=str(tmp_path / "run"), preset="pi05-tiny", cameras=CAMS,
                call_period=CALL_EVERY * DT, control_dt=DT, batch=2, draws=1, warmup=2, shift=1,
                val_fraction=0.0, log_every=1000, threads=1)
    first = train(TrainConfig(**base, max_steps=3), log=lambda s: None)
    assert first["steps"] == 3
    lines: list[str] = []
    second = train(TrainConfig(**base, max_steps=5), resume=True, log=lines.append)
    assert second["steps"] == 5
    assert any("resumed at step 3" in line for line in lines)


def _write_failed_episode(root: Path, manifest_labels: str | None) -> None:
    """One unsuccessful episode (other actions), optionally under a ``demos.json``."""
    topics = BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in CAMS})
    frames = [EpisodeFrame(t=i * CALL_EVERY * DT, images=_scene(), state=np.full(4, 0.3, np.float32))
              for i in range(3)]
    series = JointSeries(np.arange(25) * DT, np.full((25, 4), -0.25), ("a0", "a1", "a2", "a3"))
    write_episode_bag(root / "failed", Episode("failed", TASK, False, frames), topics,
                      series={"/action_command": series})
    if manifest_labels is not None:
        (root / "demos.json").write_text(json.dumps({"labels": manifest_labels}))


def test_failed_episodes_are_kept_only_with_dagger_labels(tmp_path):
    base = dict(out=str(tmp_path / "run"), preset="pi05-tiny", cameras=CAMS, call_period=CALL_EVERY * DT,
                control_dt=DT)
    _write_bags(tmp_path / "a" / "expert", episodes=1, calls=3)
    _write_failed_episode(tmp_path / "a" / "expert_failures", manifest_labels="expert")
    lines: list[str] = []
    data = load_demos(TrainConfig(demos=str(tmp_path / "a"), **base), log=lines.append)
    assert len(data.states) == 3 and "1 unsuccessful skipped" in lines[-1]
    _write_bags(tmp_path / "b" / "expert", episodes=1, calls=3)
    _write_failed_episode(tmp_path / "b" / "dagger", manifest_labels="dagger")
    data = load_demos(TrainConfig(demos=str(tmp_path / "b"), **base), log=lambda s: None)
    assert len(data.states) == 6 and np.isclose(data.chunks, -0.25).all(axis=(1, 2)).sum() == 3


def test_init_from_starts_from_the_earlier_weights_statistics_and_tokenizer(trained, tmp_path):
    root, _ = trained
    _write_bags(tmp_path / "demos", episodes=1, calls=3)
    _write_failed_episode(tmp_path / "demos" / "dagger", manifest_labels="dagger")
    lines: list[str] = []
    cfg = TrainConfig(demos=str(tmp_path / "demos"), out=str(tmp_path / "run"), export=str(tmp_path / "ck"),
                      preset="pi05-tiny", cameras=CAMS, call_period=CALL_EVERY * DT, control_dt=DT, batch=8, draws=2,
                      lr=0.0, warmup=1, max_steps=2, threads=1, shift=0, log_every=1000, val_fraction=0.0,
                      export_dtype="float32", init_from=str(root / "run"), sampling="tasks")
    second = train(cfg, log=lines.append)
    assert any("initialised from" in line for line in lines) and second["steps"] == 2
    assert any(line.startswith("sampling tasks equally") for line in lines)
    # At learning rate 0 the exported (averaged) weights are exactly the earlier run's.
    old, new = load_file(root / "checkpoint" / "model.safetensors"), load_file(tmp_path / "ck" / "model.safetensors")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == (root / "run" / "tokenizer.model").read_bytes()
    # The old run's statistics, not the new data's (which hold the failed episode's -0.25 actions).
    for f in (root / "checkpoint").glob("*normalizer_processor.safetensors"):
        old, new = load_file(f), load_file(tmp_path / "ck" / f.name)
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old), f.name
    with pytest.raises(FileNotFoundError, match="not a training run directory"):
        TrainConfig(demos="x", out="y", init_from=str(tmp_path)).validate()


def test_task_sampling_draws_every_task_equally_whatever_its_frame_count():
    task_of_frame = np.array([0] * 90 + [1] * 9 + [2] * 1)   # one task with 90x the frames of another
    frames = torch.arange(100)
    gen = torch.Generator().manual_seed(0)
    drawn = BatchSampler(frames, task_of_frame, "tasks")(30_000, gen)
    share = np.bincount(task_of_frame[drawn.numpy()], minlength=3) / len(drawn)
    assert np.allclose(share, 1 / 3, atol=0.02)
    assert set(drawn[task_of_frame[drawn.numpy()] == 1].tolist()) == set(range(90, 99))  # every frame of a task reachable
    by_frame = BatchSampler(frames, task_of_frame, "frames")(30_000, gen)
    assert np.bincount(task_of_frame[by_frame.numpy()], minlength=3)[0] / len(by_frame) > 0.85
    only_train = BatchSampler(torch.arange(10, 100), task_of_frame, "tasks")(5_000, gen)
    assert only_train.min() >= 10                               # validation frames never drawn
    with pytest.raises(ValueError, match="sampling"):
        BatchSampler(frames, task_of_frame, "episodes")


def test_bags_in_a_robot_profiles_layout_are_read_through_its_topics(tmp_path):
    """ALOHA demonstrations (the profile's camera topics, joints by name over two arms' topics)
    become frames with the profile's cameras in its order and 14-dim states and action chunks."""
    from vla_runtime.training.aloha_demos import AlohaDemoConfig, record_aloha_demos

    profile = str(Path(__file__).resolve().parents[2] / "config" / "aloha.yaml")
    record_aloha_demos(AlohaDemoConfig(episodes=1, profile=profile, image_size=64), tmp_path / "demos",
                       log=lambda m: None)
    cfg = TrainConfig(demos=str(tmp_path / "demos"), out=str(tmp_path / "run"), preset="pi05-aloha",
                      cameras=("cam_high", "cam_left_wrist", "cam_right_wrist"), robot_profile=profile,
                      call_period=0.2, control_dt=0.02).validate()
    data = load_demos(cfg, log=lambda m: None)
    assert data.images.shape[1:] == (3, 64, 64, 3) and data.states.shape[1] == 14
    assert data.chunks.shape[1:] == (20, 14) and np.isfinite(data.chunks).all()
    with pytest.raises(ValueError, match="not the profile's"):
        TrainConfig(demos="x", out="y", preset="pi05-aloha", robot_profile=profile,
                    cameras=("cam_left_wrist", "cam_high", "cam_right_wrist")).validate()
