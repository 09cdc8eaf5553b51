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
    (lambda d: d["streaming"].update(tick_rt_priority=100), r"streaming.tick_rt_priority: must be an int in \[0, 99\]"),
    (lambda d: d["streaming"].update(tick_rt_priority=True), r"streaming.tick_rt_priority: must be an int"),
    (lambda d: d["streaming"].update(policy_nice=-21), r"streaming.policy_nice: must be null or an int in \[-20, 19\]"),
    (lambda d: d["streaming"].update(policy_nice=1.5), r"streaming.policy_nice: must be null or an int"),
    (lambda d: d["cameras"]["top"].update(topic="cameras top"), "must be a topic name"),
    (lambda d: d.update(cache={"enabled": True}), "cache.repository"),
    (lambda d: d["output"].update(kind="ros1"), "output.kind"),
    (lambda d: d.update(arm_slices=[[0, 9]]), "arm_slices"),
    (lambda d: d["engine"].update(dtype="int8"), "engine.dtype"),
    (lambda d: d["engine"].update(norm_asset=""), "engine.norm_asset: must be null or a non-empty asset id"),
    (lambda d: d["engine"].update(weights_per_role="yes"), "engine.weights_per_role: must be true or false"),
    (lambda d: d.update(cache={"rho_p": 0}), r"cache.rho_p: must be null .* or in \(0, 1\], got 0"),
    (lambda d: d.update(cache={"rho_p": 1.5}), r"cache.rho_p: must be null .* or in \(0, 1\], got 1.5"),
    (lambda d: d.update(cache={"rho_p": "0.2"}), r"cache.rho_p: must be null .* or in \(0, 1\], got '0.2'"),
    (lambda d: d.update(cache={"background_nice": 20}), r"cache.background_nice: must be an int in \[0, 19\]"),
    (lambda d: d.update(cache={"reuse_budget_mb": -1}), r"cache.reuse_budget_mb: must be an int >= 0 .*got -1"),
    (lambda d: d.update(cache={"reuse_budget_mb": 1.5}), r"cache.reuse_budget_mb: must be an int >= 0 .*got 1.5"),
    (lambda d: d.update(cache={"action_cache": "yes"}), r"sim.cache: cache.action_cache: must be auto, on or off"),
    (lambda d: d.update(cache={"context_cache": 1}), r"sim.cache: cache.context_cache: must be auto, on or off"),
    (lambda d: d.update(cache={"enabled": True, "repository": "/r", "context_cache": "off", "action_cache": "off"}),
     "both context_cache and action_cache off"),
    (lambda d: d.update(cache={"min_similarity": 0}), r"cache.min_similarity: must be in \(0, 1\]"),
    (lambda d: d.update(cache={"first_scene_floor": "yes"}), "cache.first_scene_floor: must be true or false"),
    (lambda d: d.update(cache={"max_end_matches": -1}), r"cache.max_end_matches: must be an integer >= 0"),
    (lambda d: d.update(cache={"selection_check_calls": -1}), r"cache.selection_check_calls: must be an integer >= 0"),
    (lambda d: d.update(cache={"selection_check_calls": 2.5}),
     r"cache.selection_check_calls: must be an integer >= 0 .*got 2.5"),
    (lambda d: d.update(cache={"enabled": True, "repository": "/r", "context_cache": False, "action_cache": False}),
     "both context_cache and action_cache off"),
    (lambda d: d["output"].update(joint_slices=[[0, 9]]), "output.joint_slices"),
    (lambda d: d["output"].update(single_topics=["/gripper"], single_names=["gripper"], single_joints=[6]),
     "interbotix_joint_group output only"),
])
def test_mistakes_are_refused_by_name(edit, message):
    d = _sim()
    edit(d)
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(d, "sim")


def test_a_retired_cache_key_is_warned_and_ignored(caplog):
    """``cache.reference_timeout_s`` (the vision node's wait for the cache manager, gone with the
    wait itself): an old profile still loads, and says the key does nothing now."""
    d = _sim()
    d["cache"] = {"reference_timeout_s": 0.5, "min_similarity": 0.7}
    with caplog.at_level("WARNING"):
        prof = profile_from_dict(d, "sim")
    assert prof.cache.min_similarity == 0.7 and "sim.cache.reference_timeout_s is no longer used" in caplog.text


@pytest.mark.parametrize("given, want", [(None, None), (0.2, 0.2), (1, 1)])
def test_rho_p_left_unset_is_left_to_the_repository(given, want):
    """``cache.rho_p`` null (or absent, the bundled profiles' way) is read as unset: the stages then
    take the fraction the repository was profiled at (``halves.choose_rho_p``)."""
    d = _sim()
    d["cache"] = {} if given is None else {"rho_p": given}
    assert profile_from_dict(d, "sim").cache.rho_p == want
    assert load_profile(CONFIG / "aloha.yaml").cache.rho_p is None


@pytest.mark.parametrize("context, action, want", [
    (None, None, ("auto", "auto")),          # the default: the repository's recorded timing decides
    ("auto", "on", ("auto", "on")), ("off", "auto", ("off", "auto")),
    (True, False, ("on", "off")),            # older profiles' booleans
    ("ON", "Off", ("on", "off")),
])
def test_cache_halves_read_as_auto_on_or_off(context, action, want):
    d = _sim()
    d["cache"] = {k: v for k, v in (("context_cache", context), ("action_cache", action)) if v is not None}
    c = profile_from_dict(d, "sim").cache
    assert (c.context_cache, c.action_cache) == want


def test_yaml_on_and_off_unquoted_mean_on_and_off():
    """YAML 1.1 reads a bare on/off as a boolean: it still means what it says."""
    d = yaml.safe_load("cache: {context_cache: off, action_cache: on}")
    c = profile_from_dict({**_sim(), **d}, "sim").cache
    assert (c.context_cache, c.action_cache) == ("off", "on")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(tmp_path / "bad.yaml")


def test_aloha_grippers_take_single_joint_commands():
    from vla_runtime.nodes.adapters import group_commands, single_commands

    p = load_profile(CONFIG / "aloha.yaml")
    action = [float(i) for i in range(14)]
    groups = group_commands(p.output, action)
    assert [(c.topic_index, c.name, c.values) for c in groups] == [(0, "arm", (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)),
                                                                   (1, "arm", (7.0, 8.0, 9.0, 10.0, 11.0, 12.0))]
    singles = single_commands(p.output, action)
    assert [(c.topic_index, c.name, c.values) for c in singles] == [(0, "gripper", (6.0,)), (1, "gripper", (13.0,))]
    d = yaml.safe_load((CONFIG / "aloha.yaml").read_text())
    d["output"]["single_joints"] = [6, 14]
    with pytest.raises(ProfileError, match="output.single_joints"):
        profile_from_dict(d, "aloha")
    d["output"]["single_joints"] = [6]
    with pytest.raises(ProfileError, match="one joint name and one action index per single topic"):
        profile_from_dict(d, "aloha")


def test_sim_profile_names_the_joints_the_demo_robot_records():
    from vla_runtime.sim.scenes import joint_names

    assert load_profile(CONFIG / "sim.yaml").joint_names == joint_names(1)


def test_joint_limits_carry_positions_and_speeds():
    aloha = load_profile(CONFIG / "aloha.yaml")
    limits = aloha.joint_limits()
    assert limits.dim == 14
    assert list(limits.lower) == list(aloha.joint_lower) and list(limits.upper) == list(aloha.joint_upper)
    assert list(limits.max_velocity) == list(aloha.max_velocity)
    data = yaml.safe_load((CONFIG / "sim.yaml").read_text())
    data.pop("max_velocity", None)
    assert profile_from_dict(data).joint_limits().max_velocity is None


def test_norm_asset_reaches_the_engine_spec():
    d = _sim()
    d["engine"]["norm_asset"] = "physical-intelligence/libero"
    assert profile_from_dict(d, "sim").engine.norm_asset == "physical-intelligence/libero"


def test_relative_paths_are_found_from_the_profile_never_the_working_directory(tmp_path, monkeypatch):
    """Next to the profile first; for a profile in a config/ folder, in the folder above it (the
    package: source tree or install share); the working directory plays no part."""
    pkg = tmp_path / "pkg"
    (pkg / "config").mkdir(parents=True)
    (pkg / "checkpoints" / "c").mkdir(parents=True)
    (pkg / "config" / "near").mkdir()
    d = _sim()
    d["engine"]["checkpoint"] = "checkpoints/c"
    d["cache"] = {"enabled": False, "repository": "near"}
    (pkg / "config" / "p.yaml").write_text(yaml.safe_dump(d))
    monkeypatch.chdir(tmp_path)
    p = load_profile("pkg/config/p.yaml")
    assert p.engine.checkpoint == str(pkg / "checkpoints" / "c")       # the package's
    assert p.cache.repository == str(pkg / "config" / "near")           # next to the profile
    d["engine"]["checkpoint"] = "missing"
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(d))
    assert load_profile(tmp_path / "q.yaml").engine.checkpoint == str(tmp_path / "missing")   # named, not found
    d["engine"]["checkpoint"] = str(tmp_path / "abs")
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(d))
    assert load_profile(tmp_path / "q.yaml").engine.checkpoint == str(tmp_path / "abs")


def test_stock_profiles_start_where_they_run():
    """No stock profile insists on CUDA or on an architecture the checkpoint must be; the ALOHA
    profile's bundled checkpoint is found from the profile and fits it (cameras, 14 joints)."""
    from vla_runtime.nodes.profile import EngineSpec
    from vla_runtime.nodes.stages import load_policy

    for name in ("aloha", "franka", "sim"):
        e = load_profile(CONFIG / f"{name}.yaml").engine
        assert e.device in ("auto", "cpu") and e.preset is None, (name, e)
    aloha = load_profile(CONFIG / "aloha.yaml")
    policy = load_policy(aloha.engine.checkpoint, EngineSpec(device="cpu", share_weights=False),
                         [c.name for c in aloha.cameras], aloha.state_dim)
    assert policy.state_dim == 14


def _controller_joints(profile) -> dict[str, dict[str, list[str]]]:
    """The controllers a profile documents (``controllers:``): command topic -> what it accepts."""
    cfg = yaml.safe_load(Path(profile.controllers).read_text())
    out = {}
    if "controller_manager" in cfg:      # ros2_control
        types = cfg["controller_manager"]["ros__parameters"]
        for name, spec in types.items():
            if isinstance(spec, dict):
                joints = cfg[name]["ros__parameters"]["joints"]
                kind = spec["type"].split("/")[0]
                topic = {"joint_trajectory_controller": "joint_trajectory",
                         "forward_command_controller": "commands"}[kind]
                out[f"/{name}/{topic}"] = {"kind": kind, "joints": joints}
    else:                                # Interbotix: robot -> groups and singles
        for robot, spec in cfg.items():
            for group, joints in spec["groups"].items():
                out[f"/{robot}/commands/joint_group"] = {"kind": "group", "name": group, "joints": joints}
            out[f"/{robot}/commands/joint_single"] = {"kind": "single", "names": spec["singles"]}
    return out


@pytest.mark.parametrize("name", ["aloha", "franka", "sim"])
def test_every_output_carries_exactly_what_its_controller_owns(name):
    """Each stock profile's outputs against the controller configuration it documents: a
    trajectory topic carries exactly its controller's joints (joint_trajectory_controller refuses
    any other), a gripper its finger joints, an Interbotix group as many values as its joints."""
    import numpy as np

    from vla_runtime.nodes.adapters import gripper_positions, group_commands, single_commands, trajectory_parts

    p = load_profile(CONFIG / f"{name}.yaml")
    ctl = _controller_joints(p)
    o = p.output
    actions = np.linspace(p.joint_lower, p.joint_upper, 5)
    sent = set()
    if o.kind == "joint_trajectory":
        for i, joints, positions in trajectory_parts(o, p.joint_names, actions):
            c = ctl[o.topics[i]]
            assert c["kind"] == "joint_trajectory_controller" and sorted(joints) == sorted(c["joints"]), (joints, c)
            assert positions.shape == (5, len(joints))
            sent.update(joints)
        if o.gripper_kind:
            c = ctl[o.gripper_topic]
            want = {"joint_trajectory": "joint_trajectory_controller", "float64_array": "forward_command_controller"}
            assert c["kind"] == want[o.gripper_kind] and list(o.gripper_joint_names) == c["joints"], c
            fingers = gripper_positions(o, actions)
            assert np.allclose(fingers, actions[:, [o.gripper_joint]] * o.gripper_scale) and fingers.shape[1] == 2
            sent.add(p.joint_names[o.gripper_joint])
    else:
        for cmd in group_commands(o, actions[0]):
            c = ctl[o.topics[cmd.topic_index]]
            assert cmd.name == c["name"] and len(cmd.values) == len(c["joints"])
            a, b = o.joint_slices[cmd.topic_index]
            names = p.joint_names[a:b]
            assert all(n.endswith(j) for n, j in zip(names, c["joints"])), (names, c["joints"])
            sent.update(names)
        for cmd in single_commands(o, actions[0]):
            assert cmd.name in ctl[o.single_topics[cmd.topic_index]]["names"]
            sent.add(p.joint_names[o.single_joints[cmd.topic_index]])
    assert sent == set(p.joint_names)     # every joint the policy acts on reaches a controller


def test_franka_sends_the_arm_its_7_joints_and_the_gripper_its_fingers():
    p = load_profile(CONFIG / "franka.yaml")
    assert p.output.joint_slices == ((0, 7),) and p.output.gripper_joint == 7
    assert p.joint_upper[7] * p.output.gripper_scale == pytest.approx(0.04)   # each finger at most 4 cm
    d = yaml.safe_load((CONFIG / "franka.yaml").read_text())
    d["output"]["joint_slices"] = [[0, 8]]
    with pytest.raises(ProfileError, match="the gripper joint 7 also goes to an arm topic"):
        profile_from_dict(d, "franka")
    d["output"].update(joint_slices=[[0, 7]], gripper_kind="effort")
    with pytest.raises(ProfileError, match="output.gripper_kind"):
        profile_from_dict(d, "franka")
