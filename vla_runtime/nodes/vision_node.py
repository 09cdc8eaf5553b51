"""The vision node: camera images + a prefix request -> a prefix slot in the ring buffer.

Thin rclpy wiring around ``VisionStage``: it keeps the newest image of every camera (converted
and validated at the boundary), and for each ``PrefixRequest`` from the policy node writes the
prefix K/V of every VLM layer into the next ring slot and announces it with ``SlotReady``. With
the cache enabled it selects the reference itself, between the vision tower and the prefill,
from the window the cache manager publishes in shared memory (``selection.py``), and tells the
cache manager afterwards what it chose (``ReferenceSelection``); it never waits for it.

Camera messages are checked at the boundary (``conversions``): encoding, size, stamps from the
future or too old; a camera that stops sending new frames or freezes (the same stamp again and
again) is stale, and a request is then refused (the policy node's watchdog holds the robot)
until it sends new frames. Diagnostics go out after every call, every refusal and once a second; they report the policy
node as an ERROR, by name, when its own diagnostics stop for ``peer_timeout_s`` (it died: the
robot's controller holds as for any silent publisher, and the launch does not restart it).

A managed (lifecycle) node (``managed.ManagedNode``): configure loads, warms up and creates the
prefix ring, activate starts prefilling, deactivate stops it, cleanup releases the ring and weights.
"""

from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from vla_runtime.msg import PrefixRequest, ReferenceSelection, SlotReady

from ..io.messages import InputError, image_from_msg
from .conversions import CameraFeed, StampCheck, stamp_ns, usable_images
from .diagnostics import DIAGNOSTICS_TOPIC, POLICY_STATUS, diagnostic_array
from .managed import ManagedNode
from .params import VISION, profile_and_checkpoint, ring_names
from .prefix_ring import AHEAD_TOPIC, READY_TOPIC, REQUEST_TOPIC, SELECTION_TOPIC
from .call_thread import CallThread
from .spin import CallbackGate, gated, run
from .stages import PrefixRequestNote, Selection, SlotNote, VisionStage, load_policy

PARAMETERS = VISION


class VisionNode(ManagedNode):
    """Managed: configure loads and warms up the model, creates the prefix ring and subscribes to
    the cameras (their feeds stay fresh while inactive); activate starts answering prefix
    requests (inactive, a request is counted and not prefilled: the policy holds); cleanup
    unmaps and unlinks the ring and drops the weights."""

    def __init__(self) -> None:
        super().__init__("vla_vision", PARAMETERS)
        self.gate = CallbackGate(closed=True)   # cleanup waits for the call in flight before closing the rings
        # the prefill, and what must not run beside it (heartbeat, status), off the executor (call_thread.py: why)
        self.call_thread = CallThread("vision-calls")
        self.stage: VisionStage | None = None
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)

    def _setup(self) -> None:
        v = self.params
        self.profile, ckpt = profile_and_checkpoint(v)
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras], self.profile.state_dim,
                             role="vision",
                             control_hz=self.profile.control_hz)
        cache = self.profile.cache if self.profile.cache.enabled else None
        self.stage = VisionStage(policy, ring_names(v, self.get_namespace()), int(v["ring_slots"]), cache, self.profile.arm_slices)
        self.stage.warm_up()
        self.feeds = {c.name: CameraFeed(c.name) for c in self.profile.cameras}
        self.refused_images = 0
        self.refused_requests = 0
        self.requests_while_inactive = 0
        self.last_refusal = ""
        self.stale: list[str] = []
        self.missing: list[str] = []
        self.calls = 0
        own = self.own
        for cam in self.profile.cameras:   # taken on the executor: frames keep arriving while a call is encoded
            kind = CompressedImage if cam.compressed else Image
            own(self.create_subscription(kind, cam.topic, lambda m, c=cam: self._on_image(c, m),
                                         qos_profile_sensor_data))
        own(self.create_subscription(PrefixRequest, REQUEST_TOPIC, self._take_request, 10))
        self.ready_pub = own(self.create_lifecycle_publisher(SlotReady, READY_TOPIC, 10))
        self.selection_pub = own(self.create_lifecycle_publisher(ReferenceSelection, SELECTION_TOPIC, 10)) \
            if self.stage.selector is not None else None
        if self.stage.selector is not None and self.stage.announces_ahead:
            self.ahead_pub = own(self.create_lifecycle_publisher(SlotReady, AHEAD_TOPIC, 10))
            self.stage.ahead = self._announce_ahead
        self.watch_peers({POLICY_STATUS: "policy"})
        own(self.create_timer(0.1, lambda: self.call_thread.submit(self._heartbeat, coalesce=True)))
        own(self.create_timer(1.0, lambda: self.call_thread.submit(self._publish_diagnostics, coalesce=True)))
        self.gate.open()
        self.get_logger().info(f"vision node configured: profile {self.profile.name}, checkpoint {ckpt}, ring "
                               f"{self.stage.prefix.name}, cache {'on' if self.stage.selector is not None else 'off'}")

    def _announce_ahead(self, note: SlotNote) -> None:
        """(The call thread, before the prefill) the working-set entry this call will use: the
        policy node gathers its Action Cache weights while the prefill runs."""
        self.ahead_pub.publish(self._slot_ready(note))

    def _slot_ready(self, note: SlotNote) -> SlotReady:
        out = SlotReady()
        out.header.stamp = self.get_clock().now().to_msg()
        out.ring, out.slot, out.sequence, out.layout_tag = note.ring, note.slot, note.seq, note.layout_tag
        return out

    def _stamps(self) -> StampCheck:
        return StampCheck(float(self.params["max_input_age_s"]), float(self.params["max_future_s"]))

    def _refuse(self, what: str) -> None:
        self.last_refusal = what
        self.get_logger().warning(what, throttle_duration_sec=2.0)

    def _on_image(self, cam, msg) -> None:
        stamp, now = stamp_ns(msg), self.get_clock().now().nanoseconds
        if now == 0:   # use_sim_time before the first /clock: no time to judge the frame against yet
            return

        def accept():   # a new frame only: a repeated stamp is counted before its age is judged, so
            #             a frozen driver is reported as frozen rather than as sending old frames
            self._stamps().check(stamp, now, f"camera {cam.name!r}")
            return image_from_msg(msg, cam.compressed, cam.name)

        try:
            self.feeds[cam.name].offer(stamp, now, accept)
        except InputError as e:
            self.refused_images += 1
            self._refuse(f"image refused: {e}")

    def _publish_selection(self, sel: Selection) -> None:
        m = sel.match
        msg = ReferenceSelection(request_seq=sel.request_seq, task=sel.task, episode=sel.episode, found=m is not None,
                                 episode_id=m.episode_id if m else "", index=m.index if m else -1,
                                 similarity=float(m.similarity) if m else float("nan"), candidates=list(sel.candidates),
                                 reason=sel.reason, restart=sel.restart, dense_for_episode=sel.dense_for_episode)
        msg.header.stamp = self.get_clock().now().to_msg()
        self.selection_pub.publish(msg)

    @gated
    def _heartbeat(self) -> None:   # on the call thread, between calls: also the stage's idle work
        self.stage.heartbeat()
        self.stage.idle()

    def _take_request(self, req: PrefixRequest) -> None:
        """(The executor's thread) hand the request to the call thread, where it is prefilled."""
        if not self.call_thread.submit(self._on_request, req):
            self.refused_requests += 1
            self._refuse(f"prefix request {req.request_seq} dropped: {self.call_thread.name} is behind")

    @gated
    def _on_request(self, req: PrefixRequest) -> None:
        if not self.active:   # configured but not active: no prefill (the policy holds until activation)
            self.requests_while_inactive += 1
            return
        images, self.missing, self.stale = usable_images(self.feeds, self.get_clock().now().nanoseconds,
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
        try:
            slot = self.stage.encode(note, images)
        except (ValueError, InputError) as e:
            self.refused_requests += 1
            self._refuse(f"prefix request {req.request_seq} refused: {e}")
            self._publish_diagnostics()
            return
        if self.gate.closing:   # finished during shutdown: the context may already be gone
            return
        self.ready_pub.publish(self._slot_ready(slot))
        if self.selection_pub is not None and self.stage.last_selection is not None:
            self._publish_selection(self.stage.last_selection)
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
        values["cache_halves"] = self.stage.cache_reason
        if self.stage.selector is not None:
            values |= self.stage.selector.diagnostics()
        peers, silent, unheard = self.peer_health()
        values |= peers | {"lifecycle": self.state_label, "requests_while_inactive": str(self.requests_while_inactive)}
        warn = ("camera(s) stale, calls refused: " + "; ".join(self.stale) if self.stale else
                "camera(s) missing: " + ", ".join(self.missing) if self.missing else "")
        warn = "; ".join(w for w in (warn, unheard) if w)
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: vision", self.profile.name, values, warn, silent))


def main(args: list[str] | None = None) -> None:
    run(VisionNode, "vla_vision", args=args)


if __name__ == "__main__":
    main()
