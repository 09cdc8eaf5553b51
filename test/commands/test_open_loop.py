"""replay --dataset: open-loop errors against a LeRobot dataset's actions, dense and cached side by
side, the golden regression, and the refusals."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from vla_runtime.cli import main
from vla_runtime.commands.replay import read_action_chunks
from vla_runtime.testing.lerobot_data import FPS, synthetic_episodes, write_test_checkpoint, write_test_dataset

CALL_PERIOD = 0.5
N_EXECUTE = round(CALL_PERIOD * FPS)   # the default: the frames until the next call


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("openloop")
    eps = synthetic_episodes()
    ckpt = str(write_test_checkpoint(root / "ckpt", eps))
    ds = str(write_test_dataset(root / "ds", episodes=eps))
    repo = root / "repo"
    assert main(["build-cache", "--dataset", ds, "--checkpoint", ckpt, "--out", str(repo), "--episodes", "0,1"]) == 0
    return {"episodes": eps, "checkpoint": ckpt, "dataset": ds, "repo": str(repo), "root": root}


@pytest.fixture(scope="module")
def run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("ol") / "out"
    assert main(["replay", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--out", str(out),
                 "--repository", files["repo"], "--episodes", "0-2", "--call-period", str(CALL_PERIOD)]) == 0
    return out, json.loads((out / "open_loop.json").read_text())


def test_errors_match_the_written_chunks(files, run):
    """The dense MAE of each episode, recomputed here from the chunks in the output bag and the
    actions the test wrote into the dataset (not read back through the reader), is the one
    reported: the chunk of the call at frame f is scored row j against frame f + j."""
    out, summary = run
    assert [e["episode"] for e in summary["episodes"]] == [0, 1, 2]
    for ep_sum, ep in zip(summary["episodes"], files["episodes"]):
        chunks = read_action_chunks(out / ep_sum["label"])
        assert len(chunks) == ep_sum["calls"] == 4
        errs = []
        for i, c in enumerate(chunks):
            f = 5 * i    # calls every 0.5 s at 10 fps
            rows = min(N_EXECUTE, ep.length - f)
            errs.append(np.abs(c.actions[:rows] - ep.action[f:f + rows].astype(np.float32)))
        errs = np.concatenate([e.ravel() for e in errs])
        dense = ep_sum["errors"]["dense"]["robot"]
        # the bag stores the chunk as float64 of the float32 robot units: same numbers
        assert dense["mae"] == pytest.approx(errs.mean(), rel=1e-6)
        assert dense["max"] == pytest.approx(errs.max(), rel=1e-6)
        assert dense["rmse"] == pytest.approx(np.sqrt((errs ** 2).mean()), rel=1e-6)
        assert ep_sum["errors"]["dense"]["normalised"]["mae"] > 0


def test_cached_side_by_side(run):
    _, summary = run
    eps = summary["episodes"]
    for e in eps:
        assert e["hits"] + sum(e["fallbacks"].values()) == e["calls"]
        assert set(e["errors"]) == {"dense", "cached"}
    # episodes 0 and 1 are in the repository: their own calls are found
    assert eps[0]["hits"] > 0 and eps[0]["hit_rate"] == eps[0]["hits"] / eps[0]["calls"]
    ov = summary["overall"]
    assert ov["calls"] == 12 and ov["hits"] == sum(e["hits"] for e in eps)


def test_dense_only_and_golden(files, run, tmp_path, capsys):
    golden, _ = run
    out = tmp_path / "again"
    args = ["replay", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"], "--episodes", "0-2"]
    assert main([*args, "--out", str(out), "--golden", str(golden)]) == 0
    summary = json.loads((out / "open_loop.json").read_text())
    assert summary["drift"] is False and summary["episodes"][0]["hit_rate"] is None    # no repository: dense only
    assert all(e["golden_max_abs_diff"] == 0.0 for e in summary["episodes"])
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "other_seed"), "--golden", str(golden), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "drifted from golden" in err and "episode_000000: call 0" in err


@pytest.mark.parametrize("extra, message", [
    (["in.bag"], "an input bag or --dataset, not both"),
    (["--golden", "nowhere"], "no open-loop output at nowhere"),
    (["--n-execute", "0"], "n_execute must be an int >= 1"),
    (["--episodes", "9"], r"no episode\(s\) \[9\]"),
])
def test_refusals(files, tmp_path, capsys, extra, message):
    assert main(["replay", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "o"), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_existing_out_refused(files, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    assert main(["replay", "--dataset", files["dataset"], "--checkpoint", files["checkpoint"],
                 "--out", str(tmp_path / "o"), "--overwrite"]) == 2
    assert "is not an open-loop output" in capsys.readouterr().err


def test_dataset_flags_need_a_dataset(tmp_path, capsys):
    assert main(["replay", "in.bag", "--out", str(tmp_path / "o"), "--repository", "r"]) == 2
    assert "--repository: only with --dataset" in capsys.readouterr().err
