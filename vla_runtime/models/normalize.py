"""State/action normalisation matching LeRobot 0.6.1, and loading its saved statistics.

pi0.5 maps the robot state and actions to roughly [-1, 1] using the dataset's 1st and
99th percentiles (``NormalizationMode.QUANTILES``)::

    normalize:   y = 2 * (x - q01) / d - 1
    unnormalize: x = (y + 1) * d / 2 + q01
    where d = q99 - q01, replaced by eps = 1e-8 where it is exactly 0.

There is no clipping in either direction, and eps is a substitute for a zero range, not
an additive term, so dimensions with a non-zero range are exact affine maps.

LeRobot saves the statistics beside the checkpoint as processor pipelines:
``policy_preprocessor.json`` lists its steps, and the ``normalizer_processor`` step names
its state file (``policy_preprocessor_step_<i>_normalizer_processor.safetensors``);
``policy_postprocessor.json`` does the same for ``unnormalizer_processor``. Each file is a
flat safetensors dict keyed ``"<feature>.<stat>"``, e.g. ``observation.state.q01`` or
``action.q99``, holding the dataset stats of every feature (mean, std, min, max, q01, ...).

Statistics are at the dataset's own dimension; the model works on vectors padded with
zeros to 32 (``pad_to``), and its action output is cut back to the real action dimension
before unnormalising (``unnormalize`` accepts and trims the padded vector).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

LEROBOT_EPS = 1e-8
"""``_NormalizationMixin.eps`` default in LeRobot 0.6.1."""
OPENPI_EPS = 1e-6
"""The constant openpi's ``Normalize`` / ``Unnormalize`` transforms add to the range or std."""

# How eps enters the arithmetic. LeRobot substitutes eps for an exactly-zero quantile range and
# leaves it out of the mean/std inverse; openpi adds eps to the range (q99 - q01 + eps) and to the
# std in both directions. The difference is ~1e-6 relative: small, but a port should be exact.
CONVENTION_LEROBOT = "lerobot"
CONVENTION_OPENPI = "openpi"
CONVENTIONS = (CONVENTION_LEROBOT, CONVENTION_OPENPI)

PREPROCESSOR_CONFIG = "policy_preprocessor.json"
POSTPROCESSOR_CONFIG = "policy_postprocessor.json"
NORMALIZER_REGISTRY_NAME = "normalizer_processor"
UNNORMALIZER_REGISTRY_NAME = "unnormalizer_processor"

# LeRobot NormalizationMode values (str enum values as written to JSON).
MODE_IDENTITY = "IDENTITY"
MODE_MEAN_STD = "MEAN_STD"
MODE_MIN_MAX = "MIN_MAX"
MODE_QUANTILES = "QUANTILES"
MODE_QUANTILE10 = "QUANTILE10"
SUPPORTED_MODES = (MODE_IDENTITY, MODE_MEAN_STD, MODE_MIN_MAX, MODE_QUANTILES, MODE_QUANTILE10)

Stats = dict[str, dict[str, torch.Tensor]]


# --------------------------------------------------------------------------------------
# Normalizers
# --------------------------------------------------------------------------------------


@runtime_checkable
class Normalizer(Protocol):
    """Maps a feature between its raw units and the model's normalised space."""

    @property
    def dim(self) -> int: ...

    def normalize(self, x: torch.Tensor) -> torch.Tensor: ...

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor: ...


def pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad the last dimension of ``x`` up to ``dim`` (pi0.5 pads state/action to 32).

    Raises ValueError if ``x`` is already wider: silently passing it through (as LeRobot's
    ``pad_vector`` does) would hide a state/action dimension mismatch with the checkpoint.
    """
    if x.ndim == 0:
        raise ValueError("pad_to needs at least a 1-D tensor, got a scalar")
    cur = x.shape[-1]
    if cur > dim:
        raise ValueError(f"cannot pad last dimension {cur} down to {dim}; expected at most {dim}")
    if cur == dim:
        return x
    return torch.nn.functional.pad(x, (0, dim - cur))


def _as_stat(name: str, value: torch.Tensor | Any) -> torch.Tensor:
    t = torch.as_tensor(value).detach().to(torch.float32)
    if t.ndim != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} has non-finite values: {t.tolist()}")
    return t


def _stat_like(stat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # LeRobot moves the stats to the input's device *and dtype* before the arithmetic.
    return stat.to(device=x.device, dtype=x.dtype)


def _as_float_input(x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if not x.is_floating_point():
        x = x.to(torch.float32)
    if x.ndim == 0 or x.shape[-1] != dim:
        raise ValueError(f"{what}: expected last dimension {dim}, got shape {tuple(x.shape)}")
    return x


def _trim_output(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Accept a model output padded beyond ``dim`` and keep the first ``dim`` entries."""
    if not isinstance(y, torch.Tensor):
        y = torch.as_tensor(y)
    if not y.is_floating_point():
        y = y.to(torch.float32)
    if y.ndim == 0 or y.shape[-1] < dim:
        raise ValueError(f"unnormalize: expected last dimension >= {dim}, got shape {tuple(y.shape)}")
    return y[..., :dim]


def _range_denominator(low: torch.Tensor, high: torch.Tensor, x: torch.Tensor, eps: float,
                       convention: str = CONVENTION_LEROBOT) -> torch.Tensor:
    d = _stat_like(high, x) - _stat_like(low, x)
    if convention == CONVENTION_OPENPI:
        return d + eps
    return torch.where(d == 0, torch.tensor(eps, device=x.device, dtype=x.dtype), d)


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


def _validate_range(low_name: str, low: torch.Tensor, high_name: str, high: torch.Tensor) -> None:
    if low.shape != high.shape:
        raise ValueError(
            f"{low_name} and {high_name} must have the same shape, got {tuple(low.shape)} and {tuple(high.shape)}"
        )
    bad = torch.nonzero(high < low).flatten().tolist()
    if bad:
        raise ValueError(f"{high_name} < {low_name} at indices {bad}; expected {high_name} >= {low_name}")


@dataclass(frozen=True)
class QuantileNormalizer:
    """LeRobot ``QUANTILES`` mode: [q01, q99] -> [-1, 1], unclipped (pi0.5's default).

    Also used for ``QUANTILE10`` with the 10th/90th percentiles passed as q01/q99: LeRobot's
    arithmetic for the two modes is identical. With ``convention="openpi"`` the range is
    ``q99 - q01 + eps`` (openpi's quantile normalisation, eps ``OPENPI_EPS``).
    """

    q01: torch.Tensor
    q99: torch.Tensor
    eps: float = LEROBOT_EPS
    convention: str = CONVENTION_LEROBOT

    def __post_init__(self) -> None:
        object.__setattr__(self, "q01", _as_stat("q01", self.q01))
        object.__setattr__(self, "q99", _as_stat("q99", self.q99))
        _validate_range("q01", self.q01, "q99", self.q99)
        _check_convention(self.convention)

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_float_input(x, self.dim, "normalize")
        d = _range_denominator(self.q01, self.q99, x, self.eps, self.convention)
        return 2.0 * (x - _stat_like(self.q01, x)) / d - 1.0

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        y = _trim_output(y, self.dim)
        d = _range_denominator(self.q01, self.q99, y, self.eps, self.convention)
        return (y + 1.0) * d / 2.0 + _stat_like(self.q01, y)


@dataclass(frozen=True)
class MinMaxNormalizer:
    """LeRobot ``MIN_MAX`` mode: [low, high] -> [-1, 1] with the same zero-range rule."""

    low: torch.Tensor
    high: torch.Tensor
    eps: float = LEROBOT_EPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", _as_stat("min", self.low))
        object.__setattr__(self, "high", _as_stat("max", self.high))
        _validate_range("min", self.low, "max", self.high)

    @property
    def dim(self) -> int:
        return int(self.low.shape[0])

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_float_input(x, self.dim, "normalize")
        d = _range_denominator(self.low, self.high, x, self.eps)
        return 2.0 * (x - _stat_like(self.low, x)) / d - 1.0

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        y = _trim_output(y, self.dim)
        d = _range_denominator(self.low, self.high, y, self.eps)
        return (y + 1.0) * d / 2.0 + _stat_like(self.low, y)


@dataclass(frozen=True)
class MeanStdNormalizer:
    """LeRobot ``MEAN_STD`` mode: ``(x - mean) / (std + eps)``; inverse ``y * std + mean``.

    The inverse deliberately omits eps, as LeRobot's does, so a round trip is exact only
    up to a relative 1e-8 / std. With ``convention="openpi"`` the inverse is
    ``y * (std + eps) + mean``, as openpi's ``Unnormalize``.
    """

    mean: torch.Tensor
    std: torch.Tensor
    eps: float = LEROBOT_EPS
    convention: str = CONVENTION_LEROBOT

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", _as_stat("mean", self.mean))
        object.__setattr__(self, "std", _as_stat("std", self.std))
        if self.mean.shape != self.std.shape:
            raise ValueError(
                f"mean and std must have the same shape, got {tuple(self.mean.shape)} and {tuple(self.std.shape)}"
            )
        if (self.std < 0).any():
            raise ValueError(f"std must be >= 0, got {self.std.tolist()}")
        _check_convention(self.convention)

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_float_input(x, self.dim, "normalize")
        return (x - _stat_like(self.mean, x)) / (_stat_like(self.std, x) + self.eps)

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        y = _trim_output(y, self.dim)
        scale = _stat_like(self.std, y) + (self.eps if self.convention == CONVENTION_OPENPI else 0.0)
        return y * scale + _stat_like(self.mean, y)


@dataclass(frozen=True)
class IdentityNormalizer:
    """LeRobot ``IDENTITY`` mode (also what LeRobot does when a feature has no stats)."""

    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")

    @property
    def dim(self) -> int:
        return self.size

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return _as_float_input(x, self.dim, "normalize")

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        return _trim_output(y, self.dim)


# --------------------------------------------------------------------------------------
# Loading LeRobot processor files
# --------------------------------------------------------------------------------------


@dataclass
class LeRobotNormalization:
    """What a LeRobot checkpoint records about normalisation.

    Attributes:
        stats: ``{feature: {stat: tensor}}``; state-side features come from the
            preprocessor, and action features from the postprocessor (the stats each
            LeRobot pipeline actually applies).
        norm_map: ``{feature type: mode}``, e.g. ``{"STATE": "QUANTILES", "ACTION": "QUANTILES",
            "VISUAL": "IDENTITY"}``.
        feature_types: ``{feature: type}``, e.g. ``{"observation.state": "STATE", "action": "ACTION"}``.
        eps: the normaliser's eps (1e-8 unless changed).
    """

    stats: Stats
    norm_map: dict[str, str] = field(default_factory=dict)
    feature_types: dict[str, str] = field(default_factory=dict)
    eps: float = LEROBOT_EPS

    def mode_for(self, feature: str, default: str = MODE_IDENTITY) -> str:
        """The mode LeRobot applies to ``feature`` (IDENTITY if its type is unmapped)."""
        ftype = self.feature_types.get(feature)
        if ftype is None:
            return default
        return self.norm_map.get(ftype, MODE_IDENTITY)

    def checkpoint_mode(self, feature: str, default_type: str) -> str:
        """The mode for ``feature`` as loading applies it: pi0.5's QUANTILES when no ``norm_map``
        was recorded (JSON absent), else the mapped mode of its type (``default_type`` if unlisted)."""
        if not self.norm_map:
            return MODE_QUANTILES
        return self.norm_map.get(self.feature_types.get(feature, default_type), MODE_IDENTITY)


def _unflatten_stats(flat: dict[str, torch.Tensor], source: Path) -> Stats:
    out: Stats = {}
    for flat_key, tensor in flat.items():
        if "." not in flat_key:
            raise ValueError(f"{source}: key {flat_key!r} is not of the form '<feature>.<stat>'")
        feature, stat = flat_key.rsplit(".", 1)
        out.setdefault(feature, {})[stat] = tensor.to(torch.float32)
    return out


def _find_step(ckpt_dir: Path, config_name: str, registry_name: str) -> tuple[Path, dict[str, Any]]:
    """Return (state file, step config) for the named step of a saved pipeline.

    Falls back to globbing ``<pipeline>_step_*_<registry_name>.safetensors`` when the JSON is
    absent, so a directory holding only the tensors still loads (with default settings).
    """
    config_path = ckpt_dir / config_name
    pipeline = config_name.removesuffix(".json")
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        steps = config.get("steps")
        if not isinstance(steps, list):
            raise ValueError(f"{config_path}: expected a 'steps' list, got {type(steps).__name__}")
        matches = [s for s in steps if isinstance(s, dict) and s.get("registry_name") == registry_name]
        if len(matches) != 1:
            names = [s.get("registry_name", s.get("class")) for s in steps if isinstance(s, dict)]
            raise ValueError(
                f"{config_path}: expected exactly one '{registry_name}' step, found {len(matches)}; steps are {names}"
            )
        step = matches[0]
        state_file = step.get("state_file")
        if not state_file:
            raise ValueError(f"{config_path}: the '{registry_name}' step has no 'state_file' (no stats were saved)")
        state_path = ckpt_dir / state_file
        if not state_path.is_file():
            raise FileNotFoundError(f"{config_path} refers to {state_file}, which is missing from {ckpt_dir}")
        return state_path, dict(step.get("config") or {})

    candidates = sorted(ckpt_dir.glob(f"{pipeline}_step_*_{registry_name}.safetensors"))
    if len(candidates) == 1:
        logger.warning("%s missing in %s; using %s with default settings", config_name, ckpt_dir, candidates[0].name)
        return candidates[0], {}
    if len(candidates) > 1:
        raise ValueError(
            f"{config_name} missing in {ckpt_dir} and several stats files match: {[c.name for c in candidates]}"
        )
    raise FileNotFoundError(
        f"no LeRobot normalisation stats in {ckpt_dir}: looked for {config_name} and "
        f"{pipeline}_step_*_{registry_name}.safetensors"
    )


def load_lerobot_normalization(ckpt_dir: str | Path) -> LeRobotNormalization:
    """Read stats, modes and eps from a LeRobot checkpoint's processor files."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    pre_path, pre_cfg = _find_step(root, PREPROCESSOR_CONFIG, NORMALIZER_REGISTRY_NAME)
    post_path, post_cfg = _find_step(root, POSTPROCESSOR_CONFIG, UNNORMALIZER_REGISTRY_NAME)
    pre = _unflatten_stats(load_file(str(pre_path)), pre_path)
    post = _unflatten_stats(load_file(str(post_path)), post_path)

    feature_types: dict[str, str] = {}
    norm_map: dict[str, str] = {}
    for cfg in (pre_cfg, post_cfg):
        for name, spec in (cfg.get("features") or {}).items():
            if isinstance(spec, dict) and "type" in spec:
                feature_types[name] = str(spec["type"])
        norm_map.update({str(k): str(v) for k, v in (cfg.get("norm_map") or {}).items()})
    eps = float(pre_cfg.get("eps", post_cfg.get("eps", LEROBOT_EPS)))

    stats: Stats = {k: dict(v) for k, v in pre.items()}
    for feature, post_stats in post.items():
        is_action = feature_types.get(feature) == "ACTION" or feature == "action"
        if feature not in stats or is_action:
            stats[feature] = dict(post_stats)
    return LeRobotNormalization(stats=stats, norm_map=norm_map, feature_types=feature_types, eps=eps)


def load_lerobot_stats(ckpt_dir: str | Path) -> Stats:
    """``{feature: {stat: float32 tensor}}`` from a LeRobot checkpoint, e.g.
    ``stats["observation.state"]["q01"]``; see ``load_lerobot_normalization``."""
    return load_lerobot_normalization(ckpt_dir).stats


def _require(stats: Stats, feature: str, names: tuple[str, ...], mode: str) -> list[torch.Tensor]:
    if feature not in stats:
        raise ValueError(f"no statistics for feature {feature!r}; available features: {sorted(stats)}")
    missing = [n for n in names if n not in stats[feature]]
    if missing:
        raise ValueError(
            f"{mode} normalisation of {feature!r} needs stats {list(names)}, missing {missing}; "
            f"available: {sorted(stats[feature])}"
        )
    return [stats[feature][n] for n in names]


def make_normalizer(stats: Stats, feature: str, mode: str = MODE_QUANTILES, *, eps: float = LEROBOT_EPS) -> Normalizer:
    """Build the normaliser LeRobot would apply to ``feature`` in ``mode``."""
    mode = str(mode).upper()
    if mode == MODE_QUANTILES:
        q01, q99 = _require(stats, feature, ("q01", "q99"), mode)
        return QuantileNormalizer(q01, q99, eps)
    if mode == MODE_QUANTILE10:
        q10, q90 = _require(stats, feature, ("q10", "q90"), mode)
        return QuantileNormalizer(q10, q90, eps)
    if mode == MODE_MIN_MAX:
        lo, hi = _require(stats, feature, ("min", "max"), mode)
        return MinMaxNormalizer(lo, hi, eps)
    if mode == MODE_MEAN_STD:
        mean, std = _require(stats, feature, ("mean", "std"), mode)
        return MeanStdNormalizer(mean, std, eps)
    if mode == MODE_IDENTITY:
        # Only the dimension is needed; any per-dimension stat tells it.
        for name in ("q01", "min", "mean", "max", "q99", "std"):
            if name in stats.get(feature, {}):
                return IdentityNormalizer(int(torch.as_tensor(stats[feature][name]).numel()))
        raise ValueError(f"IDENTITY normalisation of {feature!r} needs a per-dimension stat to know its size")
    raise ValueError(f"unsupported normalisation mode {mode!r}; expected one of {SUPPORTED_MODES}")


def normalizers_from_stats(
    stats: Stats,
    state_key: str = "observation.state",
    action_key: str = "action",
    *,
    state_mode: str = MODE_QUANTILES,
    action_mode: str = MODE_QUANTILES,
    eps: float = LEROBOT_EPS,
) -> tuple[Normalizer, Normalizer]:
    """``(state_normalizer, action_normalizer)`` for pi0.5 (QUANTILES for both by default)."""
    return (
        make_normalizer(stats, state_key, state_mode, eps=eps),
        make_normalizer(stats, action_key, action_mode, eps=eps),
    )


def normalizers_from_checkpoint(
    ckpt_dir: str | Path, state_key: str = "observation.state", action_key: str = "action"
) -> tuple[Normalizer, Normalizer]:
    """Like ``normalizers_from_stats`` but with the modes and eps the checkpoint recorded.

    Without a recorded ``norm_map`` (JSON absent) pi0.5's QUANTILES is assumed.
    """
    return lerobot_normalizers(load_lerobot_normalization(ckpt_dir), state_key, action_key)


def lerobot_normalizers(norm: LeRobotNormalization, state_key: str = "observation.state",
                        action_key: str = "action") -> tuple[Normalizer, Normalizer]:
    """``(state_normalizer, action_normalizer)`` from loaded LeRobot statistics, in their recorded modes."""
    return (
        make_normalizer(norm.stats, state_key, norm.checkpoint_mode(state_key, "STATE"), eps=norm.eps),
        make_normalizer(norm.stats, action_key, norm.checkpoint_mode(action_key, "ACTION"), eps=norm.eps),
    )


# --------------------------------------------------------------------------------------
# Writing LeRobot processor files (tests, tools that make checkpoints)
# --------------------------------------------------------------------------------------


def save_lerobot_normalization(ckpt_dir: str | Path, stats: Stats, *, state_key: str = "observation.state",
                               action_key: str = "action", camera_keys: tuple[str, ...] = (),
                               post_stats: Stats | None = None, eps: float = LEROBOT_EPS) -> None:
    """Write ``policy_{pre,post}processor.json`` and their stats files as LeRobot 0.6.1 saves them.

    ``stats`` holds ``{feature: {stat: tensor}}``; the action side reads ``post_stats`` when given.
    """
    from safetensors.torch import save_file

    ckpt = Path(ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    norm_map = {"VISUAL": MODE_IDENTITY, "STATE": MODE_QUANTILES, "ACTION": MODE_QUANTILES}
    inputs = {k: {"type": "VISUAL", "shape": [3, 224, 224]} for k in camera_keys}

    def shape(feature_stats: dict[str, torch.Tensor]) -> list[int]:
        return list(next(t.shape for name, t in feature_stats.items() if name != "count"))

    inputs[state_key] = {"type": "STATE", "shape": shape(stats[state_key])}
    post = post_stats if post_stats is not None else stats
    outputs = {action_key: {"type": "ACTION", "shape": shape(post[action_key])}}
    pre_file = f"policy_preprocessor_step_3_{NORMALIZER_REGISTRY_NAME}.safetensors"
    post_file = f"policy_postprocessor_step_0_{UNNORMALIZER_REGISTRY_NAME}.safetensors"
    pre_cfg = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "relative_actions_processor", "config": {"enabled": False}},
        {"registry_name": NORMALIZER_REGISTRY_NAME, "state_file": pre_file,
         "config": {"eps": eps, "features": {**inputs, **outputs}, "norm_map": norm_map}},
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {"max_length": 200}},
        {"registry_name": "device_processor", "config": {"device": "cpu"}},
    ]}
    post_cfg = {"name": "policy_postprocessor", "steps": [
        {"registry_name": UNNORMALIZER_REGISTRY_NAME, "state_file": post_file,
         "config": {"eps": eps, "features": outputs, "norm_map": norm_map}},
        {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
        {"registry_name": "device_processor", "config": {"device": "cpu"}},
    ]}

    def flat(s: Stats) -> dict[str, torch.Tensor]:
        return {f"{k}.{name}": t.detach().clone().contiguous() for k, sub in s.items() for name, t in sub.items()}

    (ckpt / PREPROCESSOR_CONFIG).write_text(json.dumps(pre_cfg, indent=2))
    (ckpt / POSTPROCESSOR_CONFIG).write_text(json.dumps(post_cfg, indent=2))
    save_file(flat(stats), str(ckpt / pre_file))
    save_file(flat(post), str(ckpt / post_file))
