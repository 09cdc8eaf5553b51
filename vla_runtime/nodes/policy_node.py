"""The policy node: joint states + prefix slots -> action chunks on the robot's controller topic.

Thin rclpy wiring around ``PolicyWorker`` and ``StreamingController``. A control timer ticks at
the profile's rate: it advances the plan, and when the scheduler says so asks the vision node
for the next prefix, conditioned on the predicted state. When the vision node announces a slot,
the chunk is denoised (in its own callback group, so control ticks go on meanwhile), merged into
the plan, and the upcoming plan is published as a ``JointTrajectory`` stamped with the time its
first point takes effect, plus an ``ActionChunk`` with the raw chunk.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from vla_runtime.msg import ActionChunk, PrefixRequest, SlotReady

from ..engine.controller import ControllerConfig, StreamingController
from ..engine.policy import Pi05Policy
from ..engine.safety import JointLimits
from ..ipc.ring import RingBuffer
from .conversions import InputError, JointStateAssembler, chunk_to_trajectory
from .prefix_ring import DEFAULT_RING, READY_TOPIC, REQUEST_TOPIC, prefix_layout
from .profile import load_profile
from .spin import run
from .workers import PolicyWorker, PrefixMeta, PrefixSlotSpec

META_KEYS = ("length", "valid_len", "cameras", "state_dim", "observation_seq", "stamp_ns")


class PolicyNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_policy")
        p = lambda name, default, text: self.declare_parameter(name, default, ParameterDescriptor(description=text))  # noqa: E731
        p("profile", "", "robot profile YAML (config/<robot>.yaml)")
        p("checkpoint", "", "checkpoint directory; overrides the profile's engine.checkpoint")
        p("ring", DEFAULT_RING, "name of the prefix ring buffer created by the vision node")
        p("seed", 0, "noise seed: call n uses seed * 1000003 + n (reproducible chunks)")
        p("request_timeout_s", 2.0, "a prefix request unanswered this long is abandoned and asked again "
                                    "(lost message, vision node restarting)")
        self.profile = prof = load_profile(self.get_parameter("profile").value)
        ckpt = self.get_parameter("checkpoint").value or prof.engine.checkpoint
        if not ckpt:
            raise ValueError("no checkpoint: set the 'checkpoint' parameter or engine.checkpoint in the profile")
        self.seed = int(self.get_parameter("seed").value)
        self.request_timeout_s = float(self.get_parameter("request_timeout_s").value)
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        policy = Pi05Policy.from_checkpoint(ckpt, camera_names=[c.name for c in prof.cameras])
        if policy.action_norm.dim != prof.state_dim:
            raise ValueError(f"checkpoint actions have {policy.action_norm.dim} dims, profile {prof.name!r} "
                             f"has {prof.state_dim} joints")
        self.worker = PolicyWorker(policy)
        self.layout = prefix_layout(PrefixSlotSpec.for_config(policy.engine.cfg, policy.engine.dtype))
        self.slot_buf = {f.name: torch.zeros(f.shape, dtype=f.dtype) for f in self.layout.fields}
        s = prof.streaming
        self.controller = StreamingController(
            ControllerConfig(control_hz=prof.control_hz, chunk_size=policy.engine.cfg.chunk_size,
                             action_dim=prof.state_dim, stitch=s.stitch, predictor=s.predictor,
                             max_obs_age_s=s.max_obs_age_s, watchdog_s=s.watchdog_s, on_stale=s.on_stale,
                             stream_horizon=s.stream_horizon),
            JointLimits(np.asarray(prof.joint_lower), np.asarray(prof.joint_upper),
                        None if prof.max_velocity is None else np.asarray(prof.max_velocity)))
        self.joints = JointStateAssembler(prof.joint_names)
        self.task: str | None = None
        self.ring: RingBuffer | None = None
        self.lock = threading.Lock()
        self.t0_ns: int | None = None
        self.tick = -1
        self.requested_at: dict[int, float] = {}
        for topic in prof.joint_states_topics:
            self.create_subscription(JointState, topic, self._on_joints, 10)
        self.create_subscription(String, prof.instruction_topic, self._on_instruction, 10)
        self.request_pub = self.create_publisher(PrefixRequest, REQUEST_TOPIC, 10)
        self.chunk_pub = self.create_publisher(ActionChunk, "/vla_runtime/action_chunk", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.request_timeouts = 0
        self.group_cmd = None
        if prof.output.kind == "interbotix_joint_group":
            try:
                from interbotix_xs_msgs.msg import JointGroupCommand
            except ImportError:
                raise ValueError(f"profile {prof.name!r}: output.kind interbotix_joint_group needs the "
                                 "interbotix_xs_msgs package (the Interbotix ROS 2 workspace); source it, or set "
                                 "output.kind: joint_trajectory with a trajectory controller topic") from None
            self.group_cmd = JointGroupCommand
            self.group_pubs = [self.create_publisher(JointGroupCommand, t, 10) for t in prof.output.topics]
            self.traj_pubs = []
        else:
            self.traj_pubs = [self.create_publisher(JointTrajectory, t, 10) for t in prof.output.topics]
        self.create_subscription(SlotReady, READY_TOPIC, self._on_slot, 10,
                                 callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(1.0 / prof.control_hz, self._on_tick, callback_group=MutuallyExclusiveCallbackGroup())
        self.get_logger().info(f"policy node up: profile {prof.name}, {prof.control_hz} Hz, checkpoint {ckpt}")

    # ------------------------------------------------------------ inputs (validated here)
    def _on_joints(self, msg: JointState) -> None:
        try:
            self.joints.update(msg, time.monotonic_ns())
        except InputError as e:
            self.get_logger().warning(f"joint state refused: {e}", throttle_duration_sec=2.0)

    def _on_instruction(self, msg: String) -> None:
        text = msg.data.strip()
        if not text:
            self.get_logger().warning("empty instruction ignored")
            return
        self.task = text

    # ------------------------------------------------------------ control timer
    def _on_tick(self) -> None:
        if self.task is None or not self.joints.complete():
            return
        now_ns = time.monotonic_ns()
        with self.lock:
            if self.t0_ns is None:
                self.t0_ns = now_ns
                self.controller.set_initial(self.joints.vector())
            tick = int(round((now_ns - self.t0_ns) * 1e-9 * self.profile.control_hz))
            if tick <= self.tick:       # timer jitter: this tick was already executed
                return
            self.tick = tick
            try:
                self._expire_request(tick)
                command = self.controller.tick(tick)
                age = max(0.0, (now_ns - self.joints.oldest_stamp_ns()) * 1e-9)   # stale joint states: no call
                req = self.controller.maybe_request(tick, self.joints.vector(), age)
            except (ValueError, RuntimeError) as e:  # never let one bad tick stop the control loop
                self.get_logger().error(f"tick {tick}: {e}", throttle_duration_sec=1.0)
                return
        if self.group_cmd is not None:   # Interbotix arms take one command per control tick, per group
            slices = self.profile.output.joint_slices or ((0, self.profile.state_dim),)
            for pub, group, (a, b) in zip(self.group_pubs, self.profile.output.groups, slices):
                pub.publish(self.group_cmd(name=group, cmd=[float(x) for x in command.action[a:b]]))
        if req is not None:
            self.requested_at[req.request_seq] = time.monotonic()
            msg = PrefixRequest()
            msg.header.stamp = self.get_clock().now().to_msg()
            msg.request_seq, msg.start_tick = req.request_seq, req.start_tick
            msg.state, msg.task = [float(x) for x in req.state], self.task
            self.request_pub.publish(msg)

    def _expire_request(self, tick: int) -> None:
        req = self.controller.in_flight
        if req is not None and time.monotonic() - self.requested_at.get(req.request_seq, time.monotonic()) \
                > self.request_timeout_s:
            self.get_logger().warning(f"prefix request {req.request_seq} unanswered after {self.request_timeout_s} s: "
                                      "asking again")
            self.requested_at.pop(req.request_seq, None)
            self.request_timeouts += 1
            self.controller.abandon(tick)

    # ------------------------------------------------------------ chunks
    def _on_slot(self, msg: SlotReady) -> None:
        if self.ring is None:
            try:
                self.ring = RingBuffer.attach(msg.ring, self.layout)
            except Exception as e:  # a layout mismatch or a missing segment: report, stay safe
                self.get_logger().error(f"cannot attach ring {msg.ring!r}: {e}")
                return
        info = self.ring.read(msg.slot, msg.sequence, self.slot_buf)
        if info is None or not isinstance(info.meta, dict):
            self.get_logger().warning(f"slot {msg.slot} seq {msg.sequence} was overwritten before it was read")
            return
        meta = PrefixMeta(**{k: int(info.meta[k]) for k in META_KEYS})
        request_seq = int(info.meta["request_seq"])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + request_seq)
        chunk = self.worker.act(self.slot_buf, meta, generator=gen)
        latency = time.monotonic() - self.requested_at.pop(request_seq, time.monotonic())
        with self.lock:
            merged = self.controller.on_chunk(request_seq, chunk, max(self.tick, 0), latency)
            first, upcoming = self.controller.upcoming(max(self.tick, 0) + 1)
        if not merged:
            return
        self._publish(request_seq, chunk, first, upcoming)
        self._publish_diagnostics(latency)

    def _publish(self, request_seq: int, chunk: np.ndarray, first_tick: int, upcoming: np.ndarray) -> None:
        prof = self.profile
        period = 1.0 / prof.control_hz
        first_ns = int(self.t0_ns + first_tick * period * 1e9) if self.t0_ns is not None else 0
        out = ActionChunk()
        out.header.stamp = self.get_clock().now().to_msg()
        out.call_id, out.observation_seq = request_seq, request_seq
        out.joint_names = list(prof.joint_names)
        out.control_period, out.chunk_length, out.action_dim = period, chunk.shape[0], chunk.shape[1]
        out.actions = [float(x) for x in chunk.reshape(-1)]
        out.source = "dense"
        self.chunk_pub.publish(out)
        if len(upcoming) == 0:
            return
        slices = prof.output.joint_slices or ((0, prof.state_dim),)
        for pub, (a, b) in zip(self.traj_pubs, slices):
            try:
                traj = chunk_to_trajectory(upcoming[:, a:b], prof.joint_names[a:b], first_ns, period, JointTrajectory,
                                           JointTrajectoryPoint, lambda s, ns: Duration(sec=s, nanosec=ns),
                                           lambda s, ns: Time(sec=s, nanosec=ns))
            except InputError as e:
                self.get_logger().error(f"trajectory not published: {e}")
                continue
            pub.publish(traj)


    def _publish_diagnostics(self, latency_s: float) -> None:
        """Per-call health for rqt / diagnostic_aggregator: latency, holds, safety, watchdog."""
        c = self.controller
        held = c.safety.counts.get("held", 0)
        status = DiagnosticStatus(name="vla_runtime: policy", hardware_id=self.profile.name,
                                  level=DiagnosticStatus.OK if c.watchdog.stale_events == 0 else DiagnosticStatus.WARN,
                                  message="streaming" if c.watchdog.stale_events == 0 else "plan went stale at least once")
        values = {"call_latency_s": f"{latency_s:.4f}", "expected_latency_s": f"{c.scheduler.expected_latency_s():.4f}",
                  "calls": str(c.scheduler.counters.finished), "late_chunks": str(c.scheduler.counters.late),
                  "held_ticks": str(held), "clamped_ticks": str(c.safety.counts.get("clamped", 0)),
                  "watchdog_stale_events": str(c.watchdog.stale_events), "request_timeouts": str(self.request_timeouts)}
        status.values = [KeyValue(key=k, value=v) for k, v in values.items()]
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self.diag_pub.publish(msg)


def main(args: list[str] | None = None) -> None:
    run(PolicyNode, threads=2, args=args)


if __name__ == "__main__":
    main()
