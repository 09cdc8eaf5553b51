"""Episodes from a LeRobot dataset as policy calls: causal sampling, recorded actions, selection."""

from __future__ import annotations

import numpy as np
import pytest

from vla_runtime.io.dataset_features import FeatureMap
from vla_runtime.io.episode_sources import DatasetRef, dataset_refs, parse_episode_selection
from vla_runtime.io.lerobot_dataset import DatasetError, LeRobotDatasetReader
from vla_runtime.testing.lerobot_data import CAMERAS, FPS, TASKS, synthetic_episodes, write_test_dataset

FEATURES = FeatureMap(cameras={"cam0": CAMERAS[0], "cam1": CAMERAS[1]})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    eps = synthetic_episodes()
    return eps, LeRobotDatasetReader(write_test_dataset(tmp_path_factory.mktemp("ds") / "ds", episodes=eps))


@pytest.mark.parametrize("period", [1 / FPS, 0.5, 0.25])
def test_calls_take_the_newest_frame(source, period):
    eps, reader = source
    for e, ep in enumerate(eps):
        calls = DatasetRef(reader, e, FEATURES).read(period)
        n = ep.length
        expected = [int(np.floor(k * period * FPS + 1e-6)) for k in range(int(np.floor((n - 1) / FPS / period + 1e-9)) + 1)]
        assert calls.call_frames.tolist() == expected
        assert calls.episode.task == TASKS[1 if e == 1 else 0] and calls.episode.success is None
        np.testing.assert_array_equal(calls.actions, ep.action.astype(np.float32))
        for k, (frame, f) in enumerate(zip(calls.episode.frames, expected)):
            assert frame.t == pytest.approx(k * period)
            np.testing.assert_array_equal(frame.state, ep.state[f].astype(np.float32))
            np.testing.assert_array_equal(frame.images["cam1"], ep.images[CAMERAS[1]][f])   # inline PNG: exact
            assert list(frame.images) == ["cam0", "cam1"]


def test_episode_selection():
    assert parse_episode_selection(None, [0, 1, 2]) == [0, 1, 2]
    assert parse_episode_selection("2,0-1,1", [0, 1, 2]) == [2, 0, 1]
    with pytest.raises(ValueError, match=r"no episode\(s\) \[3, 4\] \(it has 3: 0-2\)"):
        parse_episode_selection("1-4", [0, 1, 2])
    with pytest.raises(ValueError, match="expects indices and ranges"):
        parse_episode_selection("first", [0, 1, 2])
    with pytest.raises(ValueError, match="empty range"):
        parse_episode_selection("2-1", [0, 1, 2])


def test_refs(source):
    _, reader = source
    refs = dataset_refs(reader, FEATURES, "1-2")
    assert [r.label for r in refs] == ["episode_000001", "episode_000002"]
    assert refs[0].source.endswith("#episode=1")


def test_non_finite_state_refused(tmp_path):
    eps = synthetic_episodes()
    eps[1].state[4, 2] = np.nan
    reader = LeRobotDatasetReader(write_test_dataset(tmp_path / "ds", episodes=eps))
    with pytest.raises(DatasetError, match="state 'observation.state' is not finite at frame 4"):
        DatasetRef(reader, 1, FEATURES).read(0.5)
