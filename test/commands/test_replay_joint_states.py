"""``vla-runtime replay`` assembles joint states by name from every joint-state topic of the
profile, as the policy node does: a recording that splits the joints over topics, in its own
order, replays to the same chunks as the committed golden (recorded on one topic in profile
order), and one that lacks a profile joint is refused with the joint's name.

The variants are made from the committed episode by rewriting only its ``/joint_states``
messages (images and instruction are copied byte for byte), so any change in the chunks can
only come from the state.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from rosbags.rosbag2 import Reader, Writer
from rosbags.typesys import Stores, get_typestore
from safetensors.torch import load_file

from vla_runtime.cli import main
from vla_runtime.io.bags import BAG_FORMAT_VERSION, JOINT_STATE_TYPE
from vla_runtime.nodes.profile import load_profile
from vla_runtime.commands.replay import camera_type_warnings, read_action_chunks

DATA = Path(__file__).resolve().parents[1] / "data" / "replay"
PROFILE = DATA.parents[2] / "config" / "sim.yaml"
EPISODE = DATA / "episode"
GOLDEN = DATA / "golden"

ARM, GRIPPER = "/arm/joint_states", "/gripper/joint_states"
# sim.yaml's joints, split like a robot with a separate gripper driver, arm joints shuffled.
SPLIT = {ARM: ["joint_3", "joint_0", "joint_5", "joint_1", "joint_4", "joint_2"], GRIPPER: ["gripper"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint the golden was made with (see ``test_replay.py``)."""
    spec = importlib.util.spec_from_file_location("replay_make_golden", DATA / "make_golden.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    ckpt = recipe.build_checkpoint(tmp_path_factory.mktemp("demo"))
    expected = json.loads((DATA / "golden.json").read_text())["checkpoint_digest"]
    assert recipe.checkpoint_digest(ckpt) == expected, "demo recipe changed: see test_replay.py"
    return ckpt


def split_joint_states(src: Path, dst: Path, layout: dict[str, list[str]]) -> None:
    """Copy bag ``src`` to ``dst``, replacing each ``/joint_states`` message by one message per
    topic of ``layout`` with those joints, in that order, at the same log time."""
    store = get_typestore(Stores.ROS2_JAZZY)
    with Reader(src) as reader, Writer(dst, version=BAG_FORMAT_VERSION) as writer:
        out = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store)
               for c in reader.connections if c.topic != "/joint_states"}
        joints = {topic: writer.add_connection(topic, JOINT_STATE_TYPE, typestore=store) for topic in layout}
        for conn, ns, raw in reader.messages():
            if conn.topic != "/joint_states":
                writer.write(out[conn.id], ns, raw)
                continue
            msg = store.deserialize_cdr(raw, JOINT_STATE_TYPE)
            position = dict(zip(msg.name, msg.position))
            for topic, names in layout.items():
                part = store.types[JOINT_STATE_TYPE](
                    header=msg.header, name=list(names), position=np.array([position[n] for n in names]),
                    velocity=np.zeros(0), effort=np.zeros(0))
                writer.write(joints[topic], ns, store.serialize_cdr(part, JOINT_STATE_TYPE))


def _split_profile(tmp_path: Path) -> Path:
    data = yaml.safe_load(PROFILE.read_text())
    data["joint_states_topics"] = [ARM, GRIPPER]
    path = tmp_path / "split_profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _replay(bag: Path, out: Path, profile: Path, checkpoint: Path, *extra: str) -> int:
    return main(["replay", str(bag), "--out", str(out), "--profile", str(profile), "--checkpoint", str(checkpoint),
                 *extra])


def test_joints_split_over_two_topics_in_any_order_replay_to_the_golden_chunks(tmp_path: Path, checkpoint: Path,
                                                                               capsys):
    split = tmp_path / "split"
    split_joint_states(EPISODE, split, SPLIT)
    profile = _split_profile(tmp_path)
    rc = _replay(split, tmp_path / "out_split", profile, checkpoint, "--golden", str(GOLDEN), "--tolerance", "1e-5")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["drift"] is False
    # Not just within tolerance: the same state vector, so the same chunks as the one-topic bag.
    assert _replay(EPISODE, tmp_path / "out_one", PROFILE, checkpoint) == 0
    one, two = read_action_chunks(tmp_path / "out_one"), read_action_chunks(tmp_path / "out_split")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a.stamp_ns == b.stamp_ns
        np.testing.assert_array_equal(a.actions, b.actions)


def test_a_profile_joint_missing_from_the_bag_is_refused_by_name(tmp_path: Path, checkpoint: Path, capsys):
    bag = tmp_path / "no_gripper"
    split_joint_states(EPISODE, bag, {ARM: ["joint_0", "joint_1", "joint_2", "joint_3"], GRIPPER: ["joint_5", "joint_4"]})
    rc = _replay(bag, tmp_path / "out", _split_profile(tmp_path), checkpoint)
    err = capsys.readouterr().err
    assert rc == 2
    assert (f"joint(s) ['gripper'] of the joint names never appear on the joint-state topic(s) ['{ARM}', "
            f"'{GRIPPER}']") in err
    assert not (tmp_path / "out").exists()


def test_camera_message_type_differing_from_the_profile_is_warned(tmp_path: Path):
    """The committed bag has CompressedImage cameras; sim.yaml declares raw Image. Replay reads
    either, but the live vision node would not receive them: replay says so."""
    warnings = camera_type_warnings(EPISODE, load_profile(PROFILE))
    assert len(warnings) == 2
    assert warnings[0].startswith("camera 'top': the bag carries sensor_msgs/msg/CompressedImage on "
                                  "/cameras/top/image_raw, the profile declares sensor_msgs/msg/Image")
    data = yaml.safe_load(PROFILE.read_text())
    for cam in data["cameras"].values():
        cam["compressed"] = True
    compressed = tmp_path / "compressed.yaml"
    compressed.write_text(yaml.safe_dump(data))
    assert camera_type_warnings(EPISODE, load_profile(compressed)) == []


def test_build_cache_with_a_robot_profile_assembles_the_state_by_name(tmp_path: Path, checkpoint: Path, capsys):
    """The repository built from the split recording with ``--robot-profile`` stores the same
    states (and history) as the one built from the one-topic recording with explicit topics."""
    split = tmp_path / "split"
    split_joint_states(EPISODE, split, SPLIT)
    cams = [f"--camera={c.name}={c.topic}" for c in load_profile(PROFILE).cameras]
    common = ["--checkpoint", str(checkpoint), "--outcome-topic", ""]
    assert main(["build-cache", "--bags", str(EPISODE), "--out", str(tmp_path / "one"), *common, *cams]) == 0
    assert main(["build-cache", "--bags", str(split), "--out", str(tmp_path / "two"), *common,
                 "--robot-profile", str(_split_profile(tmp_path))]) == 0
    one, two = (sorted((tmp_path / r).rglob("episodes/*.safetensors")) for r in ("one", "two"))
    assert len(one) == len(two) == 1
    a, b = load_file(one[0]), load_file(two[0])
    assert a["state"].shape[0] >= 2
    for key in ("state", "state_history"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    # Without the profile the split recording has no /joint_states: refused, nothing half-built.
    capsys.readouterr()
    assert main(["build-cache", "--bags", str(split), "--out", str(tmp_path / "three"), *common, *cams]) == 2
    assert not (tmp_path / "three").exists()
    # The profile names the topics: explicit topic flags alongside it are refused.
    assert main(["build-cache", "--bags", str(split), "--out", str(tmp_path / "four"), *common, *cams,
                 "--robot-profile", str(PROFILE)]) == 2
    assert "--robot-profile names the topics; drop --camera" in capsys.readouterr().err
