"""What a checkpoint's ``config.json`` says, checked against what its tensors say.

LeRobot and openpi record the Gemma variants by name (``paligemma_variant``,
``action_expert_variant``) and LeRobot lists the cameras, but neither records depths; the loader
reads the architecture off the tensor shapes. The names are still worth checking: a config that
says ``gemma_2b`` for a tensor 1024 wide was written for another model (or edited by hand), and
loading it silently would hide that. Cameras need care too: LeRobot adds each of its
``empty_cameras`` to ``input_features`` as ``observation.images.empty_camera_<i>``, so the same
camera appears in both places and must be counted once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import GemmaConfig

CONFIG_FILE = "config.json"
EMPTY_CAMERA_PREFIX = "observation.images.empty_camera_"


class CheckpointError(ValueError):
    """The checkpoint cannot be used as is; the message says exactly why (raised by the loader,
    ``models.checkpoint``, and by the shared weight files it maps, ``models.shared_weights``)."""


class CheckpointMetaError(ValueError):
    """``config.json`` contradicts itself or the tensors; the message names both sides."""


@dataclass(frozen=True)
class GemmaVariant:
    """A named Gemma size as LeRobot / openpi spell it (widths are what the tensors must show)."""

    width: int
    mlp_dim: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256


GEMMA_VARIANTS: dict[str, GemmaVariant] = {
    "gemma_2b": GemmaVariant(width=2048, mlp_dim=16384),
    "gemma_300m": GemmaVariant(width=1024, mlp_dim=4096),
}
VARIANT_KEYS = {"vlm": "paligemma_variant", "expert": "action_expert_variant"}


def read_meta(path: Path) -> dict[str, Any]:
    """``config.json`` beside the weights (a checkpoint directory or a single file), ``{}`` if absent."""
    path = Path(path)
    cfg_file = (path if path.is_dir() else path.parent) / CONFIG_FILE
    if not cfg_file.exists():
        return {}
    try:
        meta = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise CheckpointMetaError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointMetaError(f"{cfg_file}: expected a JSON object, got {type(meta).__name__}")
    return meta


def variant(meta: dict[str, Any], tower: str) -> str | None:
    """The variant name ``config.json`` gives for ``tower`` ("vlm" or "expert"), validated; None if absent."""
    key = VARIANT_KEYS[tower]
    name = meta.get(key)
    if name is not None and name not in GEMMA_VARIANTS:
        raise CheckpointMetaError(f"unknown Gemma variant {key}={name!r} in config.json (known: {sorted(GEMMA_VARIANTS)})")
    return name


def check_variants(meta: dict[str, Any], widths: dict[str, tuple[int, int]]) -> None:
    """Refuse a variant name whose width or MLP width is not what the tensors have.

    ``widths`` maps "vlm" / "expert" to ``(width, mlp_dim)`` read off the tensors.
    """
    problems = []
    for tower, (width, mlp_dim) in widths.items():
        name = variant(meta, tower)
        if name is None:
            continue
        v = GEMMA_VARIANTS[name]
        if (v.width, v.mlp_dim) != (width, mlp_dim):
            problems.append(f"{VARIANT_KEYS[tower]}={name!r} means width {v.width} / MLP {v.mlp_dim}, "
                            f"but the tensors have width {width} / MLP {mlp_dim}")
    if problems:
        raise CheckpointMetaError("config.json does not describe these tensors: " + "; ".join(problems))


def variant_names(vlm: GemmaConfig, expert: GemmaConfig) -> dict[str, str]:
    """The ``config.json`` variant entries for towers of a known size (none for other sizes).

    Writing ``gemma_2b`` for a model of another width would make the file lie about itself.
    """
    out = {}
    for tower, c in (("vlm", vlm), ("expert", expert)):
        for name, v in GEMMA_VARIANTS.items():
            if (v.width, v.mlp_dim, v.num_heads, v.num_kv_heads, v.head_dim) == (
                    c.width, c.mlp_dim, c.num_heads, c.num_kv_heads, c.head_dim):
                out[VARIANT_KEYS[tower]] = name
    return out


@dataclass(frozen=True)
class CameraLayout:
    """The model's camera slots: the real cameras, then the ones LeRobot always feeds blank."""

    real: tuple[str, ...]
    empty: tuple[str, ...]

    @property
    def total(self) -> int:
        return len(self.real) + len(self.empty)


def camera_layout(meta: dict[str, Any]) -> CameraLayout:
    """Cameras from ``input_features`` (type VISUAL) and ``empty_cameras``, each counted once.

    LeRobot's config validation adds ``observation.images.empty_camera_<i>`` for i < empty_cameras
    to ``input_features``; an older or hand-written config may list only the count. Either way the
    empty cameras are exactly those ``empty_cameras`` names; a listed empty camera outside that
    range is a contradiction and refused.
    """
    feats = meta.get("input_features") or {}
    visual = [k for k, f in feats.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
    try:
        n_empty = int(meta.get("empty_cameras", 0) or 0)
    except (TypeError, ValueError):
        raise CheckpointMetaError(f"config.json: empty_cameras must be an integer, got {meta.get('empty_cameras')!r}") from None
    if n_empty < 0:
        raise CheckpointMetaError(f"config.json: empty_cameras must be >= 0, got {n_empty}")
    empty = tuple(f"{EMPTY_CAMERA_PREFIX}{i}" for i in range(n_empty))
    stray = [k for k in visual if k.startswith(EMPTY_CAMERA_PREFIX) and k not in empty]
    if stray:
        raise CheckpointMetaError(f"config.json lists {stray} as input features but empty_cameras is {n_empty}")
    return CameraLayout(real=tuple(k for k in visual if k not in empty), empty=empty)
