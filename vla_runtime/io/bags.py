"""Recorded robot episodes in rosbag2, read and written without ROS.

An *episode* is one bag recorded on the robot while it performed one task: camera topics
(``sensor_msgs/msg/Image`` or ``sensor_msgs/msg/CompressedImage``), one or more joint-state
topics (``sensor_msgs/msg/JointState``, positions are the policy state; a bimanual robot may
publish one topic per arm), an instruction topic (``std_msgs/msg/String``) and optionally an
outcome topic (``std_msgs/msg/String`` with ``"success"`` / ``"failure"``).

The pure-Python ``rosbags`` package does the bag I/O, so these tools run on a laptop or in CI
without a ROS installation and without starting any middleware.

Reading replays the bag the way the live runtime would have seen it: the policy is "called"
every ``call_period`` seconds and each call sees only the newest message of each topic that had
arrived by then. Time is the bag's receive (log) timestamp, not ``header.stamp``: the log
time is when the message was available to a node on the robot, which is what decides what a
real call could have used. Sensor stamps can lie in the future of the log time (clock skew) or
run out of order, so using them could leak future data into a call.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, Sequence

import cv2
import numpy as np
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from .messages import COMPRESSED_IMAGE_TYPE, IMAGE_TYPE, JointStateAssembler, image_from_msg

JOINT_STATE_TYPE = "sensor_msgs/msg/JointState"
STRING_TYPE = "std_msgs/msg/String"

#: rosbag2 metadata version written by ROS 2 Jazzy; rosbags needs it stated explicitly.
BAG_FORMAT_VERSION: Literal[9] = 9

#: Default wall-clock origin of written bags (2023-11-14T22:13:20Z): any fixed, plausible epoch
#: time works; fixing it keeps written bags byte-for-byte reproducible.
DEFAULT_START_TIME_NS = 1_700_000_000 * 10**9

_STORAGES: dict[str, StoragePlugin] = {"sqlite3": StoragePlugin.SQLITE3, "mcap": StoragePlugin.MCAP}
_RAW_ENCODINGS = ("rgb8", "bgr8", "mono8")
_COMPRESSED_FORMATS = ("jpeg", "png")
_OUTCOME_VALUES = {"success": True, "failure": False}

ImageFormat = Literal["rgb8", "bgr8", "mono8", "jpeg", "png"]
Storage = Literal["sqlite3", "mcap"]


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BagTopics:
    """Which topics of a bag hold which part of an episode.

    ``cameras`` maps the policy's camera name (e.g. ``"top"``) to the topic that carried it, so
    bags recorded with robot-specific topic names map onto the names the policy expects.
    ``outcome=None`` means the bags carry no outcome topic.

    ``joint_states`` is one topic or several (one per arm, say); it is always a tuple after
    construction, a single string is accepted for the common case. ``joint_names`` is the
    model's joint order (a robot profile's ``joint_names``). With it, the state is assembled *by
    name* from every joint-state topic with the live policy node's
    :class:`~vla_runtime.io.messages.JointStateAssembler`, so a replayed or cached call
    sees the vector the node would have built, whatever order or split the robot published
    in, and a bag is refused exactly where the node would refuse a message. Without it (tools
    that have no profile), the positions of the single joint-state topic are the state, in
    message order; several topics then cannot be combined and are refused.
    """

    cameras: dict[str, str]
    joint_states: str | tuple[str, ...] = "/joint_states"
    instruction: str = "/instruction"
    outcome: str | None = "/episode_outcome"
    joint_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cameras, dict) or not self.cameras:
            raise ValueError("BagTopics.cameras must be a non-empty dict of camera name -> topic")
        object.__setattr__(self, "cameras", dict(self.cameras))  # no aliasing of the caller's dict
        for name, topic in self.cameras.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"camera names must be non-empty strings, got {name!r}")
            _check_topic_name(topic, f"camera {name!r}")
        joint_topics = (self.joint_states,) if isinstance(self.joint_states, str) else tuple(self.joint_states)
        if not joint_topics:
            raise ValueError("BagTopics.joint_states needs at least one topic")
        for topic in joint_topics:
            _check_topic_name(topic, "joint_states")
        object.__setattr__(self, "joint_states", joint_topics)
        if self.joint_names is not None:
            names = (self.joint_names,) if isinstance(self.joint_names, str) else tuple(self.joint_names)
            if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise ValueError(f"BagTopics.joint_names must be non-empty, unique joint names, got {list(names)}")
            object.__setattr__(self, "joint_names", names)
        elif len(joint_topics) > 1:
            raise ValueError(f"joint states on several topics {list(joint_topics)} can only be combined by joint "
                             "name: pass joint_names (the model's joint order)")
        _check_topic_name(self.instruction, "instruction")
        if self.outcome is not None:
            _check_topic_name(self.outcome, "outcome")
        used = self.all_topics()
        duplicates = sorted({t for t in used if used.count(t) > 1})
        if duplicates:
            raise ValueError(f"each topic may carry one role only; used more than once: {duplicates}")

    def all_topics(self) -> list[str]:
        """Every topic named here, cameras first."""
        topics = [*self.cameras.values(), *self.joint_states, self.instruction]
        if self.outcome is not None:
            topics.append(self.outcome)
        return topics


class CameraTopic(Protocol):
    name: str
    topic: str


class TopicProfile(Protocol):
    """What :func:`profile_topics` reads off a robot profile (``nodes.profile.RobotProfile``).
    Named here, not imported: ``io`` sits below the nodes and does not depend on them."""

    cameras: Sequence[CameraTopic]
    joint_states_topics: Sequence[str]
    instruction_topic: str
    joint_names: Sequence[str]


def profile_topics(profile: TopicProfile, outcome: str | None = None) -> BagTopics:
    """Bag topics of a robot profile: its cameras in model order, all its joint-state topics with
    its joint names (so the state is assembled by name, as the policy node does), its instruction
    topic, and ``outcome`` (replay needs none; building a repository reads it when recorded)."""
    # a relative profile topic (a namespaced robot's) is looked for as recorded in the root namespace
    def bag(topic: str) -> str:
        return topic if topic.startswith("/") else "/" + topic

    return BagTopics(cameras={c.name: bag(c.topic) for c in profile.cameras},
                     joint_states=tuple(bag(t) for t in profile.joint_states_topics),
                     instruction=bag(profile.instruction_topic), outcome=outcome, joint_names=profile.joint_names)


def _check_topic_name(topic: object, role: str) -> None:
    if not isinstance(topic, str) or not topic.startswith("/") or len(topic) < 2:
        raise ValueError(f"{role} topic must be an absolute topic name like '/camera/image', got {topic!r}")


@dataclass
class EpisodeFrame:
    """What one policy call saw.

    ``t`` is seconds since the start of the episode (the bag's first message).
    ``images`` maps camera name to uint8 ``[H, W, 3]`` RGB. ``state`` is the joint positions as
    float32 ``[D]``. ``instruction`` is set only when the instruction in effect at this call
    differs from :attr:`Episode.task` (the instruction changed mid-episode); ``None`` means
    ``Episode.task``.

    Frames read from a bag may share image arrays with their neighbours when calls are more
    frequent than a camera (the same message was the newest for both): copy before editing
    in place.
    """

    t: float
    images: dict[str, np.ndarray]
    state: np.ndarray
    instruction: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.t, (int, float)) or not math.isfinite(self.t) or self.t < 0:
            raise ValueError(f"EpisodeFrame.t must be a finite number of seconds >= 0, got {self.t!r}")
        self.t = float(self.t)
        if not isinstance(self.images, dict) or not self.images:
            raise ValueError("EpisodeFrame.images must be a non-empty dict of camera name -> image")
        for name, img in self.images.items():
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
                desc = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
                raise ValueError(f"image {name!r} must be a uint8 [H, W, 3] RGB array, got {desc}")
        state = np.asarray(self.state, dtype=np.float32)
        if state.ndim != 1 or state.size == 0:
            raise ValueError(f"EpisodeFrame.state must be a non-empty 1-D array, got shape {state.shape}")
        if not np.all(np.isfinite(state)):
            raise ValueError(f"EpisodeFrame.state has non-finite values: {state}")
        self.state = state
        if self.instruction is not None and not isinstance(self.instruction, str):
            raise ValueError(f"EpisodeFrame.instruction must be a str or None, got {type(self.instruction).__name__}")


@dataclass
class Episode:
    """One recorded (or synthetic) attempt at one task, as the sequence of policy calls.

    ``success`` is ``None`` when the outcome is unknown. ``source`` says where it came from
    (a bag path, ``"sim:..."``) so results can be traced back.
    """

    episode_id: str
    task: str
    success: bool | None
    frames: list[EpisodeFrame]
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.episode_id, str) or not self.episode_id:
            raise ValueError(f"Episode.episode_id must be a non-empty string, got {self.episode_id!r}")
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError(f"episode {self.episode_id!r}: task must be a non-empty instruction, got {self.task!r}")
        if self.success is not None and not isinstance(self.success, (bool, np.bool_)):
            raise ValueError(f"episode {self.episode_id!r}: success must be True, False or None, got {self.success!r}")
        if self.success is not None:
            self.success = bool(self.success)
        if not isinstance(self.frames, list) or not self.frames:
            raise ValueError(f"episode {self.episode_id!r}: frames must be a non-empty list")
        first = self.frames[0]
        if not isinstance(first, EpisodeFrame):
            raise ValueError(f"episode {self.episode_id!r}: frames must be EpisodeFrame, got {type(first).__name__}")
        shapes = {name: img.shape for name, img in first.images.items()}
        dim = first.state.shape[0]
        prev_t = -math.inf
        for i, fr in enumerate(self.frames):
            if not isinstance(fr, EpisodeFrame):
                raise ValueError(f"episode {self.episode_id!r}: frame {i} is a {type(fr).__name__}, not EpisodeFrame")
            if fr.t <= prev_t:
                raise ValueError(f"episode {self.episode_id!r}: frame times must increase; frame {i} has "
                                 f"t={fr.t} after t={prev_t}")
            prev_t = fr.t
            if fr.images.keys() != shapes.keys():
                raise ValueError(f"episode {self.episode_id!r}: frame {i} has cameras {sorted(fr.images)}, "
                                 f"frame 0 has {sorted(shapes)}")
            for name, img in fr.images.items():
                if img.shape != shapes[name]:
                    raise ValueError(f"episode {self.episode_id!r}: camera {name!r} changes shape from "
                                     f"{shapes[name]} to {img.shape} at frame {i}")
            if fr.state.shape[0] != dim:
                raise ValueError(f"episode {self.episode_id!r}: frame {i} has state dim {fr.state.shape[0]}, "
                                 f"frame 0 has {dim}")

    @property
    def cameras(self) -> tuple[str, ...]:
        """Camera names, in the order of the first frame."""
        return tuple(self.frames[0].images)

    @property
    def state_dim(self) -> int:
        return int(self.frames[0].state.shape[0])

    @property
    def duration(self) -> float:
        """Seconds from the first to the last frame."""
        return self.frames[-1].t - self.frames[0].t

    def instruction_at(self, index: int) -> str:
        """The instruction in effect for frame ``index``."""
        instruction = self.frames[index].instruction
        return self.task if instruction is None else instruction


@dataclass(frozen=True)
class JointSeries:
    """A ``JointState`` stream at its own rate, beside the episode's call-rate frames.

    Why: a policy call sees one frame, but it is trained on the *commands* that followed it,
    and a robot publishes those at its control rate, not at the call rate. Recording them as a
    separate topic (positions = the commanded values) keeps the bag what a robot records, and
    lets a trainer recover the chunk of actions after any call from the log times.
    ``t`` is seconds since the episode start (same clock as ``EpisodeFrame.t``).
    """

    t: np.ndarray          # [N] seconds, strictly increasing
    values: np.ndarray     # [N, D] float
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        t = np.asarray(self.t, dtype=np.float64)
        v = np.asarray(self.values, dtype=np.float64)
        if t.ndim != 1 or v.ndim != 2 or v.shape[0] != t.shape[0] or t.size == 0:
            raise ValueError(f"JointSeries needs t [N] and values [N, D], got {t.shape} and {v.shape}")
        if len(self.names) != v.shape[1]:
            raise ValueError(f"JointSeries has {v.shape[1]} columns but {len(self.names)} names")
        if np.any(np.diff(t) <= 0) or t[0] < 0 or not np.all(np.isfinite(v)):
            raise ValueError("JointSeries times must be >= 0 and increasing, values finite")
        object.__setattr__(self, "t", t)
        object.__setattr__(self, "values", v)
        object.__setattr__(self, "names", tuple(self.names))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_episode_bag(
    path: str | Path,
    episode: Episode,
    topics: BagTopics,
    compressed: bool = False,
    storage: Storage = "sqlite3",
    *,
    image_format: ImageFormat | None = None,
    jpeg_quality: int = 90,
    joint_names: Sequence[str] | None = None,
    joint_layout: Mapping[str, Sequence[str]] | None = None,
    instruction_period: float | None = None,
    start_time_ns: int = DEFAULT_START_TIME_NS,
    series: Mapping[str, JointSeries] | None = None,
) -> None:
    """Write ``episode`` as a rosbag2 bag directory at ``path`` (which must not exist yet).

    Meant for tests, demos and synthetic data: it produces what a robot recording would look
    like, so the reader is exercised on realistic bags. Every frame becomes one message per
    camera and one ``JointState`` at ``start_time_ns + t``; the instruction is published once at
    ``t = 0`` (and again every ``instruction_period`` seconds if given, like a re-publishing
    node, and whenever a frame's ``instruction`` changes it); the outcome is published at the
    last frame's time when ``episode.success`` is not ``None``. Header stamps equal the log times.

    ``compressed`` selects ``CompressedImage`` (``image_format`` ``"jpeg"``, the default, or
    ``"png"``) over raw ``Image`` (``"rgb8"``, the default, ``"bgr8"`` or ``"mono8"``; mono8 drops
    colour and exists to test readers). Joint names (entry ``i`` names ``state[i]``) default to
    ``topics.joint_names``, else ``joint_0, joint_1, ...``.

    ``joint_layout`` says which joints each of ``topics.joint_states`` publishes, in message
    order: recordings of real robots split joints over topics (one per arm) and order them as
    their drivers do, and readers must cope. A joint listed for no topic is not recorded (a bag
    the reader must refuse). Default: every joint in state order on the single joint-state
    topic; several joint-state topics need a layout.

    ``series`` adds ``JointState`` topics at their own times (topic -> :class:`JointSeries`),
    e.g. the commanded action at every control tick; read them back with ``read_joint_series``.
    """
    path = Path(path)
    if storage not in _STORAGES:
        raise ValueError(f"storage must be one of {sorted(_STORAGES)}, got {storage!r}")
    if image_format is None:
        image_format = "jpeg" if compressed else "rgb8"
    allowed = _COMPRESSED_FORMATS if compressed else _RAW_ENCODINGS
    if image_format not in allowed:
        kind = "CompressedImage" if compressed else "raw Image"
        raise ValueError(f"image_format {image_format!r} is not valid for {kind}; choose one of {allowed}")
    if not 0 <= jpeg_quality <= 100:
        raise ValueError(f"jpeg_quality must be in [0, 100], got {jpeg_quality}")
    if instruction_period is not None and not (math.isfinite(instruction_period) and instruction_period > 0):
        raise ValueError(f"instruction_period must be a positive number of seconds, got {instruction_period}")
    if start_time_ns < 0:
        raise ValueError(f"start_time_ns must be >= 0, got {start_time_ns}")
    if set(topics.cameras) != set(episode.cameras):
        raise ValueError(f"topics.cameras names {sorted(topics.cameras)} do not match the episode's cameras "
                         f"{sorted(episode.cameras)}")
    if episode.success is not None and topics.outcome is None:
        raise ValueError("the episode has an outcome but topics.outcome is None; set an outcome topic "
                         "or set episode.success to None")
    if joint_names is None:
        joint_names = topics.joint_names
    names = [f"joint_{i}" for i in range(episode.state_dim)] if joint_names is None else list(joint_names)
    if len(names) != episode.state_dim:
        raise ValueError(f"got {len(names)} joint names for a {episode.state_dim}-dim state")
    layout = _joint_layout(topics.joint_states, names, joint_layout)
    series = dict(series or {})
    for topic in series:
        _check_topic_name(topic, "series")
        if topic in topics.all_topics():
            raise ValueError(f"series topic {topic} is already used by the episode's topics")
    if path.exists():
        raise FileExistsError(f"{path} exists already; rosbag2 writers only create new bags")

    typestore = get_typestore(Stores.ROS2_JAZZY)
    t_ = typestore.types
    image_type = COMPRESSED_IMAGE_TYPE if compressed else IMAGE_TYPE

    def stamp_ns(t: float) -> int:
        return start_time_ns + round(t * 1e9)

    def header(ns: int, frame_id: str) -> Any:
        stamp = t_["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9)
        return t_["std_msgs/msg/Header"](stamp=stamp, frame_id=frame_id)

    # (timestamp, order, topic, message): sorted so storages receive messages in time order.
    events: list[tuple[int, int, str, Any]] = []

    def add(ns: int, topic: str, msg: Any) -> None:
        events.append((ns, len(events), topic, msg))

    instructions = [(0.0, episode.task)]
    current = episode.task
    for fr in episode.frames:
        wanted = episode.task if fr.instruction is None else fr.instruction
        if wanted != current:
            instructions.append((fr.t, wanted))
            current = wanted
    if instruction_period is not None:
        repeats = []
        end_t = episode.frames[-1].t
        for i, (t0, text) in enumerate(instructions):
            t1 = instructions[i + 1][0] if i + 1 < len(instructions) else end_t + 1e-9
            k = 1
            while t0 + k * instruction_period < t1:
                repeats.append((t0 + k * instruction_period, text))
                k += 1
        instructions = sorted(instructions + repeats, key=lambda x: x[0])
    for t, text in instructions:
        add(stamp_ns(t), topics.instruction, t_[STRING_TYPE](data=text))

    for fr in episode.frames:
        ns = stamp_ns(fr.t)
        for cam, img in fr.images.items():
            add(ns, topics.cameras[cam], _image_message(typestore, img, header(ns, cam), image_format, jpeg_quality))
        for topic, columns in layout.items():
            add(ns, topic, t_[JOINT_STATE_TYPE](
                header=header(ns, ""), name=[names[c] for c in columns],
                position=fr.state[columns].astype(np.float64),
                velocity=np.zeros(0, dtype=np.float64), effort=np.zeros(0, dtype=np.float64)))
    for topic, ser in series.items():
        for t, row in zip(ser.t, ser.values):
            ns = stamp_ns(float(t))
            add(ns, topic, t_[JOINT_STATE_TYPE](
                header=header(ns, ""), name=list(ser.names), position=row.astype(np.float64),
                velocity=np.zeros(0, dtype=np.float64), effort=np.zeros(0, dtype=np.float64)))
    if episode.success is not None:
        assert topics.outcome is not None
        add(stamp_ns(episode.frames[-1].t), topics.outcome,
            t_[STRING_TYPE](data="success" if episode.success else "failure"))
    events.sort(key=lambda e: (e[0], e[1]))

    msgtypes = {topic: JOINT_STATE_TYPE for topic in topics.joint_states}
    msgtypes[topics.instruction] = STRING_TYPE
    msgtypes.update({topic: image_type for topic in topics.cameras.values()})
    if topics.outcome is not None and episode.success is not None:
        msgtypes[topics.outcome] = STRING_TYPE
    msgtypes.update({topic: JOINT_STATE_TYPE for topic in series})
    with Writer(path, version=BAG_FORMAT_VERSION, storage_plugin=_STORAGES[storage]) as writer:
        conns = {topic: writer.add_connection(topic, msgtype, typestore=typestore)
                 for topic, msgtype in msgtypes.items()}
        for ns, _, topic, msg in events:
            writer.write(conns[topic], ns, typestore.serialize_cdr(msg, msgtypes[topic]))


def _joint_layout(topics: Sequence[str], names: list[str],
                  layout: Mapping[str, Sequence[str]] | None) -> dict[str, list[int]]:
    """State columns published on each joint-state topic, in message order (see
    :func:`write_episode_bag`)."""
    if layout is None:
        if len(topics) > 1:
            raise ValueError(f"the episode goes to several joint-state topics {list(topics)}: pass joint_layout "
                             "to say which joints each one publishes")
        return {topics[0]: list(range(len(names)))}
    if set(layout) != set(topics):
        raise ValueError(f"joint_layout names topics {sorted(layout)}, the joint-state topics are {sorted(topics)}")
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for topic in topics:
        listed = list(layout[topic])
        unknown = [n for n in listed if n not in index]
        if unknown or len(set(listed)) != len(listed):
            raise ValueError(f"joint_layout[{topic!r}] = {listed}: each entry must be one of the joint names "
                             f"{names}, at most once" + (f" (unknown: {unknown})" if unknown else ""))
        out[topic] = [index[n] for n in listed]
    return out


def _image_message(typestore: Any, rgb: np.ndarray, header: Any, image_format: str, jpeg_quality: int) -> Any:
    """Encode one RGB frame as an Image or CompressedImage message."""
    h, w, _ = rgb.shape
    if image_format in _COMPRESSED_FORMATS:
        bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
        if image_format == "jpeg":
            ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
        else:
            ok, buf = cv2.imencode(".png", bgr)
        if not ok:
            raise RuntimeError(f"OpenCV failed to encode a {w}x{h} image as {image_format}")
        return typestore.types[COMPRESSED_IMAGE_TYPE](header=header, format=image_format,
                                                      data=np.ascontiguousarray(buf.reshape(-1)))
    if image_format == "rgb8":
        pixels = rgb
    elif image_format == "bgr8":
        pixels = rgb[:, :, ::-1]
    else:  # mono8
        pixels = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    channels = 1 if pixels.ndim == 2 else 3
    return typestore.types[IMAGE_TYPE](
        header=header, height=h, width=w, encoding=image_format, is_bigendian=0, step=w * channels,
        data=np.ascontiguousarray(pixels).reshape(-1))


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass
class _Latest:
    """Newest message of one topic, decoded only when a call uses it."""

    ns: int
    raw: bytes | memoryview
    msgtype: str
    decoded_ns: int = -1
    decoded: Any = None


@dataclass
class _CallSampler:
    """Turns a time-ordered message stream into policy calls (see :func:`read_episode`).

    Images are decoded lazily: only the newest message of a camera at a call, once. So is the
    state when it is the single joint-state topic's positions in message order. With an
    ``assembler`` (joint names given) every joint-state message is instead applied as it
    arrives, in log-time order, exactly as the policy node's subscription callbacks apply
    them: a joint's value is the newest one any topic published, and every message is
    validated, not only the ones a call happens to use.
    """

    topics: BagTopics
    call_period_ns_float: float
    state_dim: int | None
    typestore: Any
    start_ns: int
    assembler: JointStateAssembler | None = None
    latest: dict[str, _Latest] = field(default_factory=dict)
    instructions: list[tuple[int, str]] = field(default_factory=list)
    outcome: str | None = None
    ready_ns: int | None = None
    next_call: int = 0
    last_data_ns: int | None = None
    last_ns: int = -1
    frames: list[EpisodeFrame] = field(default_factory=list)
    # Names published on joint-state topics that are not among the joint names: shown when a
    # named joint never appears, since a renamed joint is the usual cause.
    foreign_joints: set[str] = field(default_factory=set)
    data_topics: set[str] = field(init=False)  # cameras and joint states: the topics calls sample
    camera_of: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.data_topics = {*self.topics.cameras.values(), *self.topics.joint_states}
        self.camera_of = {topic: cam for cam, topic in self.topics.cameras.items()}

    def call_ns(self, k: int) -> int:
        # k * period in float, then rounded: matches stamps written as round(t * 1e9), so a
        # message stamped exactly at a call time counts as already received.
        assert self.ready_ns is not None
        return self.ready_ns + round(k * self.call_period_ns_float)

    def on_message(self, topic: str, ns: int, raw: bytes | memoryview, msgtype: str) -> None:
        if ns < self.last_ns:
            raise ValueError(f"bag messages are not in time order ({topic} at {ns} ns after {self.last_ns} ns); "
                             "cannot replay it causally")
        self.last_ns = ns
        if topic in self.data_topics:
            self.emit_before(ns)
            self.latest[topic] = entry = _Latest(ns, raw, msgtype)
            self.last_data_ns = ns
            if self.assembler is not None and topic not in self.camera_of:
                self.assemble(topic, entry)
        elif topic == self.topics.instruction:
            text = self.typestore.deserialize_cdr(raw, STRING_TYPE).data
            self.instructions.append((ns, text))
        elif topic == self.topics.outcome:
            self.outcome = self.typestore.deserialize_cdr(raw, STRING_TYPE).data
            return
        if self.ready_ns is None and self.instructions and self.inputs_complete():
            self.ready_ns = ns

    def inputs_complete(self) -> bool:
        """Whether every camera has an image and the state is known: a call can be made."""
        if not all(topic in self.latest for topic in self.camera_of):
            return False
        if self.assembler is not None:
            return self.assembler.complete()
        return self.topics.joint_states[0] in self.latest

    def emit_before(self, ns: int) -> None:
        """Emit every call strictly before ``ns``: all messages up to it are already seen."""
        if self.ready_ns is None:
            return
        while (call := self.call_ns(self.next_call)) < ns:
            self.emit(call)
            self.next_call += 1

    def finish(self) -> None:
        if self.ready_ns is None or self.last_data_ns is None:
            return
        while (call := self.call_ns(self.next_call)) <= self.last_data_ns:
            self.emit(call)
            self.next_call += 1

    def emit(self, call: int) -> None:
        images = {cam: self.decoded(topic, call) for cam, topic in self.topics.cameras.items()}
        if self.assembler is not None:
            state = self.assembler.vector()   # a fresh array: later messages do not change this frame
        else:
            state = self.decoded(self.topics.joint_states[0], call)
        i = bisect.bisect_right(self.instructions, call, key=lambda x: x[0]) - 1
        assert i >= 0, "calls start only once an instruction has arrived"
        self.frames.append(EpisodeFrame(t=(call - self.start_ns) / 1e9, images=images, state=state,
                                        instruction=self.instructions[i][1]))

    def decoded(self, topic: str, call: int) -> Any:
        entry = self.latest[topic]
        assert entry.ns <= call
        if entry.decoded_ns != entry.ns:
            entry.decoded = self.decode(topic, entry)
            entry.decoded_ns = entry.ns
        return entry.decoded

    def where(self, topic: str, entry: _Latest) -> str:
        return f"{topic} at t={(entry.ns - self.start_ns) / 1e9:.3f}s"

    def deserialize(self, topic: str, entry: _Latest) -> Any:
        try:
            return self.typestore.deserialize_cdr(entry.raw, entry.msgtype)
        except Exception as exc:  # noqa: BLE001 - re-raised with the topic and time
            raise ValueError(f"could not deserialize {entry.msgtype} on {self.where(topic, entry)}: {exc}") from exc

    def assemble(self, topic: str, entry: _Latest) -> None:
        """Apply one joint-state message to the assembler; a message the node would refuse
        (NaN, names and positions of different lengths, no known joint) fails the read."""
        assert self.assembler is not None
        msg = self.deserialize(topic, entry)
        try:
            self.assembler.update(msg, entry.ns)
        except ValueError as exc:  # InputError: the node's diagnostic, which names the joints
            raise ValueError(f"joint state on {self.where(topic, entry)} refused: {exc}") from exc
        self.foreign_joints.update(n for n in msg.name if n not in self.assembler.index)

    def decode(self, topic: str, entry: _Latest) -> Any:
        at = self.where(topic, entry)
        msg = self.deserialize(topic, entry)
        camera = self.camera_of.get(topic)
        if camera is None:  # the single joint-state topic, positions in message order
            state = np.asarray(msg.position, dtype=np.float32)
            if self.state_dim is None:
                self.state_dim = int(state.shape[0])
                if self.state_dim == 0:
                    raise ValueError(f"joint state on {at} has no positions")
            if state.shape[0] != self.state_dim:
                raise ValueError(f"state dimension mismatch: joint state on {at} has {state.shape[0]} positions, "
                                 f"expected {self.state_dim}")
            return state
        # The vision node's conversion, so replay refuses exactly the images the node would.
        try:
            return image_from_msg(msg, entry.msgtype == COMPRESSED_IMAGE_TYPE, camera)
        except ValueError as exc:
            raise ValueError(f"image on {at} refused: {exc}") from exc


def read_episode(
    path: str | Path,
    topics: BagTopics,
    call_period: float,
    state_dim: int | None = None,
    *,
    episode_id: str | None = None,
) -> Episode:
    """Replay one bag as the sequence of policy calls the runtime would have made.

    Calls happen every ``call_period`` seconds, starting at the first moment every camera, the
    joint state and the instruction have each published a message, and continuing up to the
    last camera/joint-state message. Each call uses the newest message of each topic received
    at or before the call time (never a later one); its instruction is the last instruction
    received by then. ``success`` comes from the last outcome message (``"success"`` /
    ``"failure"``), ``None`` if the bag has no outcome topic or message. ``state_dim``, when
    given, is checked against every joint state used.

    With ``topics.joint_names`` the state is assembled by name from all of
    ``topics.joint_states`` with the policy node's ``JointStateAssembler`` (every message, in
    log-time order): the first call waits until every named joint has a value, each value is
    the newest any topic published, names the profile does not have are ignored. Images go
    through the vision node's ``image_from_msg``. So a bag is read with the node's validation,
    and a message the node would refuse is an error here (replay is a regression check; a bad
    recording should not pass silently).

    Frame times ``t`` count from the bag's first message. ``episode_id`` defaults to the bag's
    name. Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for a bag that
    lacks a topic (listing the topics it has), has a topic of the wrong type, has no
    instruction, has mismatched state dimensions, a named joint that never appears (naming it
    and the topics searched), non-finite joint positions (naming topic, time and joint) or
    images that cannot be decoded.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no bag at {path}")
    if not (isinstance(call_period, (int, float)) and math.isfinite(call_period) and call_period > 0):
        raise ValueError(f"call_period must be a positive number of seconds, got {call_period!r}")
    if state_dim is not None and state_dim < 1:
        raise ValueError(f"state_dim must be >= 1, got {state_dim}")
    assembler = None
    if topics.joint_names is not None:
        if state_dim is not None and state_dim != len(topics.joint_names):
            raise ValueError(f"state_dim {state_dim} does not match the {len(topics.joint_names)} joint names "
                             f"{list(topics.joint_names)}")
        assembler = JointStateAssembler(topics.joint_names)

    typestore = get_typestore(Stores.ROS2_JAZZY)
    reader = Reader(path)
    try:
        reader.open()
    except ReaderError as exc:
        raise ValueError(f"{path} is not a readable rosbag2 bag: {exc}") from exc
    try:  # the reader is already open, so no context manager (it would open it again)
        types_by_topic: dict[str, set[str]] = {}
        for conn in reader.connections:
            types_by_topic.setdefault(conn.topic, set()).add(conn.msgtype)
        available = ", ".join(f"{t} ({'/'.join(sorted(m))})" for t, m in sorted(types_by_topic.items())) or "none"
        required = [*topics.cameras.values(), *topics.joint_states, topics.instruction]
        missing = [t for t in required if t not in types_by_topic]
        if missing:
            raise ValueError(f"bag {path} lacks topic(s) {missing}; it has: {available}")
        expected = {t: {JOINT_STATE_TYPE} for t in topics.joint_states}
        expected[topics.instruction] = {STRING_TYPE}
        expected.update({t: {IMAGE_TYPE, COMPRESSED_IMAGE_TYPE} for t in topics.cameras.values()})
        if topics.outcome is not None and topics.outcome in types_by_topic:
            expected[topics.outcome] = {STRING_TYPE}
        for topic, allowed in expected.items():
            found = types_by_topic[topic]
            if len(found) != 1 or not found <= allowed:
                raise ValueError(f"bag {path}: topic {topic} carries {sorted(found)}, "
                                 f"expected one of {sorted(allowed)}")

        wanted = [c for c in reader.connections if c.topic in expected]
        sampler = _CallSampler(topics=topics, call_period_ns_float=call_period * 1e9, state_dim=state_dim,
                               typestore=typestore, start_ns=reader.start_time, assembler=assembler)
        for conn, ns, raw in reader.messages(connections=wanted):
            sampler.on_message(conn.topic, ns, raw, conn.msgtype)
        sampler.finish()
    finally:
        reader.close()

    if not sampler.instructions:
        raise ValueError(f"bag {path} has no instruction: topic {topics.instruction} has no messages")
    if not sampler.frames:
        silent = [t for t in sorted(sampler.data_topics) if t not in sampler.latest]
        never = assembler.missing() if assembler is not None else []
        if never:
            foreign = sorted(sampler.foreign_joints)
            raise ValueError(
                f"bag {path}: joint(s) {never} of the joint names never appear on the joint-state topic(s) "
                f"{list(topics.joint_states)}"
                + (f"; names published there that are not joint names: {foreign}" if foreign else "")
                + (f"; topics without messages: {silent}" if silent else ""))
        raise ValueError(f"bag {path} has no moment where every camera, the joint state and the instruction "
                         f"had a message; topics without messages: {silent or 'none'}")
    success = None
    if sampler.outcome is not None:
        value = sampler.outcome.strip().lower()
        if value not in _OUTCOME_VALUES:
            raise ValueError(f"bag {path}: outcome {sampler.outcome!r} on {topics.outcome} is neither "
                             f"'success' nor 'failure'")
        success = _OUTCOME_VALUES[value]

    task = sampler.frames[0].instruction
    assert task is not None
    if not task.strip():
        raise ValueError(f"bag {path}: the instruction in effect at the first call is empty")
    for fr in sampler.frames:
        if fr.instruction == task:
            fr.instruction = None
    name = episode_id if episode_id is not None else (path.stem if path.is_file() else path.name)
    return Episode(episode_id=name, task=task, success=success, frames=sampler.frames, source=str(path))


def read_joint_series(path: str | Path, topic: str) -> JointSeries:
    """Every message of one ``JointState`` topic of a bag, as a :class:`JointSeries`.

    Times are log times in seconds since the bag's first message (the clock of ``read_episode``'s
    frames), so a series written beside an episode lines up with its frames again.
    """
    path = Path(path)
    typestore = get_typestore(Stores.ROS2_JAZZY)
    with Reader(path) as reader:
        conns = [c for c in reader.connections if c.topic == topic]
        if not conns:
            have = sorted({c.topic for c in reader.connections})
            raise ValueError(f"bag {path} has no topic {topic}; it has {have}")
        if any(c.msgtype != JOINT_STATE_TYPE for c in conns):
            raise ValueError(f"bag {path}: topic {topic} is not {JOINT_STATE_TYPE}")
        start = reader.start_time
        times, rows, names = [], [], None
        for conn, ns, raw in reader.messages(connections=conns):
            msg = typestore.deserialize_cdr(raw, conn.msgtype)
            times.append((ns - start) / 1e9)
            rows.append(np.asarray(msg.position, dtype=np.float64))
            names = tuple(msg.name) if names is None else names
    if not rows:
        raise ValueError(f"bag {path}: topic {topic} has no messages")
    return JointSeries(np.asarray(times), np.stack(rows), names or ())


def _is_bag_dir(path: Path) -> bool:
    return path.is_dir() and (path / "metadata.yaml").is_file()


def list_episode_bags(root: str | Path) -> list[Path]:
    """Every bag under ``root``, sorted by path.

    ``root`` may be one bag (a directory with ``metadata.yaml``, or a lone ``.mcap``/``.db3``
    file) or a directory of them, nested to any depth; the storage files inside a bag directory
    are not listed separately. Raises ``FileNotFoundError`` if ``root`` is missing or holds no
    bag, since an empty result almost always means a wrong path.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if root.is_file():
        if root.suffix in (".mcap", ".db3"):
            return [root]
        raise FileNotFoundError(f"{root} is not a bag (expected a bag directory or a .mcap/.db3 file)")
    if _is_bag_dir(root):
        return [root]
    bags: list[Path] = []
    stack = [root]
    while stack:
        folder = stack.pop()
        for child in folder.iterdir():
            if _is_bag_dir(child):
                bags.append(child)
            elif child.is_dir():
                stack.append(child)
            elif child.is_file() and child.suffix in (".mcap", ".db3"):
                bags.append(child)
    if not bags:
        raise FileNotFoundError(f"no rosbag2 bags under {root} (looked for directories with metadata.yaml "
                                f"and .mcap/.db3 files)")
    return sorted(bags)
