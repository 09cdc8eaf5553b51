"""The vision node: camera images + a prefix request -> a prefix slot in the ring buffer.

Thin rclpy wiring around ``VisionStage``: it keeps the newest image of every camera (converted
and validated at the boundary), and for each ``PrefixRequest`` from the policy node writes the
prefix K/V of every VLM layer into the next ring slot and announces it with ``SlotReady``. With
the cache enabled it asks the cache manager for a reference between the vision tower and the
prefill, and waits for the answer at most the profile's ``cache.reference_timeout_s`` (then
that call runs dense).
"""

from __future__ import annotations

import threading

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from vla_runtime.msg import PrefixRequest, ReferenceQuery, ReferenceReply, SlotReady

from .conversions import InputError, image_from_msg
from .diagnostics import DIAGNOSTICS_TOPIC, diagnostic_array
from .params import declare_parameters, profile_and_checkpoint, ring_names
from .prefix_ring import QUERY_TOPIC, READY_TOPIC, REPLY_TOPIC, REQUEST_TOPIC
from .spin import run
from .stages import PrefixRequestNote, QueryNote, VisionStage, cache_config, load_policy, open_repository_meta
from .workers import ReferenceChoice

PARAMETERS = {
    "profile": ("", "robot profile YAML (config/<robot>.yaml)"),
    "checkpoint": ("", "checkpoint directory; overrides the profile's engine.checkpoint"),
    "ring": ("vla_prefix", "name of the prefix ring buffer (shared memory) this node creates"),
    "query_ring": ("vla_query", "name of the retrieval-query ring buffer this node creates (cache enabled)"),
    "working_set": ("vla_refs", "name of the cache manager's working-set ring buffer"),
    "ring_slots": (4, "slots in the prefix ring buffer, in [2, 64]"),
}


class VisionNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_vision")
        v = declare_parameters(self, PARAMETERS)
        self.profile, ckpt = profile_and_checkpoint(v)
        if not 2 <= v["ring_slots"] <= 64:
            raise ValueError(f"ring_slots must be in [2, 64], got {v['ring_slots']}")
        self.reference_timeout_s = self.profile.cache.reference_timeout_s
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras])
        cc = cache_config(self.profile.cache, open_repository_meta(self.profile.cache, policy))
        self.stage = VisionStage(policy, ring_names(v), int(v["ring_slots"]), cc)
        self.latest: dict[str, object] = {}
        self.refused_images = 0
        self.calls = 0
        self._reply: ReferenceChoice | None = None
        self._reply_ready = threading.Event()
        self._waiting_for = -1
        for cam in self.profile.cameras:
            kind = CompressedImage if cam.compressed else Image
            self.create_subscription(kind, cam.topic, lambda m, c=cam: self._on_image(c, m), qos_profile_sensor_data)
        self.create_subscription(PrefixRequest, REQUEST_TOPIC, self._on_request, 10)
        self.ready_pub = self.create_publisher(SlotReady, READY_TOPIC, 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)
        if cc is not None:   # answers arrive while _on_request waits: their own callback group
            self.query_pub = self.create_publisher(ReferenceQuery, QUERY_TOPIC, 10)
            self.create_subscription(ReferenceReply, REPLY_TOPIC, self._on_reply, 10,
                                     callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(0.1, self.stage.heartbeat)
        self.get_logger().info(f"vision node up: profile {self.profile.name}, checkpoint {ckpt}, ring "
                               f"{self.stage.prefix.name}, cache {'on' if cc is not None else 'off'}")

    def _on_image(self, cam, msg) -> None:
        try:
            self.latest[cam.name] = image_from_msg(msg, cam.compressed, cam.name)
        except InputError as e:
            self.refused_images += 1
            self.get_logger().warning(str(e), throttle_duration_sec=2.0)

    def _ask(self, q: QueryNote) -> ReferenceChoice | None:
        """Publish the query and wait (bounded) for the cache manager's answer to it."""
        self._reply_ready.clear()
        self._waiting_for = q.request_seq
        msg = ReferenceQuery(request_seq=q.request_seq, task=q.task, ring=self.stage.query.name, slot=q.slot,
                             sequence=q.seq)
        msg.header.stamp = self.get_clock().now().to_msg()
        self.query_pub.publish(msg)
        if not self._reply_ready.wait(self.reference_timeout_s):
            self.get_logger().warning(f"no reference for call {q.request_seq} within {self.reference_timeout_s} s: "
                                      "dense", throttle_duration_sec=2.0)
            return None
        return self._reply

    def _on_reply(self, msg: ReferenceReply) -> None:
        if msg.request_seq != self._waiting_for:   # a late answer to a call that already went dense
            return
        self._reply = ReferenceChoice(int(msg.request_seq), int(msg.slot) if msg.found else -1,
                                      int(msg.sequence) if msg.found else -1, msg.episode_id, int(msg.index),
                                      float(msg.similarity), msg.reason)
        self._reply_ready.set()

    def _on_request(self, req: PrefixRequest) -> None:
        missing = [c.name for c in self.profile.cameras if c.name not in self.latest]
        if len(missing) == len(self.profile.cameras):
            self.get_logger().warning(f"prefix request {req.request_seq}: no camera image yet", throttle_duration_sec=2.0)
            return
        note = PrefixRequestNote(int(req.request_seq), int(req.start_tick), tuple(req.state), req.task)
        ask = self._ask if self.stage.query is not None else None
        try:
            slot = self.stage.encode(note, dict(self.latest), ask)
        except (ValueError, InputError) as e:
            self.get_logger().error(f"prefix request {req.request_seq} refused: {e}")
            return
        out = SlotReady()
        out.header.stamp = self.get_clock().now().to_msg()
        out.ring, out.slot, out.sequence, out.layout_tag = slot.ring, slot.slot, slot.seq, self.stage.prefix.layout.tag
        self.ready_pub.publish(out)
        self.calls += 1
        self._publish_diagnostics(missing)

    def _publish_diagnostics(self, missing: list[str]) -> None:
        times = self.stage.last_timer.times.seconds if self.stage.last_timer is not None else {}
        choice = self.stage.last_choice
        values = {f"{k}_s": f"{t:.4f}" for k, t in times.items()}
        values |= {"calls": str(self.calls), "missing_cameras": ",".join(missing), "refused_images": str(self.refused_images),
                   "reference": "" if choice is None or not choice.found else f"{choice.episode}:{choice.index}",
                   "context_cache": str(self.stage.worker.last_context is not None),
                   "dense_reason": "" if choice is None else choice.reason}
        warn = "camera(s) missing: " + ", ".join(missing) if missing else ""
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: vision", self.profile.name, values, warn))

    def destroy_node(self) -> None:
        self.stage.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    run(VisionNode, threads=2, args=args)


if __name__ == "__main__":
    main()
