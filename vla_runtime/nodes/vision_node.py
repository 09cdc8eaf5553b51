"""The vision node: camera images + a prefix request -> a prefix slot in the ring buffer.

Thin rclpy wiring around ``VisionWorker``: it keeps the newest image of every camera (converted
and validated at the boundary), and for each ``PrefixRequest`` from the policy node writes the
prefix K/V of every VLM layer into the next ring slot and announces it with ``SlotReady``.
"""

from __future__ import annotations

import time

from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from rcl_interfaces.msg import ParameterDescriptor
from sensor_msgs.msg import CompressedImage, Image

from vla_runtime.msg import PrefixRequest, SlotReady

from ..engine.policy import Observation, Pi05Policy
from ..ipc.ring import RingBuffer
from .conversions import InputError, image_from_msg
from .prefix_ring import DEFAULT_RING, READY_TOPIC, REQUEST_TOPIC, prefix_layout
from .profile import load_profile
from .spin import run
from .workers import VisionWorker


class VisionNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_vision")
        p = lambda name, default, text: self.declare_parameter(name, default, ParameterDescriptor(description=text))  # noqa: E731
        p("profile", "", "robot profile YAML (config/<robot>.yaml)")
        p("checkpoint", "", "checkpoint directory; overrides the profile's engine.checkpoint")
        p("ring", DEFAULT_RING, "name of the prefix ring buffer (shared memory) this node creates")
        p("ring_slots", 4, "slots in the prefix ring buffer")
        self.profile = load_profile(self.get_parameter("profile").value)
        ckpt = self.get_parameter("checkpoint").value or self.profile.engine.checkpoint
        if not ckpt:
            raise ValueError("no checkpoint: set the 'checkpoint' parameter or engine.checkpoint in the profile")
        cams = [c.name for c in self.profile.cameras]
        self.worker = VisionWorker(Pi05Policy.from_checkpoint(ckpt, camera_names=cams))
        slots = int(self.get_parameter("ring_slots").value)
        if not 2 <= slots <= 64:
            raise ValueError(f"ring_slots must be in [2, 64], got {slots}")
        self.ring = RingBuffer.create(self.get_parameter("ring").value, prefix_layout(self.worker.spec), slots,
                                      replace_stale=True)
        self.latest: dict[str, object] = {}
        for cam in self.profile.cameras:
            kind = CompressedImage if cam.compressed else Image
            self.create_subscription(kind, cam.topic, lambda m, c=cam: self._on_image(c, m), qos_profile_sensor_data)
        self.create_subscription(PrefixRequest, REQUEST_TOPIC, self._on_request, 10)
        self.ready_pub = self.create_publisher(SlotReady, READY_TOPIC, 10)
        self.create_timer(0.1, self.ring.heartbeat)
        self.get_logger().info(f"vision node up: profile {self.profile.name}, checkpoint {ckpt}, ring {self.ring.name}")

    def _on_image(self, cam, msg) -> None:
        try:
            self.latest[cam.name] = image_from_msg(msg, cam.compressed, cam.name)
        except InputError as e:
            self.get_logger().warning(str(e), throttle_duration_sec=2.0)

    def _on_request(self, req: PrefixRequest) -> None:
        missing = [c.name for c in self.profile.cameras if c.name not in self.latest]
        if len(missing) == len(self.profile.cameras):
            self.get_logger().warning(f"prefix request {req.request_seq}: no camera image yet", throttle_duration_sec=2.0)
            return
        obs = Observation(images=dict(self.latest), state=list(req.state), task=req.task)
        writer = self.ring.begin_write()
        try:
            meta = self.worker.encode(obs, {k: writer[k] for k in ("k", "v", "retrieval", "state")},
                                      observation_seq=req.request_seq, stamp_ns=time.monotonic_ns())
        except (ValueError, InputError) as e:
            writer.abort()
            self.get_logger().error(f"prefix request {req.request_seq} refused: {e}")
            return
        slot, seq = writer.commit({**meta.as_dict(), "request_seq": int(req.request_seq),
                                   "start_tick": int(req.start_tick)})
        out = SlotReady()
        out.header.stamp = self.get_clock().now().to_msg()
        out.ring, out.slot, out.sequence, out.layout_tag = self.ring.name, slot, seq, self.ring.layout.tag
        self.ready_pub.publish(out)

    def destroy_node(self) -> None:
        self.ring.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    run(VisionNode, args=args)


if __name__ == "__main__":
    main()
