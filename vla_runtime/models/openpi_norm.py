"""openpi's normalisation statistics: ``assets/<asset_id>/norm_stats.json`` beside the weights.

An openpi checkpoint (JAX or converted to PyTorch) carries one statistics file per dataset it was
trained or fine-tuned for, under ``assets/<asset_id>/`` (the id may contain ``/``, e.g.
``physical-intelligence/libero``). Each file reads
``{"norm_stats": {"state": {"mean", "std", "q01", "q99"}, "actions": {...}}}``. Which asset a
robot needs cannot be guessed when there are several, so the choice is explicit (an argument or
the profile's ``engine.norm_asset``) and an ambiguous or unknown one is refused with the candidates.

openpi normalises pi0.5 with the quantiles (its data configs set ``use_quantile_norm`` for every
model but pi0) and otherwise with mean/std; a ``use_quantile_norm`` entry in ``config.json``
states it explicitly and wins. The arithmetic is openpi's (``CONVENTION_OPENPI`` in
``normalize``): eps 1e-6 added to the range / std.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .normalize import (
    CONVENTION_OPENPI,
    MODE_MEAN_STD,
    MODE_QUANTILES,
    OPENPI_EPS,
    MeanStdNormalizer,
    Normalizer,
    QuantileNormalizer,
)

ASSETS_DIR = "assets"
NORM_STATS_FILE = "norm_stats.json"
STATE_KEY = "state"
ACTION_KEY = "actions"
QUANTILE_FLAG = "use_quantile_norm"


class NormAssetError(ValueError):
    """The statistics cannot be chosen or read; the message names the asset and the candidates."""


def list_assets(ckpt_dir: str | Path) -> list[str]:
    """Asset ids with a ``norm_stats.json`` under ``ckpt_dir/assets`` (sorted)."""
    root = Path(ckpt_dir) / ASSETS_DIR
    if not root.is_dir():
        return []
    return sorted(str(p.parent.relative_to(root)) for p in root.rglob(NORM_STATS_FILE))


def choose_asset(ckpt_dir: str | Path, asset: str | None = None) -> str:
    """The asset to use: ``asset`` if given and present, else the only one there is."""
    candidates = list_assets(ckpt_dir)
    root = Path(ckpt_dir) / ASSETS_DIR
    if asset is not None:
        if asset not in candidates:
            raise NormAssetError(f"norm asset {asset!r} not found: no {root / asset / NORM_STATS_FILE} "
                                 f"(assets with statistics: {candidates or 'none'})")
        return asset
    if not candidates:
        raise NormAssetError(f"no openpi statistics: no {ASSETS_DIR}/<asset_id>/{NORM_STATS_FILE} under {ckpt_dir}")
    if len(candidates) > 1:
        raise NormAssetError(f"{ckpt_dir} has statistics for several assets {candidates}; choose one "
                             "(argument norm_asset / profile key engine.norm_asset)")
    return candidates[0]


def _vector(asset: str, key: str, name: str, value: Any) -> torch.Tensor:
    try:
        t = torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError):
        raise NormAssetError(f"norm asset {asset!r}: {key}.{name} is not a list of numbers") from None
    if t.ndim != 1 or t.numel() == 0:
        raise NormAssetError(f"norm asset {asset!r}: {key}.{name} must be a non-empty vector, got shape {tuple(t.shape)}")
    return t


def read_norm_stats(ckpt_dir: str | Path, asset: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{key: {stat: tensor}}`` from one asset's ``norm_stats.json`` (absent stats left out)."""
    path = Path(ckpt_dir) / ASSETS_DIR / asset / NORM_STATS_FILE
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise NormAssetError(f"{path}: not valid JSON ({e})") from None
    stats = doc.get("norm_stats") if isinstance(doc, dict) else None
    if not isinstance(stats, dict):
        raise NormAssetError(f"{path}: expected a top-level 'norm_stats' object")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in stats.items():
        if not isinstance(entry, dict):
            raise NormAssetError(f"{path}: norm_stats.{key} must be an object")
        out[key] = {name: _vector(asset, key, name, v) for name, v in entry.items() if v is not None}
    return out


def uses_quantiles(meta: dict[str, Any]) -> bool:
    """openpi's choice for this checkpoint: ``config.json``'s ``use_quantile_norm`` if stated,
    else quantiles (what openpi uses for pi0.5)."""
    flag = meta.get(QUANTILE_FLAG, True)
    if not isinstance(flag, bool):
        raise NormAssetError(f"config.json: {QUANTILE_FLAG} must be true or false, got {flag!r}")
    return flag


@dataclass(frozen=True)
class OpenpiNormalization:
    """The chosen asset and the normalisers built from it."""

    asset: str
    path: Path
    mode: str  # MODE_QUANTILES or MODE_MEAN_STD
    state: Normalizer
    action: Normalizer


def _normalizer(stats: dict[str, dict[str, torch.Tensor]], key: str, mode: str, where: str) -> Normalizer:
    needed = ("q01", "q99") if mode == MODE_QUANTILES else ("mean", "std")
    if key not in stats:
        raise NormAssetError(f"{where}: no statistics for {key!r} (has {sorted(stats)})")
    missing = [n for n in needed if n not in stats[key]]
    if missing:
        raise NormAssetError(f"{where}: {mode} normalisation of {key!r} needs {list(needed)}, missing {missing}")
    a, b = (stats[key][n] for n in needed)
    try:
        if mode == MODE_QUANTILES:
            return QuantileNormalizer(a, b, OPENPI_EPS, CONVENTION_OPENPI)
        return MeanStdNormalizer(a, b, OPENPI_EPS, CONVENTION_OPENPI)
    except ValueError as e:
        raise NormAssetError(f"{where}: {key}: {e}") from None


def load_openpi_normalization(ckpt_dir: str | Path, meta: dict[str, Any], asset: str | None = None) -> OpenpiNormalization:
    """State and action normalisers from the chosen asset, in the mode the checkpoint's config says."""
    chosen = choose_asset(ckpt_dir, asset)
    path = Path(ckpt_dir) / ASSETS_DIR / chosen / NORM_STATS_FILE
    stats = read_norm_stats(ckpt_dir, chosen)
    mode = MODE_QUANTILES if uses_quantiles(meta) else MODE_MEAN_STD
    where = f"norm asset {chosen!r} ({path})"
    return OpenpiNormalization(chosen, path, mode, _normalizer(stats, STATE_KEY, mode, where),
                               _normalizer(stats, ACTION_KEY, mode, where))


def save_norm_stats(ckpt_dir: str | Path, asset: str, stats: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write ``assets/<asset>/norm_stats.json`` as openpi does (tests, tools that make checkpoints)."""
    path = Path(ckpt_dir) / ASSETS_DIR / asset / NORM_STATS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"norm_stats": {k: {n: torch.as_tensor(t).tolist() for n, t in v.items()} for k, v in stats.items()}}
    path.write_text(json.dumps(doc, indent=2))
    return path
