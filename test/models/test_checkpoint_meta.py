"""config.json against the tensors: variant names and camera slots."""

from __future__ import annotations

import pytest

from vla_runtime.models.checkpoint_meta import (
    CheckpointMetaError,
    camera_layout,
    check_variants,
    variant_names,
)
from vla_runtime.models.config import preset
from vla_runtime.testing.checkpoints import lerobot_features


def test_variant_names_only_for_known_sizes():
    full = preset("pi05")
    assert variant_names(full.vlm, full.expert) == {"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
    tiny = preset("pi05-tiny")
    assert variant_names(tiny.vlm, tiny.expert) == {}


def test_check_variants_names_both_sides():
    check_variants({"paligemma_variant": "gemma_2b"}, {"vlm": (2048, 16384), "expert": (1024, 4096)})
    with pytest.raises(CheckpointMetaError, match=r"action_expert_variant='gemma_2b' means width 2048 / MLP 16384, "
                                                  r"but the tensors have width 1024 / MLP 4096"):
        check_variants({"action_expert_variant": "gemma_2b"}, {"vlm": (2048, 16384), "expert": (1024, 4096)})
    with pytest.raises(CheckpointMetaError, match=r"unknown Gemma variant paligemma_variant='gemma_7b'"):
        check_variants({"paligemma_variant": "gemma_7b"}, {"vlm": (2048, 16384)})


@pytest.mark.parametrize("listed", [True, False])
def test_camera_layout_counts_each_empty_camera_once(listed: bool):
    cams = camera_layout(lerobot_features(["base_0_rgb", "left_wrist_0_rgb"], 1, listed))
    assert cams.real == ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
    assert cams.empty == ("observation.images.empty_camera_0",)
    assert cams.total == 3


@pytest.mark.parametrize("value, message", [(-1, "must be >= 0"), ("two", "must be an integer")])
def test_camera_layout_refuses_a_bad_empty_cameras(value, message: str):
    with pytest.raises(CheckpointMetaError, match=f"empty_cameras {message}"):
        camera_layout(lerobot_features(["base_0_rgb"], 0) | {"empty_cameras": value})
