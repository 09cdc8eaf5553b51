"""openpi statistics: assets/<asset_id>/norm_stats.json read, chosen by name, and applied in the
mode the checkpoint's config says (quantile or mean/std), with openpi's arithmetic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.models.checkpoint import load_checkpoint, save_checkpoint
from vla_runtime.models.config import preset
from vla_runtime.models.norm_source import checkpoint_normalizers
from vla_runtime.models.openpi_norm import (
    NormAssetError,
    choose_asset,
    list_assets,
    read_norm_stats,
    save_norm_stats,
)
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.models.tokenizer import build_prompt, discretize_state

STATE_DIM, ACTION_DIM = 4, 5

# openpi's transforms, written out in float64 as the independent reference.
EPS = 1e-6


def quantile_ref(x, s):
    return (x - s["q01"]) / (s["q99"] - s["q01"] + EPS) * 2.0 - 1.0


def quantile_inv_ref(y, s):
    return (y + 1.0) / 2.0 * (s["q99"] - s["q01"] + EPS) + s["q01"]


def meanstd_ref(x, s):
    return (x - s["mean"]) / (s["std"] + EPS)


def meanstd_inv_ref(y, s):
    return y * (s["std"] + EPS) + s["mean"]


# Float32 arithmetic against the float64 reference: a handful of roundings (half an ulp, 6e-8
# relative, each) of values whose magnitude stays below ~4 after the scaling, so 1e-6 absolute
# plus 1e-6 relative bounds the difference with room to spare.
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _stats(seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Per-key stats, rounded to float32 (what the file holds and the normalisers compute with).

    The last dimension is nearly constant (std 1e-4, quantile range 1e-4): there the eps openpi
    adds (1e-6) changes the result by 1%, so the tests tell openpi's arithmetic from LeRobot's.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for key, dim in (("state", STATE_DIM), ("actions", ACTION_DIM)):
        mean = rng.normal(0, 0.5, dim)
        std = 0.1 + rng.random(dim)
        std[-1] = 1e-4
        # q01 / q99 deliberately not mean -/+ k std, so the two modes give different numbers.
        q01, q99 = mean - 2.0 * std - 0.3, mean + 2.6 * std + 0.1
        q01[-1], q99[-1] = mean[-1] - 5e-5, mean[-1] + 5e-5
        out[key] = {n: v.astype(np.float32).astype(np.float64)
                    for n, v in {"mean": mean, "std": std, "q01": q01, "q99": q99}.items()}
    return out


@pytest.fixture(scope="module")
def openpi_ckpt(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_path: Path) -> Path:
    root = tmp_path_factory.mktemp("openpi") / "pi05-tiny-openpi"
    save_checkpoint(init_random_(Pi05Model(preset("pi05-tiny")), seed=5), root, layout="openpi")
    shutil.copy(tiny_tokenizer_path, root / "tokenizer.model")
    save_norm_stats(root, "trossen", {k: {n: torch.tensor(v) for n, v in d.items()} for k, d in _stats(0).items()})
    return root


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(meta | config))
    return dst


def test_reads_norm_stats_as_written(openpi_ckpt: Path):
    assert list_assets(openpi_ckpt) == ["trossen"]
    got = read_norm_stats(openpi_ckpt, "trossen")
    want = _stats(0)
    assert set(got) == {"state", "actions"}
    for key in want:
        for name in ("mean", "std", "q01", "q99"):
            torch.testing.assert_close(got[key][name], torch.tensor(want[key][name], dtype=torch.float32))


def test_quantile_normalisation_applied_by_default(openpi_ckpt: Path):
    """No use_quantile_norm in config.json: openpi's pi0.5 default, the quantiles."""
    s = _stats(0)
    state_n, action_n, source = checkpoint_normalizers(openpi_ckpt)
    assert source.kind == "openpi" and source.asset == "trossen" and source.state_mode == "QUANTILES"
    assert source.file == "assets/trossen/norm_stats.json"
    x = np.random.default_rng(1).normal(0, 1, (3, STATE_DIM))
    torch.testing.assert_close(state_n.normalize(torch.tensor(x, dtype=torch.float32)).double(),
                               torch.tensor(quantile_ref(x, s["state"])), **TOL)
    y = np.random.default_rng(2).uniform(-1.2, 1.2, (3, 32))  # padded model output
    torch.testing.assert_close(action_n.unnormalize(torch.tensor(y, dtype=torch.float32)).double(),
                               torch.tensor(quantile_inv_ref(y[:, :ACTION_DIM], s["actions"])), **TOL)


def test_mean_std_normalisation_when_config_says_so(openpi_ckpt: Path, tmp_path: Path):
    ckpt = _copy(openpi_ckpt, tmp_path / "meanstd", use_quantile_norm=False)
    s = _stats(0)
    state_n, action_n, source = checkpoint_normalizers(ckpt)
    assert source.state_mode == source.action_mode == "MEAN_STD"
    x = np.random.default_rng(3).normal(0, 1, (3, STATE_DIM))
    torch.testing.assert_close(state_n.normalize(torch.tensor(x, dtype=torch.float32)).double(),
                               torch.tensor(meanstd_ref(x, s["state"])), **TOL)
    y = np.random.default_rng(4).normal(0, 1, (3, 32))
    torch.testing.assert_close(action_n.unnormalize(torch.tensor(y, dtype=torch.float32)).double(),
                               torch.tensor(meanstd_inv_ref(y[:, :ACTION_DIM], s["actions"])), **TOL)


def test_policy_applies_the_openpi_statistics(openpi_ckpt: Path):
    """End to end: the prompt carries the state normalised with the asset's quantiles, and the
    actions come back unnormalised with them."""
    s = _stats(0)
    policy = Pi05Policy.from_checkpoint(openpi_ckpt, camera_names=["cam0", "cam1"])
    assert policy.norm_source.kind == "openpi" and policy.state_dim == STATE_DIM
    state = np.array([0.3, -0.8, 1.1, 0.05])
    obs = Observation(images={"cam0": np.full((56, 56, 3), 128, np.uint8)}, state=state, task="pick up the cube")
    ids, _ = policy.tokenizer.encode(build_prompt(obs.task, discretize_state(
        torch.tensor(quantile_ref(state, s["state"]), dtype=torch.float32))))
    assert torch.equal(policy.prepare(obs).tokens[0], ids)
    noise = torch.randn(1, policy.engine.cfg.chunk_size, policy.engine.cfg.action_dim, generator=torch.Generator().manual_seed(0))
    out = policy.predict(obs, noise=noise)
    raw = out.engine.actions[0, :, :ACTION_DIM].double().numpy()
    np.testing.assert_allclose(out.actions, quantile_inv_ref(raw, s["actions"]), **TOL)


def test_weights_of_the_openpi_checkpoint_still_load(openpi_ckpt: Path):
    assert load_checkpoint(openpi_ckpt, compute_hash=False).layout == "openpi"


def test_several_assets_need_a_choice(openpi_ckpt: Path, tmp_path: Path):
    ckpt = _copy(openpi_ckpt, tmp_path / "two")
    save_norm_stats(ckpt, "physical-intelligence/libero",
                    {k: {n: torch.tensor(v) for n, v in d.items()} for k, d in _stats(9).items()})
    assert list_assets(ckpt) == ["physical-intelligence/libero", "trossen"]
    with pytest.raises(NormAssetError, match=r"several assets \['physical-intelligence/libero', 'trossen'\]"):
        checkpoint_normalizers(ckpt)
    state_n, _, source = checkpoint_normalizers(ckpt, "physical-intelligence/libero")
    assert source.asset == "physical-intelligence/libero"
    x = torch.zeros(STATE_DIM)
    torch.testing.assert_close(state_n.normalize(x).double(), torch.tensor(quantile_ref(np.zeros(STATE_DIM), _stats(9)["state"])), **TOL)


def test_missing_asset_refused_by_name(openpi_ckpt: Path):
    with pytest.raises(NormAssetError, match=r"norm asset 'droid' not found: .*assets/droid/norm_stats\.json.*\['trossen'\]"):
        checkpoint_normalizers(openpi_ckpt, "droid")
    with pytest.raises(NormAssetError, match="norm asset 'droid' not found"):
        choose_asset(openpi_ckpt, "droid")


def test_quantile_mode_needs_the_quantiles(openpi_ckpt: Path, tmp_path: Path):
    ckpt = _copy(openpi_ckpt, tmp_path / "noq")
    doc = json.loads((ckpt / "assets/trossen/norm_stats.json").read_text())
    doc["norm_stats"]["state"]["q01"] = None  # how openpi writes stats computed without quantiles
    (ckpt / "assets/trossen/norm_stats.json").write_text(json.dumps(doc))
    with pytest.raises(NormAssetError, match=r"norm asset 'trossen'.*QUANTILES normalisation of 'state' needs \['q01', 'q99'\], missing \['q01'\]"):
        checkpoint_normalizers(ckpt)


def test_use_quantile_norm_must_be_a_bool(openpi_ckpt: Path, tmp_path: Path):
    ckpt = _copy(openpi_ckpt, tmp_path / "badflag", use_quantile_norm="yes")
    with pytest.raises(NormAssetError, match="use_quantile_norm must be true or false, got 'yes'"):
        checkpoint_normalizers(ckpt)
