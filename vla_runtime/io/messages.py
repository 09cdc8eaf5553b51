"""Message payloads to arrays, validated the same way live and from a recording.

The vision and policy nodes (``nodes.conversions``) and the bag reader (``io.bags``, hence
replay, ``run`` and the cache builder) both turn ``sensor_msgs`` images into RGB arrays and
joint states into a state vector in the profile's joint order. Both go through the code here,
so a recording is refused exactly where a node would refuse the live message. It lives in
``io`` (below the nodes) because the bag reader needs it without the ROS-facing node code; the
functions only read attributes of the message objects, so rclpy and rosbags messages pass alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import cv2
import numpy as np

IMAGE_TYPE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE_TYPE = "sensor_msgs/msg/CompressedImage"

_READABLE_RAW_ENCODINGS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}


class InputError(ValueError):
    """A message that must not reach the engine; the text is the diagnostic."""


def image_from_msg(msg: Any, compressed: bool, camera: str, max_side: int = 4096) -> np.ndarray:
    """uint8 RGB [H, W, 3] from ``sensor_msgs/Image`` or ``CompressedImage``."""
    try:
        img = decode_image_message(msg, COMPRESSED_IMAGE_TYPE if compressed else IMAGE_TYPE)
    except (ValueError, AttributeError, TypeError) as e:
        raise InputError(f"camera {camera!r}: {e}") from None
    if max(img.shape[:2]) > max_side:
        raise InputError(f"camera {camera!r}: image {img.shape[1]}x{img.shape[0]} exceeds {max_side} pixels a side")
    return img


def _uint8_buffer(data: Any) -> np.ndarray:
    """Message byte arrays arrive as numpy arrays (rosbags), ``array('B')`` or bytes (rclpy)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.asarray(data, dtype=np.uint8)


def decode_image_message(msg: Any, msgtype: str) -> np.ndarray:
    """Decode an ``Image`` (rgb8/bgr8/rgba8/bgra8/mono8) or ``CompressedImage`` (anything OpenCV
    decodes: JPEG, PNG, ...) message to uint8 RGB ``[H, W, 3]``.

    Raw images honour ``step`` (rows may be padded). Grayscale is expanded to three channels,
    since the policy's vision tower expects RGB.
    """
    if msgtype == COMPRESSED_IMAGE_TYPE:
        buf = _uint8_buffer(msg.data)
        if buf.size == 0:
            raise ValueError(f"CompressedImage (format {msg.format!r}) has no data")
        bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
        if bgr is None:
            raise ValueError(f"could not decode CompressedImage with format {msg.format!r} "
                             f"({buf.size} bytes, first bytes {bytes(buf[:8]).hex()})")
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    if msgtype != IMAGE_TYPE:
        raise ValueError(f"not an image message type: {msgtype}")
    enc = msg.encoding.lower()
    if enc not in _READABLE_RAW_ENCODINGS:
        raise ValueError(f"unsupported Image encoding {msg.encoding!r}; supported: "
                         f"{sorted(_READABLE_RAW_ENCODINGS)}")
    channels = _READABLE_RAW_ENCODINGS[enc]
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    data = _uint8_buffer(msg.data)
    if h <= 0 or w <= 0:
        raise ValueError(f"Image has invalid size {w}x{h}")
    if step < w * channels or data.size < step * h:
        raise ValueError(f"Image {w}x{h} {enc}: step {step} and {data.size} data bytes are inconsistent "
                         f"(need step >= {w * channels} and {step * h} bytes)")
    pixels = data[: step * h].reshape(h, step)[:, : w * channels].reshape(h, w, channels)
    if enc == "rgb8":
        return np.ascontiguousarray(pixels)
    if enc == "bgr8":
        return cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB)
    if enc == "rgba8":
        return cv2.cvtColor(pixels, cv2.COLOR_RGBA2RGB)
    if enc == "bgra8":
        return cv2.cvtColor(pixels, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(pixels[:, :, 0], cv2.COLOR_GRAY2RGB)


@dataclass
class JointStateAssembler:
    """Joint states (possibly several topics, e.g. one per arm) -> one vector in profile order.

    The policy node assembles its live state with it, and bag reading
    (``vla_runtime.io.bags.read_episode`` with joint names, hence replay and the cache builder)
    feeds recorded messages through this same class, so a recording is assembled and refused
    exactly as the policy node does it live.
    """

    joint_names: Sequence[str]

    def __post_init__(self) -> None:
        self.index = {n: i for i, n in enumerate(self.joint_names)}
        self.state = np.full(len(self.joint_names), np.nan)
        self.stamp_ns = np.zeros(len(self.joint_names), dtype=np.int64)

    def update(self, msg: Any, stamp_ns: int) -> None:
        names, pos = list(msg.name), list(msg.position)
        if len(names) != len(pos):
            raise InputError(f"JointState has {len(names)} names but {len(pos)} positions")
        if len(set(names)) != len(names):
            raise InputError(f"JointState names a joint twice: {sorted({n for n in names if names.count(n) > 1})}")
        known = [(self.index[n], p) for n, p in zip(names, pos) if n in self.index]
        if not known:
            raise InputError(f"JointState names {names[:8]} match none of the profile's joints {list(self.joint_names)[:8]}")
        bad = [n for n, p in zip(names, pos) if n in self.index and not math.isfinite(p)]
        if bad:
            raise InputError(f"JointState has non-finite positions for {bad}")
        for i, p in known:
            self.state[i] = p
            self.stamp_ns[i] = stamp_ns

    def complete(self) -> bool:
        return bool(np.isfinite(self.state).all())

    def missing(self) -> list[str]:
        """The profile's joints no accepted message has named yet, in profile order: what
        keeps the state incomplete (replay names them when a recording never has them)."""
        return [n for n, v in zip(self.joint_names, self.state) if not math.isfinite(v)]

    def vector(self) -> np.ndarray:
        missing = self.missing()
        if missing:
            raise InputError(f"no joint state received yet for {missing}")
        return self.state.astype(np.float32)

    def oldest_stamp_ns(self) -> int:
        return int(self.stamp_ns.min())
