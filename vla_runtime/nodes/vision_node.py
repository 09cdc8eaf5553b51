"""The vision node: camera images + a prefix request -> a prefix slot in the ring buffer.

Thin rclpy wiring around ``VisionStage``: it keeps the newest image of every camera (converted
and validated at the boundary), and for each ``PrefixRequest`` from the policy node writes the
prefix K/V of every VLM layer into the next ring slot and announces it with ``SlotReady``. With
the cache enabled it asks the cache manager for a reference between the vision tower and the
prefill, and waits for the answer at most the profile's ``cache.reference_timeout_s`` (then
that call runs dense).

Camera messages are checked at the boundary (``conversions``): encoding, size, stamps from the
future or too old; a camera that stops sending new frames or freezes (the same stamp again and
again) is stale, and a request is then refused (the policy node's watchdog holds the robot)
until it sends new frames. Diagnostics go out after every call, every refusal and once a second.
"""

from __future__ import annotations

import threading
import time

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from vla_runtime.msg import PrefixRequest, ReferenceQuery, ReferenceReply, SlotReady

from .conversions import CameraFeed, InputError, StampCheck, image_from_msg, stamp_ns, usable_images
from .diagnostics import DIAGNOSTICS_TOPIC, diagnostic_array
from .params import VISION, declare_parameters, profile_and_checkpoint, ring_names
from .prefix_ring import QUERY_TOPIC, READY_TOPIC, REPLY_TOPIC, REQUEST_TOPIC
from .spin import CallbackGate, gated, run
from .stages import PrefixRequestNote, QueryNote, VisionStage, cache_config, load_policy, open_repository_meta
from .workers import ReferenceChoice

PARAMETERS = VISION
SHUTDOWN_WAIT_S = 5.0   # for the call in flight at shutdown (it no longer waits for a reference)


class VisionNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_vision")
        v = declare_parameters(self, PARAMETERS, self._on_parameter)
        self.params = v
        self.profile, ckpt = profile_and_checkpoint(v)
        self.reference_timeout_s = self.profile.cache.reference_timeout_s
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras], self.profile.state_dim)
        cc = cache_config(self.profile.cache, open_repository_meta(self.profile.cache, policy))
        self.stage = VisionStage(policy, ring_names(v), int(v["ring_slots"]), cc)
        self.feeds = {c.name: CameraFeed(c.name) for c in self.profile.cameras}
        self.refused_images = 0
        self.refused_requests = 0
        self.last_refusal = ""
        self.stale: list[str] = []
        self.missing: list[str] = []
        self.calls = 0
        self._reply: ReferenceChoice | None = None
        self._reply_ready = threading.Event()
        self._waiting_for = -1
        self.gate = CallbackGate()   # destroy_node waits for the call in flight before closing the rings
        images = MutuallyExclusiveCallbackGroup()   # frames keep arriving while a call is encoded
        for cam in self.profile.cameras:
            kind = CompressedImage if cam.compressed else Image
            self.create_subscription(kind, cam.topic, lambda m, c=cam: self._on_image(c, m), qos_profile_sensor_data,
                                     callback_group=images)
        self.create_subscription(PrefixRequest, REQUEST_TOPIC, self._on_request, 10)
        self.ready_pub = self.create_publisher(SlotReady, READY_TOPIC, 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)
        if cc is not None:   # answers arrive while _on_request waits: their own callback group
            self.query_pub = self.create_publisher(ReferenceQuery, QUERY_TOPIC, 10)
            self.create_subscription(ReferenceReply, REPLY_TOPIC, self._on_reply, 10,
                                     callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(0.1, self._heartbeat)
        self.create_timer(1.0, self._publish_diagnostics)
        self.get_logger().info(f"vision node up: profile {self.profile.name}, checkpoint {ckpt}, ring "
                               f"{self.stage.prefix.name}, cache {'on' if cc is not None else 'off'}")

    def _on_parameter(self, name: str, value: object) -> None:
        self.params[name] = value   # read on every use: takes effect from the next message / call

    def _stamps(self) -> StampCheck:
        return StampCheck(float(self.params["max_input_age_s"]), float(self.params["max_future_s"]))

    def _refuse(self, what: str) -> None:
        self.last_refusal = what
        self.get_logger().warning(what, throttle_duration_sec=2.0)

    def _on_image(self, cam, msg) -> None:
        stamp = stamp_ns(msg)

        def accept():   # a new frame only: a repeated stamp is counted before its age is judged, so
            #             a frozen driver is reported as frozen rather than as sending old frames
            self._stamps().check(stamp, self.get_clock().now().nanoseconds, f"camera {cam.name!r}")
            return image_from_msg(msg, cam.compressed, cam.name)

        try:
            self.feeds[cam.name].offer(stamp, time.monotonic_ns(), accept)
        except InputError as e:
            self.refused_images += 1
            self._refuse(f"image refused: {e}")

    def _ask(self, q: QueryNote) -> ReferenceChoice | None:
        """Publish the query and wait (bounded) for the cache manager's answer to it; with no cache
        manager subscribed (not started yet, or gone) the call goes dense at once instead of waiting."""
        if self.query_pub.get_subscription_count() == 0:
            return ReferenceChoice(q.request_seq, reason="no cache manager subscribed")
        self._reply_ready.clear()
        if self.gate.closing:   # after the clear: a wake-up set before it would be lost
            return ReferenceChoice(q.request_seq, reason="vision node shutting down")
        self._waiting_for = q.request_seq
        msg = ReferenceQuery(request_seq=q.request_seq, task=q.task, ring=self.stage.query.name, slot=q.slot,
                             sequence=q.seq)
        if hasattr(msg, "episode"):
            msg.episode = q.episode
        msg.header.stamp = self.get_clock().now().to_msg()
        self.query_pub.publish(msg)
        answered = self._reply_ready.wait(self.reference_timeout_s)
        if self.gate.closing:   # woken by destroy_node: finish this call dense, without waiting
            return ReferenceChoice(q.request_seq, reason="vision node shutting down")
        if not answered:
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

    @gated
    def _heartbeat(self) -> None:
        self.stage.heartbeat()

    @gated
    def _on_request(self, req: PrefixRequest) -> None:
        images, self.missing, self.stale = usable_images(self.feeds, time.monotonic_ns(),
                                                         float(self.params["max_image_age_s"]),
                                                         int(self.params["frozen_after"]))
        if self.stale or not images:
            self.refused_requests += 1
            why = "; ".join(self.stale) if self.stale else "no camera image yet"
            self._refuse(f"prefix request {req.request_seq} refused (the robot holds): {why}")
            self._publish_diagnostics()
            return
        note = PrefixRequestNote(int(req.request_seq), int(req.start_tick), tuple(req.state), req.task,
                                 int(getattr(req, "episode", 0)))
        ask = self._ask if self.stage.query is not None else None
        try:
            slot = self.stage.encode(note, images, ask)
        except (ValueError, InputError) as e:
            self.refused_requests += 1
            self._refuse(f"prefix request {req.request_seq} refused: {e}")
            self._publish_diagnostics()
            return
        if self.gate.closing:   # finished during shutdown: the context may already be gone
            return
        out = SlotReady()
        out.header.stamp = self.get_clock().now().to_msg()
        out.ring, out.slot, out.sequence, out.layout_tag = slot.ring, slot.slot, slot.seq, slot.layout_tag
        self.ready_pub.publish(out)
        self.calls += 1
        self._publish_diagnostics()

    def _publish_diagnostics(self) -> None:
        times = self.stage.last_timer.times.seconds if self.stage.last_timer is not None else {}
        choice = self.stage.last_choice
        values = {f"{k}_s": f"{t:.4f}" for k, t in times.items()}
        values |= {"calls": str(self.calls), "missing_cameras": ",".join(self.missing),
                   "stale_cameras": "; ".join(self.stale), "refused_images": str(self.refused_images),
                   "refused_requests": str(self.refused_requests), "last_refusal": self.last_refusal,
                   "reference": "" if choice is None or not choice.found else f"{choice.episode}:{choice.index}",
                   "context_cache": str(self.stage.worker.last_context is not None),
                   "dense_reason": "" if choice is None else choice.reason}
        warn = ("camera(s) stale, calls refused: " + "; ".join(self.stale) if self.stale else
                "camera(s) missing: " + ", ".join(self.missing) if self.missing else "")
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: vision", self.profile.name, values, warn))

    def destroy_node(self) -> None:
        if self.gate.close(SHUTDOWN_WAIT_S, wake=self._reply_ready.set):
            self.stage.close()
        else:   # unmapping under a running call would fault; the next start replaces the segments
            self.get_logger().error(f"a call was still running {SHUTDOWN_WAIT_S} s after shutdown began: "
                                    "leaving the ring buffers to the next start")
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    run(VisionNode, threads=3, args=args)


if __name__ == "__main__":
    main()
