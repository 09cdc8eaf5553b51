"""``vla-runtime inspect``: its JSON for tools and CI, its text, and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vla_runtime.cli import main
from vla_runtime.models.checkpoint import checkpoint_files, content_hash, save_checkpoint
from vla_runtime.models.config import preset
from vla_runtime.models.openpi_norm import save_norm_stats
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.checkpoints import header_only_checkpoint, lerobot_features

EMB = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


def _inspect_json(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_describes_a_lerobot_checkpoint(tiny_checkpoint_dir: Path, capsys):
    info = _inspect_json(capsys, str(tiny_checkpoint_dir), "--hash")
    cfg = preset("pi05-tiny")
    assert info["layout"] == "lerobot" and info["dtype"] == "F32"
    assert info["depths"] == {"vision": cfg.vision.depth, "vlm": cfg.vlm.depth, "expert": cfg.expert.depth}
    assert (info["widths"]["vision"], info["widths"]["vlm"], info["widths"]["expert"]) == (
        cfg.vision.width, cfg.vlm.width, cfg.expert.width)
    assert info["cameras"] == {"total": 2, "real": ["observation.images.cam0", "observation.images.cam1"], "empty": []}
    assert (info["chunk_size"], info["action_dim"], info["max_state_dim"]) == (cfg.chunk_size, cfg.action_dim, cfg.max_state_dim)
    assert info["text_embedding"] == EMB
    assert info["normalization"] == {"kind": "lerobot", "file": "policy_preprocessor.json", "asset": None,
                                     "state_mode": "QUANTILES", "action_mode": "QUANTILES"}
    assert info["content_hash"] == content_hash(checkpoint_files(tiny_checkpoint_dir))


def test_empty_camera_reported_once(tmp_path: Path, capsys):
    """LeRobot's config.json lists the empty camera as a feature and in empty_cameras: 2 real +
    1 empty is 3 slots (it was reported as 4)."""
    meta = lerobot_features(["base_0_rgb", "left_wrist_0_rgb"], 1) | {
        "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"), meta)
    info = _inspect_json(capsys, str(ckdir))
    assert info["cameras"] == {"total": 3, "real": ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb"],
                               "empty": ["observation.images.empty_camera_0"]}
    assert info["widths"]["vlm"] == 2048 and info["widths"]["expert"] == 1024 and info["depths"]["vlm"] == 2
    assert info["normalization"]["kind"] is None and "no LeRobot normalisation stats" in info["normalization"]["problem"]
    assert info["content_hash"] is None
    assert main(["inspect", str(ckdir)]) == 0
    text = capsys.readouterr().out
    assert "cameras         3 (2 real: observation.images.base_0_rgb, observation.images.left_wrist_0_rgb; 1 empty)" in text


def test_openpi_assets_reported_and_chosen(tmp_path: Path, capsys):
    root = save_checkpoint(init_random_(Pi05Model(preset("pi05-tiny")), seed=2), tmp_path / "openpi", layout="openpi")
    stats = {k: {n: torch.arange(1.0, d + 1) * (2.0 if n in ("q99", "std") else 1.0) for n in ("mean", "std", "q01", "q99")}
             for k, d in (("state", 4), ("actions", 5))}
    for asset in ("droid", "trossen"):
        save_norm_stats(root, asset, stats)
    info = _inspect_json(capsys, str(root))
    assert info["layout"] == "openpi"
    assert info["normalization"]["kind"] is None and "['droid', 'trossen']" in info["normalization"]["problem"]
    info = _inspect_json(capsys, str(root), "--norm-asset", "trossen")
    assert info["normalization"] == {"kind": "openpi", "file": "assets/trossen/norm_stats.json", "asset": "trossen",
                                     "state_mode": "QUANTILES", "action_mode": "QUANTILES"}


def test_refusals_exit_2_with_the_reason(tiny_checkpoint_dir: Path, tmp_path: Path, capsys):
    ckpt = shutil.copytree(tiny_checkpoint_dir, tmp_path / "wrong_variant")
    meta = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(meta | {"action_expert_variant": "gemma_2b"}))
    assert main(["inspect", str(ckpt), "--json"]) == 2
    err = capsys.readouterr().err
    assert "action_expert_variant='gemma_2b' means width 2048" in err and "the tensors have width 64" in err


def test_mixed_dtypes_are_counted(tiny_checkpoint_dir: Path, tmp_path: Path, capsys):
    ckpt = shutil.copytree(tiny_checkpoint_dir, tmp_path / "mixed")
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, str(ckpt / "model.safetensors"))
    info = _inspect_json(capsys, str(ckpt))
    assert info["dtype"] == {"BF16": 1, "F32": len(tensors) - 1}
