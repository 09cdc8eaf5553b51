"""Which statistics a checkpoint normalises with: LeRobot's processor files or openpi's assets,
never a silent preference between the two."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vla_runtime.models.norm_source import checkpoint_normalizers
from vla_runtime.models.normalize import normalizers_from_checkpoint, save_lerobot_normalization
from vla_runtime.models.openpi_norm import NormAssetError, save_norm_stats


def _openpi_stats(dim_state: int = 4, dim_action: int = 5) -> dict[str, dict[str, torch.Tensor]]:
    return {k: {"mean": torch.zeros(d), "std": torch.ones(d), "q01": -torch.ones(d), "q99": torch.ones(d)}
            for k, d in (("state", dim_state), ("actions", dim_action))}


def test_lerobot_checkpoint_uses_its_processor_files(tiny_checkpoint_dir: Path):
    state_n, action_n, source = checkpoint_normalizers(tiny_checkpoint_dir)
    assert source.as_dict() == {"kind": "lerobot", "file": "policy_preprocessor.json", "asset": None,
                                "state_mode": "QUANTILES", "action_mode": "QUANTILES"}
    ref_state, ref_action = normalizers_from_checkpoint(tiny_checkpoint_dir)
    x = torch.linspace(-2, 2, state_n.dim)
    assert torch.equal(state_n.normalize(x), ref_state.normalize(x))
    y = torch.linspace(-1, 1, 32)
    assert torch.equal(action_n.unnormalize(y), ref_action.unnormalize(y))


def test_asset_asked_of_a_lerobot_checkpoint_is_refused(tiny_checkpoint_dir: Path):
    with pytest.raises(NormAssetError, match=r"norm asset 'trossen' not found.*assets with statistics: none"):
        checkpoint_normalizers(tiny_checkpoint_dir, "trossen")


def test_both_kinds_of_statistics_are_refused(tiny_checkpoint_dir: Path, tmp_path: Path):
    ckpt = shutil.copytree(tiny_checkpoint_dir, tmp_path / "both")
    save_norm_stats(ckpt, "trossen", _openpi_stats())
    with pytest.raises(NormAssetError, match=r"both LeRobot statistics .* and openpi assets \['trossen'\]"):
        checkpoint_normalizers(ckpt)


def test_no_statistics_at_all_is_refused(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no LeRobot normalisation stats"):
        checkpoint_normalizers(tmp_path)
    (tmp_path / "assets").mkdir()
    with pytest.raises(NormAssetError, match=r"assets has no <asset_id>/norm_stats.json"):
        checkpoint_normalizers(tmp_path)


def test_lerobot_files_written_beside_openpi_assets_count_as_both(tmp_path: Path):
    save_norm_stats(tmp_path, "droid", _openpi_stats())
    save_lerobot_normalization(tmp_path, {"observation.state": {"q01": torch.zeros(4), "q99": torch.ones(4)},
                                          "action": {"q01": torch.zeros(5), "q99": torch.ones(5)}})
    with pytest.raises(NormAssetError, match=r"both LeRobot statistics"):
        checkpoint_normalizers(tmp_path, "droid")
