"""Where a checkpoint's state/action statistics come from: LeRobot processor files or openpi assets.

LeRobot saves them as processor pipelines beside the weights (``normalize``); openpi as
``assets/<asset_id>/norm_stats.json`` (``openpi_norm``). A checkpoint holding both kinds, or an
asset asked for on a checkpoint without assets, is refused rather than resolved by a silent
preference: normalising with the wrong dataset's statistics gives plausible-looking wrong actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint_meta import read_meta
from .normalize import (
    NORMALIZER_REGISTRY_NAME,
    PREPROCESSOR_CONFIG,
    Normalizer,
    lerobot_normalizers,
    load_lerobot_normalization,
)
from .openpi_norm import ASSETS_DIR, NormAssetError, list_assets, load_openpi_normalization

KIND_LEROBOT = "lerobot"
KIND_OPENPI = "openpi"


@dataclass(frozen=True)
class NormSource:
    """What ``inspect`` reports and the policy applies: the kind, file, asset and modes."""

    kind: str
    file: str
    state_mode: str
    action_mode: str
    asset: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.file, "asset": self.asset,
                "state_mode": self.state_mode, "action_mode": self.action_mode}


def _has_lerobot_stats(root: Path) -> bool:
    return (root / PREPROCESSOR_CONFIG).is_file() or any(
        root.glob(f"policy_preprocessor_step_*_{NORMALIZER_REGISTRY_NAME}.safetensors"))


def checkpoint_normalizers(ckpt_dir: str | Path, asset: str | None = None, state_key: str = "observation.state",
                           action_key: str = "action") -> tuple[Normalizer, Normalizer, NormSource]:
    """``(state normaliser, action normaliser, source)`` for a checkpoint directory.

    ``asset`` chooses the openpi asset (required when there are several); ``state_key`` /
    ``action_key`` name the LeRobot features (openpi's keys are fixed: ``state``, ``actions``).
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    lerobot, assets = _has_lerobot_stats(root), list_assets(root)
    if lerobot and assets:
        raise NormAssetError(f"{root} holds both LeRobot statistics ({PREPROCESSOR_CONFIG}) and openpi assets "
                             f"{assets}: remove the ones that do not belong to this checkpoint")
    if assets or asset is not None:
        norm = load_openpi_normalization(root, read_meta(root), asset)
        return norm.state, norm.action, NormSource(KIND_OPENPI, str(norm.path.relative_to(root)), norm.mode,
                                                   norm.mode, norm.asset)
    if not lerobot and (root / ASSETS_DIR).is_dir():
        raise NormAssetError(f"{root / ASSETS_DIR} has no <asset_id>/norm_stats.json and there are no LeRobot statistics")
    norm = load_lerobot_normalization(root)
    state, action = lerobot_normalizers(norm, state_key, action_key)
    return state, action, NormSource(KIND_LEROBOT, PREPROCESSOR_CONFIG, norm.checkpoint_mode(state_key, "STATE"),
                                     norm.checkpoint_mode(action_key, "ACTION"))
