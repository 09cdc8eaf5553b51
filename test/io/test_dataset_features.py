"""Which dataset feature feeds which model input: defaults from the checkpoint, overrides, the
profile's names, and every refusal naming the key."""

from __future__ import annotations

import pytest

from vla_runtime.io.dataset_features import FeatureMap, checkpoint_features, profile_features, resolve_features
from vla_runtime.io.lerobot_dataset import DatasetError, LeRobotDatasetReader
from vla_runtime.nodes.profile import ProfileError, profile_from_dict
from vla_runtime.testing.lerobot_data import CAMERAS, synthetic_episodes, write_test_checkpoint, write_test_dataset

STATE_DIM = 7   # the synthetic scenes' single arm: 6 joints + gripper


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    eps = synthetic_episodes()
    return write_test_checkpoint(root / "ckpt", eps), LeRobotDatasetReader(write_test_dataset(root / "ds", episodes=eps))


def test_checkpoint_defaults(files):
    ckpt, reader = files
    fm = checkpoint_features(ckpt)
    assert fm.cameras == {CAMERAS[0]: CAMERAS[0], CAMERAS[1]: CAMERAS[1]}
    assert (fm.state, fm.action) == ("observation.state", "action")
    fm.check(reader, STATE_DIM, STATE_DIM)


def test_overrides(files):
    ckpt, reader = files
    fm = resolve_features(ckpt, overrides=[f"{CAMERAS[1]}={CAMERAS[2]}"])
    assert list(fm.cameras.values()) == [CAMERAS[0], CAMERAS[2]]
    fm.check(reader, STATE_DIM, STATE_DIM)
    with pytest.raises(ValueError, match=r"'observation.images.top' is not a model input; known: "):
        fm.with_overrides(["observation.images.top=observation.images.cam0"])
    with pytest.raises(ValueError, match="expects MODEL_KEY=DATASET_KEY"):
        fm.with_overrides(["observation.state"])
    with pytest.raises(ValueError, match="one part only"):
        fm.with_overrides([f"{CAMERAS[0]}={CAMERAS[2]}"])


def test_profile_names(files):
    _, reader = files
    base = {"name": "p", "control_hz": 10, "cameras": {"top": "/top", "wrist": "/wrist"},
            "joint_names": [f"j{i}" for i in range(STATE_DIM)], "joint_lower": [-4] * STATE_DIM,
            "joint_upper": [4] * STATE_DIM}
    prof = profile_from_dict({**base, "dataset": {"cameras": {"top": CAMERAS[2]}}})
    fm = profile_features(prof)
    assert fm.cameras == {"top": CAMERAS[2], "wrist": "observation.images.wrist"}
    with pytest.raises(DatasetError, match=r"camera 'wrist': the dataset has no feature 'observation.images.wrist'"):
        fm.check(reader, STATE_DIM, STATE_DIM)
    with pytest.raises(ProfileError, match=r"dataset.cameras: must map camera names of this profile"):
        profile_from_dict({**base, "dataset": {"cameras": {"side": CAMERAS[0]}}})
    with pytest.raises(ProfileError, match=r"dataset: unknown key\(s\) \['images'\]"):
        profile_from_dict({**base, "dataset": {"images": {"top": CAMERAS[0]}}})


@pytest.mark.parametrize("fm, message", [
    (FeatureMap({"a": "observation.images.nope"}), r"camera 'a': the dataset has no feature 'observation.images.nope'"),
    (FeatureMap({"a": "timestamp"}), r"camera 'a': feature 'timestamp' is float32 \[1\], not a 3-channel image"),
    (FeatureMap({"a": CAMERAS[0]}, state="observation.joints"), r"state: the dataset has no feature 'observation.joints'"),
    (FeatureMap({"a": CAMERAS[0]}, state="timestamp"), r"state: feature 'timestamp' is float32 \[1\], the checkpoint "
                                                       r"expects a 7-vector"),
    (FeatureMap({"a": CAMERAS[0]}, action=CAMERAS[1]), r"action: feature 'observation.images.cam1' is image"),
])
def test_refusals_name_the_key(files, fm, message):
    _, reader = files
    with pytest.raises(DatasetError, match=message):
        fm.check(reader, STATE_DIM, STATE_DIM)


def test_action_dimension_mismatch(files):
    _, reader = files
    with pytest.raises(DatasetError, match=r"action: feature 'action' is float32 \[7\], the checkpoint expects a 5-vector"):
        FeatureMap({"a": CAMERAS[0]}).check(reader, STATE_DIM, 5)
