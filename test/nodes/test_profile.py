"""Robot profiles: the bundled YAMLs load, and every kind of mistake is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vla_runtime.nodes.profile import ProfileError, load_profile, profile_from_dict

CONFIG = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize("name, joints, cams", [("aloha", 14, 3), ("franka", 8, 2), ("sim", 7, 2)])
def test_bundled_profiles_load(name, joints, cams):
    p = load_profile(CONFIG / f"{name}.yaml")
    assert p.name == name and p.state_dim == joints and len(p.cameras) == cams
    assert all(lo < hi for lo, hi in zip(p.joint_lower, p.joint_upper))


def _sim() -> dict:
    return yaml.safe_load((CONFIG / "sim.yaml").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(joint_lower=d["joint_lower"][:-1]), "joint_lower: needs 7 finite values"),
    (lambda d: d.update(joint_upper=[-5.0] * 7), "each lower limit must be below"),
    (lambda d: d.update(control_hz=0), "control_hz"),
    (lambda d: d.update(contol_hz=50), r"unknown key\(s\) \['contol_hz'\]"),
    (lambda d: d["streaming"].update(predictor="magic"), "streaming.predictor"),
    (lambda d: d["streaming"]["stitch"].update(mode="teleport"), "streaming.stitch"),
    (lambda d: d["cameras"]["top"].update(topic="cameras/top"), "absolute topic"),
    (lambda d: d.update(cache={"enabled": True}), "cache.repository"),
    (lambda d: d["output"].update(kind="ros1"), "output.kind"),
    (lambda d: d.update(arm_slices=[[0, 9]]), "arm_slices"),
    (lambda d: d["engine"].update(dtype="int8"), "engine.dtype"),
])
def test_mistakes_are_refused_by_name(edit, message):
    d = _sim()
    edit(d)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(d, "sim")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(tmp_path / "bad.yaml")
