"""Tests for LeRobot-compatible normalisation and loading of its processor files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vla_runtime.models.normalize import (
    save_lerobot_normalization,
    IdentityNormalizer,
    MeanStdNormalizer,
    MinMaxNormalizer,
    Normalizer,
    QuantileNormalizer,
    load_lerobot_normalization,
    load_lerobot_stats,
    make_normalizer,
    normalizers_from_checkpoint,
    normalizers_from_stats,
    pad_to,
)

STATE_DIM, ACTION_DIM = 7, 6


def _dataset_stats() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def feat(dim: int) -> dict[str, torch.Tensor]:
        lo = torch.randn(dim, generator=g)
        hi = lo + torch.rand(dim, generator=g) * 3 + 0.1
        return {
            "min": lo - 1,
            "max": hi + 1,
            "mean": (lo + hi) / 2,
            "std": (hi - lo) / 4,
            "q01": lo,
            "q10": lo + 0.1,
            "q50": (lo + hi) / 2,
            "q90": hi - 0.1,
            "q99": hi,
            "count": torch.tensor([1000.0]),
        }

    return {
        "observation.state": feat(STATE_DIM),
        "action": feat(ACTION_DIM),
        "observation.images.base_0_rgb": {
            "mean": torch.full((3, 1, 1), 0.5),
            "std": torch.full((3, 1, 1), 0.2),
        },
    }


def _write_lerobot_processors(ckpt: Path, stats: dict[str, dict[str, torch.Tensor]], *, post_stats=None) -> None:
    save_lerobot_normalization(ckpt, stats, camera_keys=("observation.images.base_0_rgb",), post_stats=post_stats)


# --- QuantileNormalizer ------------------------------------------------------------------


def test_quantile_formula_and_round_trip():
    q01 = torch.tensor([0.0, -2.0, 10.0])
    q99 = torch.tensor([1.0, 2.0, 30.0])
    n = QuantileNormalizer(q01, q99)
    x = torch.tensor([[0.0, -2.0, 10.0], [1.0, 2.0, 30.0], [0.5, 0.0, 20.0], [2.0, -6.0, 0.0]])
    y = n.normalize(x)
    expected = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [3.0, -3.0, -2.0]])
    torch.testing.assert_close(y, expected)  # no clipping outside [-1, 1]
    torch.testing.assert_close(n.unnormalize(y), x)
    assert isinstance(n, Normalizer) and n.dim == 3


def test_quantile_zero_range_uses_eps_substitute():
    n = QuantileNormalizer(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 4.0]))
    y = n.normalize(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(y, torch.tensor([-1.0, 0.0]))
    # eps replaces the zero range (LeRobot's torch.where), it is not added to non-zero ranges.
    x64 = torch.tensor([1.0 + 1e-8, 4.0], dtype=torch.float64)
    torch.testing.assert_close(n.normalize(x64), torch.tensor([1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(n.unnormalize(torch.tensor([0.3, 1.0])), torch.tensor([1.0, 4.0]))


def test_quantile_dtype_follows_input():
    n = QuantileNormalizer(torch.zeros(2), torch.ones(2))
    assert n.normalize(torch.tensor([0.5, 0.5], dtype=torch.float64)).dtype == torch.float64
    assert n.normalize(torch.tensor([0, 1])).dtype == torch.float32  # ints are promoted


def test_unnormalize_trims_padded_model_output():
    n = QuantileNormalizer(torch.zeros(ACTION_DIM), torch.full((ACTION_DIM,), 2.0))
    padded = torch.zeros(2, 50, 32)
    out = n.unnormalize(padded)
    assert out.shape == (2, 50, ACTION_DIM)
    torch.testing.assert_close(out, torch.ones(2, 50, ACTION_DIM))
    with pytest.raises(ValueError, match=f">= {ACTION_DIM}"):
        n.unnormalize(torch.zeros(3))
    with pytest.raises(ValueError, match=f"last dimension {ACTION_DIM}"):
        n.normalize(torch.zeros(32))


@pytest.mark.parametrize(
    "q01, q99, msg",
    [
        (torch.zeros(3), torch.ones(4), "same shape"),
        (torch.zeros(3), torch.tensor([1.0, -1.0, 1.0]), r"q99 < q01 at indices \[1\]"),
        (torch.tensor([0.0, float("nan")]), torch.ones(2), "non-finite"),
        (torch.zeros(2, 2), torch.ones(2, 2), "1-D"),
    ],
)
def test_quantile_validation(q01, q99, msg):
    with pytest.raises(ValueError, match=msg):
        QuantileNormalizer(q01, q99)


def test_pad_to():
    x = torch.arange(6.0).reshape(2, 3)
    p = pad_to(x, 5)
    assert p.shape == (2, 5) and torch.equal(p[:, :3], x) and (p[:, 3:] == 0).all()
    assert pad_to(x, 3) is x
    with pytest.raises(ValueError, match="cannot pad last dimension 3 down to 2"):
        pad_to(x, 2)


# --- other modes -------------------------------------------------------------------------


def test_other_modes_match_lerobot_formulas():
    x = torch.tensor([[0.5, -1.0, 3.0]])
    mm = MinMaxNormalizer(torch.tensor([0.0, -2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(mm.normalize(x), torch.tensor([[0.0, -0.5, -1.0]]))
    torch.testing.assert_close(mm.unnormalize(mm.normalize(x)), x)

    ms = MeanStdNormalizer(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.5, 2.0, 1.0]))
    y = ms.normalize(x)
    torch.testing.assert_close(y, (x - ms.mean) / (ms.std + 1e-8))
    torch.testing.assert_close(ms.unnormalize(y), y * ms.std + ms.mean)  # inverse has no eps

    ident = IdentityNormalizer(3)
    assert torch.equal(ident.normalize(x), x) and torch.equal(ident.unnormalize(pad_to(x, 8)), x)
    with pytest.raises(ValueError, match="std must be >= 0"):
        MeanStdNormalizer(torch.zeros(2), torch.tensor([1.0, -1.0]))


def test_make_normalizer_modes():
    stats = _dataset_stats()
    s = stats["observation.state"]
    q = make_normalizer(stats, "observation.state", "QUANTILES")
    assert isinstance(q, QuantileNormalizer) and torch.equal(q.q01, s["q01"])
    q10 = make_normalizer(stats, "observation.state", "QUANTILE10")
    assert isinstance(q10, QuantileNormalizer) and torch.equal(q10.q99, s["q90"])
    assert isinstance(make_normalizer(stats, "action", "MIN_MAX"), MinMaxNormalizer)
    assert isinstance(make_normalizer(stats, "action", "mean_std"), MeanStdNormalizer)
    assert make_normalizer(stats, "action", "IDENTITY").dim == ACTION_DIM
    with pytest.raises(ValueError, match="unsupported normalisation mode 'ZSCORE'"):
        make_normalizer(stats, "action", "ZSCORE")


# --- LeRobot files -----------------------------------------------------------------------


def test_load_lerobot_stats_round_trip(tmp_path: Path):
    stats = _dataset_stats()
    _write_lerobot_processors(tmp_path, stats)
    loaded = load_lerobot_stats(tmp_path)
    assert set(loaded) == set(stats)
    for feature, sub in stats.items():
        assert set(loaded[feature]) == set(sub)
        for name, t in sub.items():
            assert loaded[feature][name].dtype == torch.float32
            torch.testing.assert_close(loaded[feature][name], t)

    norm = load_lerobot_normalization(tmp_path)
    assert norm.norm_map == {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    assert norm.feature_types["action"] == "ACTION" and norm.eps == 1e-8
    assert norm.mode_for("observation.state") == "QUANTILES"
    assert norm.mode_for("observation.images.base_0_rgb") == "IDENTITY"


def test_normalizers_from_stats_and_checkpoint(tmp_path: Path):
    stats = _dataset_stats()
    _write_lerobot_processors(tmp_path, stats)
    state_n, action_n = normalizers_from_stats(load_lerobot_stats(tmp_path))
    assert state_n.dim == STATE_DIM and action_n.dim == ACTION_DIM
    x = stats["observation.state"]["q99"]
    torch.testing.assert_close(state_n.normalize(x), torch.ones(STATE_DIM))
    a = torch.randn(50, ACTION_DIM)
    torch.testing.assert_close(action_n.unnormalize(pad_to(action_n.normalize(a), 32)), a, atol=1e-5, rtol=1e-5)

    state_c, action_c = normalizers_from_checkpoint(tmp_path)
    assert isinstance(state_c, QuantileNormalizer) and isinstance(action_c, QuantileNormalizer)
    assert torch.equal(action_c.q99, action_n.q99)  # type: ignore[attr-defined]


def test_action_stats_come_from_postprocessor(tmp_path: Path):
    stats = _dataset_stats()
    post = {k: {s: t.clone() for s, t in v.items()} for k, v in stats.items()}
    post["action"]["q99"] = post["action"]["q99"] + 5.0
    post["observation.state"]["q99"] = post["observation.state"]["q99"] + 5.0
    _write_lerobot_processors(tmp_path, stats, post_stats=post)
    loaded = load_lerobot_stats(tmp_path)
    torch.testing.assert_close(loaded["action"]["q99"], post["action"]["q99"])
    torch.testing.assert_close(loaded["observation.state"]["q99"], stats["observation.state"]["q99"])


def test_missing_stat_keys_raise(tmp_path: Path):
    stats = _dataset_stats()
    del stats["action"]["q01"]
    _write_lerobot_processors(tmp_path, stats)
    loaded = load_lerobot_stats(tmp_path)
    with pytest.raises(ValueError, match=r"'action' needs stats \['q01', 'q99'\], missing \['q01'\]"):
        normalizers_from_stats(loaded)
    with pytest.raises(ValueError, match="no statistics for feature 'observation.joints'"):
        normalizers_from_stats(loaded, state_key="observation.joints")


def test_missing_files_raise(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="policy_preprocessor.json"):
        load_lerobot_stats(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_lerobot_stats(tmp_path / "nope")

    _write_lerobot_processors(tmp_path, _dataset_stats())
    (tmp_path / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="refers to policy_postprocessor_step_0_unnormalizer"):
        load_lerobot_stats(tmp_path)


def test_json_without_normalizer_step_raises(tmp_path: Path):
    _write_lerobot_processors(tmp_path, _dataset_stats())
    cfg = json.loads((tmp_path / "policy_preprocessor.json").read_text())
    cfg["steps"] = [s for s in cfg["steps"] if s.get("registry_name") != "normalizer_processor"]
    (tmp_path / "policy_preprocessor.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expected exactly one 'normalizer_processor' step, found 0"):
        load_lerobot_stats(tmp_path)


def test_glob_fallback_without_json(tmp_path: Path):
    stats = _dataset_stats()
    _write_lerobot_processors(tmp_path, stats)
    (tmp_path / "policy_preprocessor.json").unlink()
    (tmp_path / "policy_postprocessor.json").unlink()
    loaded = load_lerobot_stats(tmp_path)
    torch.testing.assert_close(loaded["observation.state"]["q01"], stats["observation.state"]["q01"])
    state_n, _ = normalizers_from_checkpoint(tmp_path)
    assert isinstance(state_n, QuantileNormalizer)
