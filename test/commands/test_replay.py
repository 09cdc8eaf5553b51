"""``vla-runtime replay``: recorded bag in, chunk/latency bag out, regression against a golden bag.

The committed input bag and golden live in ``test/data/replay`` (``make_golden.py`` there
regenerates them); the checkpoint is rebuilt from the demo recipe, which is deterministic.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from rosbags.rosbag2 import Reader

from vla_runtime.cli import main
from vla_runtime.commands.replay import (ACTION_CHUNK_TOPIC, ACTION_CHUNK_TYPE, DIAGNOSTICS_TOPIC, DIAGNOSTICS_TYPE,
                                      LATENCY_TOPIC, PHASE_LATENCY_TYPE, RAW_CHUNK_TOPIC,
                                      read_action_chunks, read_replay_provenance,
                                      runtime_typestore)

DATA = Path(__file__).resolve().parents[1] / "data" / "replay"
REPO = DATA.parents[2]
PROFILE = REPO / "config" / "sim.yaml"
EPISODE = DATA / "episode"
GOLDEN = DATA / "golden"


# What a mismatch can mean, for the failure messages: regenerating the golden accepts whatever the
# code computes now, so it is right only after the cause is known to be a deliberate change.
DIGEST_MISMATCH = (
    "Two causes give this: (a) a deliberate change of the recipe (make_demo, DemoSpec, init_random_, a "
    "preset, the files save_checkpoint writes), or (b) a bug in writing the checkpoint, e.g. the public <-> "
    "internal tensor mapping (models/checkpoint.py layout_groups: a swapped q/k/v changes the file, not "
    "save-then-load). Tell them apart first: test/models/test_checkpoint_layout.py checks the mapping "
    "against LeRobot's own listing independently of this golden and must pass; then load an old and a new "
    "checkpoint's model.safetensors (safetensors.torch.load_file) and compare them tensor by tensor: a "
    "deliberate change touches only what it meant to (config.json, or the tensors of the part it "
    f"changed). Only for (a) run {DATA / 'make_golden.py'}.")
GOLDEN_DRIFT = (
    "The chunks drifted from the golden while the checkpoint file is the same one, so the computation "
    "changed: (a) on purpose (new rounding, a preprocessing fix) or (b) a bug in the engine or the "
    "preprocessing. Tell them apart from the earliest stage on: test/models (preprocess, tokenizer, "
    "checkpoint layout) first, then the dense engine's own tests (test/engine/test_dense.py) and the "
    "LeRobot parity oracle (bench/lerobot_parity.py, in its own venv: vision tokens, then prefill K/V, "
    "then the denoised actions, in that order: the first intermediate that differs names the stage). A "
    "deliberate change "
    "moves the drift by about its own rounding (1e-7..1e-5 here); a bug usually by much more (the random "
    f"demo policy's actions move ~5e-5 between camera frames). Only for (a) run {DATA / 'make_golden.py'}.")


def _load_recipe():
    spec = importlib.util.spec_from_file_location("replay_make_golden", DATA / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _load_recipe()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, recipe) -> Path:
    ckpt = recipe.build_checkpoint(tmp_path_factory.mktemp("demo"))
    expected = json.loads((DATA / "golden.json").read_text())["checkpoint_digest"]
    got = recipe.checkpoint_digest(ckpt)
    assert got == expected, (f"the demo checkpoint recipe no longer builds the checkpoint the golden was made with "
                             f"({got} != {expected}). {DIGEST_MISMATCH}")
    return ckpt


def _replay(tmp_path: Path, *extra: str, out: Path | None = None, profile: Path = PROFILE) -> tuple[int, Path]:
    out = tmp_path / "out" if out is None else out
    rc = main(["replay", str(EPISODE), "--out", str(out), "--profile", str(profile), *extra])
    return rc, out


def test_checkpoint_recipe_is_deterministic(tmp_path: Path, recipe, checkpoint: Path):
    again = recipe.build_checkpoint(tmp_path)
    assert recipe.checkpoint_digest(again) == recipe.checkpoint_digest(checkpoint)


def test_replay_matches_the_committed_golden(tmp_path: Path, checkpoint: Path, capsys):
    # Tighter than the CLI's default: re-runs differ by ~1e-7 (thread count), while the random
    # demo policy's actions move by only ~5e-5 between two different camera frames.
    rc, _ = _replay(tmp_path, "--checkpoint", str(checkpoint), "--golden", str(GOLDEN), "--tolerance", "1e-5")
    captured = capsys.readouterr()
    assert rc == 0, f"{captured.err}\n{GOLDEN_DRIFT}"
    summary = json.loads(captured.out)
    assert summary["calls"] == 2 and summary["chunk_shape"] == [10, 7]
    assert summary["drift"] is False and summary["max_abs_diff"] <= 1e-5
    assert len(summary["per_call_max_abs_diff"]) == 2
    assert set(summary["latency_median_s"]) == {"vision", "prefill", "denoise", "total"}
    assert "call 1 (t=0.500s)" in captured.err and "ok" in captured.err


def test_output_bag_holds_one_chunk_latency_and_diagnostics_per_call(tmp_path: Path, checkpoint: Path, capsys):
    rc, out = _replay(tmp_path, "--checkpoint", str(checkpoint))
    assert rc == 0, capsys.readouterr().err
    store = runtime_typestore()
    with Reader(out) as reader:
        topics = {c.topic: (c.msgtype, c.msgcount) for c in reader.connections}
        assert topics == {ACTION_CHUNK_TOPIC: (ACTION_CHUNK_TYPE, 2), RAW_CHUNK_TOPIC: (ACTION_CHUNK_TYPE, 2),
                          LATENCY_TOPIC: (PHASE_LATENCY_TYPE, 2), DIAGNOSTICS_TOPIC: (DIAGNOSTICS_TYPE, 2)}
        msgs = [(c.topic, ns, store.deserialize_cdr(raw, c.msgtype)) for c, ns, raw in reader.messages()]
        start = reader.start_time
    chunks = [(ns, m) for topic, ns, m in msgs if topic == ACTION_CHUNK_TOPIC]
    lats = [(ns, m) for topic, ns, m in msgs if topic == LATENCY_TOPIC]
    diags = [m.status[0] for topic, _, m in msgs if topic == DIAGNOSTICS_TOPIC]
    for i, (status, (_, lat)) in enumerate(zip(diags, lats)):
        values = {kv.key: kv.value for kv in status.values}
        assert status.name == "vla_runtime: replay" and values["call_id"] == str(i) and values["chunk_finite"] == "True"
        assert float(values["denoise_s"]) == pytest.approx(lat.denoise, abs=1e-6)
    # Calls at 0 s and 0.5 s of bag time; log time == header stamp == the call's bag time.
    input_start = Reader(EPISODE)
    input_start.open()
    t0 = input_start.start_time
    input_start.close()
    assert [ns - t0 for ns, _ in chunks] == [0, 500_000_000] and start == t0
    for i, (ns, m) in enumerate(chunks):
        assert m.call_id == m.observation_seq == i
        assert m.header.stamp.sec * 10**9 + m.header.stamp.nanosec == ns
        assert (m.chunk_length, m.action_dim) == (10, 7) and len(m.actions) == 70
        assert list(m.joint_names)[-1] == "gripper" and m.control_period == pytest.approx(1 / 50)
        assert m.source == "dense" and np.all(np.isfinite(m.actions))
    for i, (ns, m) in enumerate(lats):
        assert m.call_id == i and m.mode == "dense" and ns == chunks[i][0]
        assert 0 < m.vision and 0 < m.prefill and 0 < m.denoise
        assert m.total >= m.vision + m.prefill + m.denoise
    assert read_replay_provenance(out)["seed"] == "0"
    # The reader used for goldens reads sqlite3 output like the committed mcap golden.
    assert [c.actions.shape for c in read_action_chunks(out)] == [(10, 7), (10, 7)]


def test_published_chunks_are_clamped_to_the_joint_limits_as_the_node_does_and_the_raw_ones_kept(
        tmp_path: Path, checkpoint: Path, capsys):
    """Limits narrowed around zero, so that the random demo policy's actions cross them: the
    chunk on /vla_runtime/action_chunk is the raw chunk clipped into the limits (the policy
    node's ``within_limits``), the raw one stays on /vla_runtime/action_chunk_raw, and the
    golden comparison reads the raw ones."""
    d = yaml.safe_load(PROFILE.read_text())
    n = len(d["joint_names"])
    d["joint_lower"], d["joint_upper"] = [-1e-3] * n, [1e-3] * n
    (tmp_path / "narrow.yaml").write_text(yaml.safe_dump(d))
    rc, out = _replay(tmp_path, "--checkpoint", str(checkpoint), profile=tmp_path / "narrow.yaml")
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    published, raw = read_action_chunks(out), read_action_chunks(out, raw=True)
    assert [c.call_id for c in published] == [c.call_id for c in raw] == [0, 1]
    for p, r in zip(published, raw):
        assert np.array_equal(p.actions, np.clip(r.actions, -1e-3, 1e-3))
        assert (np.abs(r.actions) > 1e-3).any()       # the limits did bite: the two differ
    # against its own output as the golden: the raw chunks are compared, so no drift
    rc, _ = _replay(tmp_path, "--checkpoint", str(checkpoint), "--golden", str(out), "--tolerance", "0",
                    out=tmp_path / "again", profile=tmp_path / "narrow.yaml")
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] == 0.0


def _perturbed(checkpoint: Path, dest: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest)
    weights = load_file(dest / "model.safetensors")
    # The action head: with random weights the actions barely depend on the prefix (a 1e-2 change
    # of a vision or VLM weight moves them by < 1e-5), so a change there would not show at 1e-4.
    weights["model.action_out_proj.bias"][0] += 1e-2
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("change", ["weight", "seed"])
def test_regression_mode_names_the_call_that_drifted(tmp_path: Path, checkpoint: Path, change: str, capsys):
    if change == "weight":
        extra = ["--checkpoint", str(_perturbed(checkpoint, tmp_path / "ckpt"))]
    else:
        extra = ["--checkpoint", str(checkpoint), "--seed", "1"]
    rc, out = _replay(tmp_path, *extra, "--golden", str(GOLDEN), "--tolerance", "1e-4")
    captured = capsys.readouterr()
    assert rc == 2
    assert "drifted from golden" in captured.err and "call 0 (t=0.000s) drifted: max |diff|" in captured.err
    hint = "made with checkpoint" if change == "weight" else "made with --seed 0, this run used 1"
    assert hint in captured.err
    summary = json.loads(captured.out)
    assert summary["drift"] is True and summary["max_abs_diff"] > 1e-4
    assert out.exists()   # the drifting output is kept for inspection


def test_refuses_an_existing_output_unless_overwrite(tmp_path: Path, checkpoint: Path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a bag")
    rc, _ = _replay(tmp_path, "--checkpoint", str(checkpoint), out=out)
    assert rc == 2 and "exists already; pass --overwrite" in capsys.readouterr().err
    rc, _ = _replay(tmp_path, "--checkpoint", str(checkpoint), "--overwrite", out=out)
    assert rc == 2 and "is not a rosbag2 bag; refusing to overwrite" in capsys.readouterr().err
    assert (out / "notes.txt").exists()
    shutil.rmtree(out)
    assert _replay(tmp_path, "--checkpoint", str(checkpoint), out=out)[0] == 0
    assert _replay(tmp_path, "--checkpoint", str(checkpoint), "--overwrite", "--storage", "mcap", out=out)[0] == 0
    # two calls: a published and a raw chunk, a latency and a diagnostics status each
    with Reader(out) as reader:
        assert reader.message_count == 8 and next(out.glob("*.mcap"), None) is not None


def _profile(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(PROFILE.read_text())
    data.update(changes)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_topic_is_named_with_the_topics_the_bag_has(tmp_path: Path, checkpoint: Path, capsys):
    prof = _profile(tmp_path, cameras={"top": {"topic": "/cameras/top/image_raw"},
                                       "wrist": {"topic": "/cameras/wrist/image_rect"}})
    rc, out = _replay(tmp_path, "--checkpoint", str(checkpoint), profile=prof)
    err = capsys.readouterr().err
    assert rc == 2 and "lacks topic(s) ['/cameras/wrist/image_rect']" in err
    assert "/cameras/wrist/image_raw (sensor_msgs/msg/CompressedImage)" in err
    assert not out.exists()


def test_checkpoint_for_another_robot_is_refused(tmp_path: Path, checkpoint: Path, capsys):
    joints = [f"j{i}" for i in range(6)]
    prof = _profile(tmp_path, joint_names=joints, joint_lower=[-1.0] * 6, joint_upper=[1.0] * 6)
    rc, out = _replay(tmp_path, "--checkpoint", str(checkpoint), profile=prof)
    assert rc == 2 and "has 7-dim states, profile 'sim' has 6 joints" in capsys.readouterr().err
    three = _profile(tmp_path, cameras={c: {"topic": f"/cameras/{c}/image_raw"} for c in ("top", "wrist", "left")})
    rc, out = _replay(tmp_path, "--checkpoint", str(checkpoint), profile=three)
    assert rc == 2 and "takes 2 camera(s), profile 'sim' has 3" in capsys.readouterr().err
    assert not out.exists()
