"""rosbag2 episodes: write/read round trips, causal call sampling, clear errors."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from rosbags.rosbag2 import Reader, Writer
from rosbags.typesys import Stores, get_typestore

from vla_runtime.io.bags import (
    DEFAULT_START_TIME_NS,
    BagTopics,
    Episode,
    EpisodeFrame,
    list_episode_bags,
    read_episode,
    write_episode_bag,
)

TOPICS = BagTopics(cameras={"top": "/cam/top/image", "wrist": "/cam/wrist/image"})


def _image(h: int, w: int, k: int, channel_shift: int = 0) -> np.ndarray:
    """Smooth, colourful, frame-dependent image (smooth so JPEG stays close)."""
    yy, xx = np.mgrid[0:h, 0:w]
    r = xx * 200 // max(1, w - 1) + 5 * k % 50
    g = yy * 150 // max(1, h - 1) + channel_shift
    b = np.full_like(r, 40 + 13 * k % 200)
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def _episode(n: int = 8, dt: float = 0.1, success: bool | None = True, task: str = "stack the cups") -> Episode:
    frames = [EpisodeFrame(t=k * dt, images={"top": _image(24, 32, k), "wrist": _image(16, 16, k, 90)},
                           state=np.arange(7, dtype=np.float32) * 0.1 + k) for k in range(n)]
    return Episode(episode_id="ep", task=task, success=success, frames=frames, source="test")


# Raw bag writing, for bags the episode writer would never produce (multi-rate, broken).
_TS = get_typestore(Stores.ROS2_JAZZY)


def _header(ns: int):
    return _TS.types["std_msgs/msg/Header"](
        stamp=_TS.types["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9), frame_id="")


def _raw_image(ns: int, value: int, encoding: str = "rgb8"):
    data = np.full((6, 8, 3), value, dtype=np.uint8)
    return _TS.types["sensor_msgs/msg/Image"](header=_header(ns), height=6, width=8, encoding=encoding,
                                              is_bigendian=0, step=24, data=data.reshape(-1))


def _joint_state(ns: int, position: list[float], names: list[str] | None = None):
    names = [f"j{i}" for i in range(len(position))] if names is None else names
    return _TS.types["sensor_msgs/msg/JointState"](
        header=_header(ns), name=names, position=np.asarray(position, float), velocity=np.zeros(0), effort=np.zeros(0))


def _string(text: str):
    return _TS.types["std_msgs/msg/String"](data=text)


def _write_raw_bag(path: Path, messages: list[tuple[str, str, int, object]],
                   extra_topics: dict[str, str] | None = None) -> None:
    """messages: (topic, msgtype, ns, msg); extra_topics: topics registered without messages."""
    with Writer(path, version=9) as writer:
        conns = {}
        for topic, msgtype, _, _ in messages:
            if topic not in conns:
                conns[topic] = writer.add_connection(topic, msgtype, typestore=_TS)
        for topic, msgtype in (extra_topics or {}).items():
            conns[topic] = writer.add_connection(topic, msgtype, typestore=_TS)
        for topic, msgtype, ns, msg in sorted(messages, key=lambda m: m[2]):
            writer.write(conns[topic], ns, _TS.serialize_cdr(msg, msgtype))


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
@pytest.mark.parametrize("compressed,image_format", [(False, "rgb8"), (False, "bgr8"), (True, "png"), (True, "jpeg")])
def test_round_trip(tmp_path: Path, storage: str, compressed: bool, image_format: str):
    ep = _episode()
    bag = tmp_path / "bag"
    write_episode_bag(bag, ep, TOPICS, compressed=compressed, storage=storage, image_format=image_format)
    assert (bag / "metadata.yaml").is_file()

    back = read_episode(bag, TOPICS, call_period=0.1, state_dim=7)
    assert (back.task, back.success, back.episode_id, back.source) == (ep.task, True, "bag", str(bag))
    assert len(back.frames) == len(ep.frames)
    for a, b in zip(ep.frames, back.frames):
        assert b.t == pytest.approx(a.t, abs=1e-9)
        assert b.state.dtype == np.float32 and np.array_equal(a.state, b.state)
        assert b.instruction is None
        for cam in ("top", "wrist"):
            img = b.images[cam]
            assert img.dtype == np.uint8 and img.shape == a.images[cam].shape
            if image_format == "jpeg":  # lossy, but the content (and channel order) survives
                assert np.abs(img.astype(int) - a.images[cam]).mean() < 10
                assert np.abs(img[..., ::-1].astype(int) - a.images[cam]).mean() > 30
            else:
                assert np.array_equal(img, a.images[cam])


def test_mono8_is_expanded_to_rgb(tmp_path: Path):
    ep = _episode(n=2)
    write_episode_bag(tmp_path / "bag", ep, TOPICS, image_format="mono8")
    back = read_episode(tmp_path / "bag", TOPICS, call_period=0.1)
    img = back.frames[1].images["top"]
    gray = cv2.cvtColor(ep.frames[1].images["top"], cv2.COLOR_RGB2GRAY)
    assert img.shape == (24, 32, 3)
    assert all(np.array_equal(img[..., c], gray) for c in range(3))


def test_calls_use_latest_past_messages_only(tmp_path: Path):
    """Cameras at 10 and 15 Hz, joints at 100 Hz, each message's payload encodes its stamp:
    every call must see exactly the newest message at or before the call time."""
    t0 = DEFAULT_START_TIME_NS
    ms = 10**6
    msgs: list[tuple[str, str, int, object]] = [("/instruction", "std_msgs/msg/String", t0, _string("wipe"))]
    top_times = [t0 + 5 * ms + k * 100 * ms for k in range(12)]
    wrist_times = [t0 + 13 * ms + k * 67 * ms for k in range(18)]
    joint_times = [t0 + 2 * ms + k * 10 * ms for k in range(120)]
    msgs += [("/cam/top/image", "sensor_msgs/msg/Image", ns, _raw_image(ns, k)) for k, ns in enumerate(top_times)]
    msgs += [("/cam/wrist/image", "sensor_msgs/msg/Image", ns, _raw_image(ns, k, "bgr8"))
             for k, ns in enumerate(wrist_times)]
    msgs += [("/joint_states", "sensor_msgs/msg/JointState", ns, _joint_state(ns, [(ns - t0) / 1e9, 1.0]))
             for ns in joint_times]
    _write_raw_bag(tmp_path / "bag", msgs)

    ep = read_episode(tmp_path / "bag", TOPICS, call_period=0.04)
    first_ready = max(top_times[0], wrist_times[0], joint_times[0])
    assert ep.frames[0].t == pytest.approx((first_ready - t0) / 1e9)
    gaps = np.diff([f.t for f in ep.frames])
    assert np.allclose(gaps, 0.04, atol=1e-9)
    last_data = max(top_times[-1], wrist_times[-1], joint_times[-1])
    assert ep.frames[-1].t <= (last_data - t0) / 1e9 < ep.frames[-1].t + 0.04
    for f in ep.frames:
        call = t0 + round(f.t * 1e9)
        expect_top = max(k for k, ns in enumerate(top_times) if ns <= call)
        expect_wrist = max(k for k, ns in enumerate(wrist_times) if ns <= call)
        expect_joint = max(ns for ns in joint_times if ns <= call)
        assert f.images["top"][0, 0, 0] == expect_top
        assert f.images["wrist"][0, 0, 0] == expect_wrist
        assert f.state[0] == pytest.approx((expect_joint - t0) / 1e9, abs=1e-6)
        assert f.state[0] <= f.t + 1e-6  # never a future message


def test_call_period_subsamples_frames(tmp_path: Path):
    ep = _episode(n=10, dt=0.1)
    write_episode_bag(tmp_path / "bag", ep, TOPICS, storage="mcap")
    back = read_episode(tmp_path / "bag", TOPICS, call_period=0.25)
    assert [round(f.t, 6) for f in back.frames] == [0.0, 0.25, 0.5, 0.75]
    # Call at 0.25 s sees the frame written at 0.2 s, never the one at 0.3 s.
    assert [f.state[0] for f in back.frames] == [0.0, 2.0, 5.0, 7.0]
    assert np.array_equal(back.frames[1].images["top"], ep.frames[2].images["top"])


def test_instruction_changes_and_repeats(tmp_path: Path):
    ep = _episode(n=6)
    for f in ep.frames[3:]:
        f.instruction = "now fold the towel"
    write_episode_bag(tmp_path / "bag", ep, TOPICS, instruction_period=0.05)
    back = read_episode(tmp_path / "bag", TOPICS, call_period=0.1)
    assert back.task == "stack the cups"
    assert [f.instruction for f in back.frames] == [None] * 3 + ["now fold the towel"] * 3
    assert back.instruction_at(0) == "stack the cups" and back.instruction_at(4) == "now fold the towel"


@pytest.mark.parametrize("success", [True, False, None])
def test_outcome(tmp_path: Path, success: bool | None):
    write_episode_bag(tmp_path / "bag", _episode(n=3, success=success), TOPICS)
    assert read_episode(tmp_path / "bag", TOPICS, call_period=0.1).success is success


def test_outcome_topic_optional_and_strict(tmp_path: Path):
    write_episode_bag(tmp_path / "a", _episode(n=3, success=None), BagTopics(cameras=TOPICS.cameras, outcome=None))
    assert read_episode(tmp_path / "a", TOPICS, call_period=0.1).success is None

    msgs = [("/cam/top/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/joint_states", "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0])),
            ("/instruction", "std_msgs/msg/String", 10, _string("go")),
            ("/episode_outcome", "std_msgs/msg/String", 20, _string("Success\n"))]
    _write_raw_bag(tmp_path / "b", msgs)
    assert read_episode(tmp_path / "b", TOPICS, call_period=0.1).success is True
    msgs[-1] = ("/episode_outcome", "std_msgs/msg/String", 20, _string("maybe"))
    _write_raw_bag(tmp_path / "c", msgs)
    with pytest.raises(ValueError, match="'maybe'.*neither 'success' nor 'failure'"):
        read_episode(tmp_path / "c", TOPICS, call_period=0.1)


def test_missing_topic_lists_available_topics(tmp_path: Path):
    write_episode_bag(tmp_path / "bag", _episode(n=2), TOPICS)
    wrong = BagTopics(cameras={"top": "/cam/top/image", "wrist": "/wrist_cam/compressed"})
    with pytest.raises(ValueError) as err:
        read_episode(tmp_path / "bag", wrong, call_period=0.1)
    text = str(err.value)
    assert "/wrist_cam/compressed" in text
    for topic in ("/cam/top/image (sensor_msgs/msg/Image)", "/cam/wrist/image", "/joint_states", "/instruction"):
        assert topic in text


def test_no_instruction(tmp_path: Path):
    msgs = [("/cam/top/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/joint_states", "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0]))]
    _write_raw_bag(tmp_path / "bag", msgs, extra_topics={"/instruction": "std_msgs/msg/String"})
    with pytest.raises(ValueError, match="no instruction"):
        read_episode(tmp_path / "bag", TOPICS, call_period=0.1)


def test_state_dimension_mismatch(tmp_path: Path):
    write_episode_bag(tmp_path / "bag", _episode(n=2), TOPICS)
    with pytest.raises(ValueError, match="state dimension mismatch.*7 positions, expected 5"):
        read_episode(tmp_path / "bag", TOPICS, call_period=0.1, state_dim=5)

    msgs = [("/cam/top/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/instruction", "std_msgs/msg/String", 10, _string("go")),
            ("/joint_states", "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0, 1.0])),
            ("/joint_states", "sensor_msgs/msg/JointState", 10**8, _joint_state(10**8, [0.0, 1.0, 2.0])),
            ("/cam/top/image", "sensor_msgs/msg/Image", 2 * 10**8, _raw_image(2 * 10**8, 1))]
    _write_raw_bag(tmp_path / "varying", msgs)
    with pytest.raises(ValueError, match="3 positions, expected 2"):
        read_episode(tmp_path / "varying", TOPICS, call_period=0.05)


def test_undecodable_images(tmp_path: Path):
    junk = _TS.types["sensor_msgs/msg/CompressedImage"](header=_header(10), format="jpeg",
                                                        data=np.frombuffer(b"not a jpeg at all", np.uint8))
    base = [("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/joint_states", "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0])),
            ("/instruction", "std_msgs/msg/String", 10, _string("go"))]
    _write_raw_bag(tmp_path / "a", base + [("/cam/top/image", "sensor_msgs/msg/CompressedImage", 10, junk)])
    with pytest.raises(ValueError, match=r"image on /cam/top/image at t=0\.000s refused: camera 'top': could not decode"):
        read_episode(tmp_path / "a", TOPICS, call_period=0.1)

    bayer = _raw_image(10, 1, encoding="bayer_rggb8")
    _write_raw_bag(tmp_path / "b", base + [("/cam/top/image", "sensor_msgs/msg/Image", 10, bayer)])
    with pytest.raises(ValueError, match="unsupported Image encoding 'bayer_rggb8'"):
        read_episode(tmp_path / "b", TOPICS, call_period=0.1)


def test_wrong_topic_type_and_bad_arguments(tmp_path: Path):
    write_episode_bag(tmp_path / "bag", _episode(n=2), TOPICS)
    swapped = BagTopics(cameras={"top": "/cam/top/image", "wrist": "/joint_states"}, joint_states="/cam/wrist/image")
    with pytest.raises(ValueError, match="/cam/wrist/image carries .*Image.*expected one of .*JointState"):
        read_episode(tmp_path / "bag", swapped, call_period=0.1)
    with pytest.raises(ValueError, match="call_period"):
        read_episode(tmp_path / "bag", TOPICS, call_period=0)
    with pytest.raises(FileNotFoundError):
        read_episode(tmp_path / "nope", TOPICS, call_period=0.1)
    with pytest.raises(FileExistsError):
        write_episode_bag(tmp_path / "bag", _episode(n=2), TOPICS)
    with pytest.raises(ValueError, match="do not match"):
        write_episode_bag(tmp_path / "other", _episode(n=2), BagTopics(cameras={"top": "/a"}))
    with pytest.raises(ValueError, match="more than once"):
        BagTopics(cameras={"top": "/x", "wrist": "/x"})


def test_episode_validation():
    frame = EpisodeFrame(t=0.0, images={"top": _image(4, 4, 0)}, state=[1, 2])
    assert frame.state.dtype == np.float32
    with pytest.raises(ValueError, match="uint8"):
        EpisodeFrame(t=0.0, images={"top": np.zeros((4, 4, 3), np.float32)}, state=[1])
    with pytest.raises(ValueError, match="increase"):
        Episode("e", "task", None, [frame, EpisodeFrame(t=0.0, images=frame.images, state=[1, 2])])
    with pytest.raises(ValueError, match="state dim"):
        Episode("e", "task", None, [frame, EpisodeFrame(t=0.1, images=frame.images, state=[1, 2, 3])])


def test_list_episode_bags(tmp_path: Path):
    for name in ("day1/b", "day1/a", "day2/c"):
        write_episode_bag(tmp_path / name, _episode(n=2), TOPICS, storage="mcap" if name.endswith("c") else "sqlite3")
    bags = list_episode_bags(tmp_path)
    assert bags == [tmp_path / "day1/a", tmp_path / "day1/b", tmp_path / "day2/c"]
    assert list_episode_bags(tmp_path / "day1/a") == [tmp_path / "day1/a"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no rosbag2 bags"):
        list_episode_bags(tmp_path / "empty")


def test_synthetic_episode_through_a_bag(tmp_path: Path):
    from vla_runtime.sim.scenes import SceneConfig, make_episode

    ep = make_episode(SceneConfig(image_size=64, steps_per_episode=30), episode_seed=3)
    write_episode_bag(tmp_path / "bag", ep, BagTopics(cameras={"top": "/top", "wrist": "/wrist"}))
    back = read_episode(tmp_path / "bag", BagTopics(cameras={"top": "/top", "wrist": "/wrist"}),
                        call_period=1 / 30, state_dim=7)
    assert len(back.frames) == 30 and back.task == ep.task and back.success is True
    assert all(np.array_equal(a.images["wrist"], b.images["wrist"]) and np.array_equal(a.state, b.state)
               for a, b in zip(ep.frames, back.frames))


# ---------------------------------------------------------------------------------------------
# Joint states by name (robot profiles): the policy node's JointStateAssembler on recorded bags

ARM_JOINTS = ("left_a", "left_b", "left_grip", "right_a", "right_b", "right_grip", "base")   # model order
ARMS = ("/left/joint_states", "/right/joint_states")
BY_NAME = BagTopics(cameras=TOPICS.cameras, joint_states=ARMS, joint_names=ARM_JOINTS)
# How a bimanual robot might publish them: one topic per arm, driver order, not model order.
SPLIT_SHUFFLED = {ARMS[0]: ["left_grip", "base", "left_a", "left_b"], ARMS[1]: ["right_b", "right_grip", "right_a"]}


def _states(ep: Episode) -> np.ndarray:
    return np.stack([f.state for f in ep.frames])


def test_joint_states_on_two_topics_in_shuffled_order_assemble_to_profile_order(tmp_path: Path):
    ep = _episode(n=6)
    one_topic = BagTopics(cameras=TOPICS.cameras, joint_names=ARM_JOINTS)
    write_episode_bag(tmp_path / "profile_order", ep, one_topic)
    write_episode_bag(tmp_path / "split", ep, BY_NAME, joint_layout=SPLIT_SHUFFLED)
    with Reader(tmp_path / "split") as reader:   # the bag really is split and shuffled
        first = {c.topic: _TS.deserialize_cdr(raw, c.msgtype) for c, _, raw in reader.messages()
                 if c.topic in ARMS}
    assert {t: list(m.name) for t, m in first.items()} == SPLIT_SHUFFLED
    assert list(first[ARMS[1]].position) == pytest.approx([ep.frames[-1].state[i] for i in (4, 5, 3)])

    reference = read_episode(tmp_path / "profile_order", one_topic, call_period=0.1, state_dim=7)
    split = read_episode(tmp_path / "split", BY_NAME, call_period=0.1, state_dim=7)
    assert np.array_equal(_states(split), _states(ep)) and np.array_equal(_states(reference), _states(ep))
    assert [f.t for f in split.frames] == [f.t for f in reference.frames]
    assert all(np.array_equal(a.images["top"], b.images["top"]) for a, b in zip(split.frames, reference.frames))


def test_without_joint_names_a_single_topic_is_read_in_message_order(tmp_path: Path):
    """No profile (build-cache from the command line): positions as published, as before."""
    ep = _episode(n=3)
    shuffled = {"/joint_states": list(reversed(ARM_JOINTS))}
    write_episode_bag(tmp_path / "bag", ep, TOPICS, joint_names=ARM_JOINTS, joint_layout=shuffled)
    as_published = read_episode(tmp_path / "bag", TOPICS, call_period=0.1)
    assert np.array_equal(_states(as_published), _states(ep)[:, ::-1])
    by_name = read_episode(tmp_path / "bag", BagTopics(cameras=TOPICS.cameras, joint_names=ARM_JOINTS),
                           call_period=0.1)
    assert np.array_equal(_states(by_name), _states(ep))


def test_each_joint_takes_the_newest_value_any_topic_published(tmp_path: Path):
    """Arms at different rates and phases: every call sees, per joint, the newest message at
    or before the call time; calls start once every named joint has a value."""
    t0 = DEFAULT_START_TIME_NS
    ms = 10**6
    left_times = [t0 + k * 20 * ms for k in range(30)]
    right_times = [t0 + 35 * ms + k * 50 * ms for k in range(12)]
    msgs: list[tuple[str, str, int, object]] = [("/instruction", "std_msgs/msg/String", t0, _string("wipe"))]
    msgs += [(cam, "sensor_msgs/msg/Image", t0 + k * 100 * ms, _raw_image(t0 + k * 100 * ms, k))
             for cam in TOPICS.cameras.values() for k in range(6)]
    msgs += [(ARMS[0], "sensor_msgs/msg/JointState", ns, _joint_state(ns, [k, -k, 0.5, 9.0], ["left_b", "left_a",
                                                                                            "left_grip", "base"]))
             for k, ns in enumerate(left_times)]
    msgs += [(ARMS[1], "sensor_msgs/msg/JointState", ns, _joint_state(ns, [100 + k, 0.25, 200 + k, 1.0],
                                                                      ["right_a", "right_grip", "right_b", "other"]))
             for k, ns in enumerate(right_times)]
    _write_raw_bag(tmp_path / "bag", msgs)

    ep = read_episode(tmp_path / "bag", BY_NAME, call_period=0.03)
    assert ep.frames[0].t == pytest.approx(0.035)   # the right arm's first message completes the state
    for f in ep.frames:
        call = t0 + round(f.t * 1e9)
        k_left = max(k for k, ns in enumerate(left_times) if ns <= call)
        k_right = max(k for k, ns in enumerate(right_times) if ns <= call)
        expected = [-k_left, k_left, 0.5, 100 + k_right, 200 + k_right, 0.25, 9.0]
        assert f.state.tolist() == pytest.approx(expected)


def test_a_profile_joint_missing_from_the_bag_is_named(tmp_path: Path):
    layout = {ARMS[0]: SPLIT_SHUFFLED[ARMS[0]], ARMS[1]: ["right_b", "right_a"]}   # no right_grip
    write_episode_bag(tmp_path / "missing", _episode(n=3), BY_NAME, joint_layout=layout)
    with pytest.raises(ValueError, match=r"joint\(s\) \['right_grip'\] of the joint names never appear on the "
                                         r"joint-state topic\(s\) \['/left/joint_states', '/right/joint_states'\]"):
        read_episode(tmp_path / "missing", BY_NAME, call_period=0.1)

    # A renamed joint: the names the bag has instead are listed, that is usually the fix.
    renamed = [n.replace("right_grip", "right_gripper") for n in ARM_JOINTS]
    write_episode_bag(tmp_path / "renamed", _episode(n=3), BY_NAME, joint_names=renamed,
                      joint_layout={ARMS[0]: ["left_a", "left_b", "left_grip", "base"],
                                    ARMS[1]: ["right_a", "right_b", "right_gripper"]})
    with pytest.raises(ValueError, match=r"\['right_grip'\] .*not joint names: \['right_gripper'\]"):
        read_episode(tmp_path / "renamed", BY_NAME, call_period=0.1)


@pytest.mark.parametrize("names,position,problem", [
    (["right_a", "right_b", "right_grip"], [0.0, float("nan"), 0.0], r"non-finite positions for \['right_b'\]"),
    (["right_a", "right_b", "right_grip"], [0.0, 1.0], "3 names but 2 positions"),
    (["wheel_l", "wheel_r"], [0.0, 1.0], r"names \['wheel_l', 'wheel_r'\] match none of the profile's joints"),
])
def test_joint_states_the_node_would_refuse_fail_the_read(tmp_path: Path, names, position, problem):
    """Every joint-state message is validated like the node's, even one no call would use."""
    left, right = ["left_a", "left_b", "left_grip", "base"], ["right_a", "right_b", "right_grip"]
    bad_ns = 2 * 10**8 + 10
    msgs = [("/instruction", "std_msgs/msg/String", 10, _string("go")),
            ("/cam/top/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            (ARMS[0], "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0] * 4, left)),
            (ARMS[1], "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0] * 3, right)),
            (ARMS[1], "sensor_msgs/msg/JointState", bad_ns, _joint_state(bad_ns, position, names)),
            (ARMS[1], "sensor_msgs/msg/JointState", bad_ns + 10, _joint_state(bad_ns + 10, [0.0] * 3, right))]
    _write_raw_bag(tmp_path / "bag", msgs)
    with pytest.raises(ValueError, match=rf"joint state on /right/joint_states at t=0\.200s refused: .*{problem}"):
        read_episode(tmp_path / "bag", BY_NAME, call_period=1.0)


def test_joint_topic_and_name_arguments_are_checked(tmp_path: Path):
    assert TOPICS.joint_states == ("/joint_states",)                # one topic is a 1-tuple
    assert BagTopics(cameras=TOPICS.cameras, joint_states=list(ARMS), joint_names=list(ARM_JOINTS)) == BY_NAME
    with pytest.raises(ValueError, match="can only be combined by joint name"):
        BagTopics(cameras=TOPICS.cameras, joint_states=ARMS)
    with pytest.raises(ValueError, match="unique joint names"):
        BagTopics(cameras=TOPICS.cameras, joint_names=("a", "a"))
    with pytest.raises(ValueError, match="more than once"):
        BagTopics(cameras=TOPICS.cameras, joint_states=("/joint_states", "/cam/top/image"), joint_names=ARM_JOINTS)
    with pytest.raises(ValueError, match="at least one topic"):
        BagTopics(cameras=TOPICS.cameras, joint_states=())
    with pytest.raises(ValueError, match="pass joint_layout"):
        write_episode_bag(tmp_path / "a", _episode(n=2), BY_NAME)
    with pytest.raises(ValueError, match=r"unknown: \['elbow'\]"):
        write_episode_bag(tmp_path / "b", _episode(n=2), BY_NAME, joint_layout={ARMS[0]: ["elbow"], ARMS[1]: []})
    write_episode_bag(tmp_path / "c", _episode(n=2), BY_NAME, joint_layout=SPLIT_SHUFFLED)
    with pytest.raises(ValueError, match="state_dim 5 does not match the 7 joint names"):
        read_episode(tmp_path / "c", BY_NAME, call_period=0.1, state_dim=5)
    three_arms = BagTopics(cameras=TOPICS.cameras, joint_states=(*ARMS, "/third/joint_states"), joint_names=ARM_JOINTS)
    with pytest.raises(ValueError, match=r"lacks topic\(s\) \['/third/joint_states'\]"):
        read_episode(tmp_path / "c", three_arms, call_period=0.1)


def test_images_larger_than_the_vision_node_accepts_are_refused(tmp_path: Path):
    wide = _TS.types["sensor_msgs/msg/Image"](header=_header(10), height=1, width=4097, encoding="mono8",
                                              is_bigendian=0, step=4097, data=np.zeros(4097, np.uint8))
    msgs = [("/cam/top/image", "sensor_msgs/msg/Image", 10, wide),
            ("/cam/wrist/image", "sensor_msgs/msg/Image", 10, _raw_image(10, 1)),
            ("/joint_states", "sensor_msgs/msg/JointState", 10, _joint_state(10, [0.0])),
            ("/instruction", "std_msgs/msg/String", 10, _string("go"))]
    _write_raw_bag(tmp_path / "bag", msgs)
    with pytest.raises(ValueError, match="image on /cam/top/image .* refused: camera 'top': image 4097x1 exceeds 4096"):
        read_episode(tmp_path / "bag", TOPICS, call_period=0.1)
