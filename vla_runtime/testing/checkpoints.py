"""Checkpoints of any size for tests, without the bytes: real safetensors headers, sparse payloads.

A full-width pi0.5 holds gigabytes of weights, but the loader's architecture inference, camera
counting, variant checks and ``inspect`` read only headers and ``config.json``. A sparse file
(header written, payload a hole made by ``truncate``) costs no disk and no time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ..models.checkpoint import LEROBOT_PREFIX, layout_groups, unused_keys
from ..models.config import Pi05Config


def write_header_only(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file (F32) with a real header and an all-zero sparse payload."""
    header, offset = {}, 0
    for k, s in shapes.items():
        n = 4
        for d in s:
            n *= d
        header[k] = {"dtype": "F32", "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def public_shapes(cfg: Pi05Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the public layout for ``cfg`` (no ``model.`` prefix), LeRobot's full set."""
    shapes: dict[str, tuple[int, ...]] = {}
    for grp in layout_groups(cfg):
        shapes.update(zip(grp.public, grp.shapes))
    shapes.update(unused_keys(cfg))
    return shapes


def header_only_checkpoint(ckdir: Path, cfg: Pi05Config, meta: dict[str, Any], layout: str = "lerobot") -> Path:
    """A checkpoint directory of ``cfg``'s shapes (sparse ``model.safetensors``) with ``meta`` as config.json."""
    prefix = LEROBOT_PREFIX if layout == "lerobot" else ""
    ckdir.mkdir(parents=True)
    write_header_only(ckdir / "model.safetensors", {prefix + k: s for k, s in public_shapes(cfg).items()})
    (ckdir / "config.json").write_text(json.dumps(meta))
    return ckdir


def lerobot_features(real: list[str], empty: int, listed: bool = True, state_dim: int = 32) -> dict[str, Any]:
    """``input_features`` / ``empty_cameras`` of a LeRobot pi05 config.json.

    ``listed``: the empty cameras also appear as ``observation.images.empty_camera_<i>`` features,
    as LeRobot's config validation writes them; an older or hand-written config may omit them.
    """
    feats = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 224, 224]} for c in real}
    if listed:
        feats |= {f"observation.images.empty_camera_{i}": {"type": "VISUAL", "shape": [3, 224, 224]}
                  for i in range(empty)}
    return {"input_features": feats | {"observation.state": {"type": "STATE", "shape": [state_dim]}},
            "empty_cameras": empty}
