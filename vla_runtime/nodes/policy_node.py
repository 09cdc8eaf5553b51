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
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from vla_runtime.msg import ActionChunk, PrefixRequest, SlotReady

from ..engine.controller import ControllerConfig, StreamingController
from ..engine.safety import JointLimits
from ..ipc.ring import RingBufferError
from .adapters import group_commands, single_commands
from .conversions import InputError, JointStateAssembler, chunk_to_trajectory
from .diagnostics import DIAGNOSTICS_TOPIC, diagnostic_array
from .params import declare_parameters, profile_and_checkpoint, ring_names
from .prefix_ring import READY_TOPIC, REQUEST_TOPIC
from .spin import run
from .stages import PolicyStage, SlotNote, cache_config, load_policy, open_repository_meta

PARAMETERS = {
    "profile": ("", "robot profile YAML (config/<robot>.yaml)"),
    "checkpoint": ("", "checkpoint directory; overrides the profile's engine.checkpoint"),
    "working_set": ("vla_refs", "name of the cache manager's working-set ring buffer (Action Cache masks)"),
    "seed": (0, "noise seed: call n uses seed * 1000003 + n (reproducible chunks); >= 0"),
    "request_timeout_s": (2.0, "a prefix request unanswered this long is abandoned and asked again "
                               "(lost message, vision node restarting); in (0, 600]"),
}


class PolicyNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_policy")
        v = declare_parameters(self, PARAMETERS)
        self.profile, ckpt = profile_and_checkpoint(v)
        prof = self.profile
        if v["seed"] < 0:
            raise ValueError(f"seed must be >= 0, got {v['seed']}")
        self.request_timeout_s = float(v["request_timeout_s"])
        if not 0 < self.request_timeout_s <= 600:
            raise ValueError(f"request_timeout_s must be in (0, 600] s, got {self.request_timeout_s}")
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras])
        if policy.action_norm.dim != prof.state_dim:
            raise ValueError(f"checkpoint actions have {policy.action_norm.dim} dims, profile {prof.name!r} "
                             f"has {prof.state_dim} joints")
        cc = cache_config(prof.cache, open_repository_meta(prof.cache, policy))
        self.stage = PolicyStage(policy, ring_names(v), cc, int(v["seed"]))
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
        self.lock = threading.Lock()
        self.t0_ns: int | None = None
        self.tick = -1
        self.requested_at: dict[int, float] = {}
        self.request_timeouts = 0
        self.cached_calls = 0
        for topic in prof.joint_states_topics:
            self.create_subscription(JointState, topic, self._on_joints, 10)
        self.create_subscription(String, prof.instruction_topic, self._on_instruction, 10)
        self.request_pub = self.create_publisher(PrefixRequest, REQUEST_TOPIC, 10)
        self.chunk_pub = self.create_publisher(ActionChunk, "/vla_runtime/action_chunk", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)
        self.group_cmd = self.single_cmd = None
        self.traj_pubs, self.group_pubs, self.single_pubs = [], [], []
        if prof.output.kind == "interbotix_joint_group":
            try:
                from interbotix_xs_msgs.msg import JointGroupCommand, JointSingleCommand
            except ImportError:
                raise ValueError(f"profile {prof.name!r}: output.kind interbotix_joint_group needs the "
                                 "interbotix_xs_msgs package (the Interbotix ROS 2 workspace); source it, or set "
                                 "output.kind: joint_trajectory with a trajectory controller topic") from None
            self.group_cmd, self.single_cmd = JointGroupCommand, JointSingleCommand
            self.group_pubs = [self.create_publisher(JointGroupCommand, t, 10) for t in prof.output.topics]
            self.single_pubs = [self.create_publisher(JointSingleCommand, t, 10) for t in prof.output.single_topics]
        else:
            self.traj_pubs = [self.create_publisher(JointTrajectory, t, 10) for t in prof.output.topics]
        self.create_subscription(SlotReady, READY_TOPIC, self._on_slot, 10,
                                 callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(1.0 / prof.control_hz, self._on_tick, callback_group=MutuallyExclusiveCallbackGroup())
        self.get_logger().info(f"policy node up: profile {prof.name}, {prof.control_hz} Hz, checkpoint {ckpt}, "
                               f"action cache {'on' if cc is not None else 'off'}")

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
        if self.group_cmd is not None:   # Interbotix arms take their commands every control tick
            for c in group_commands(self.profile.output, command.action):
                self.group_pubs[c.topic_index].publish(self.group_cmd(name=c.name, cmd=list(c.values)))
            for c in single_commands(self.profile.output, command.action):
                self.single_pubs[c.topic_index].publish(self.single_cmd(name=c.name, cmd=c.values[0]))
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
        try:
            result = self.stage.act(SlotNote(msg.ring, int(msg.slot), int(msg.sequence)))
        except (RingBufferError, ValueError, OSError) as e:  # a layout mismatch, a missing segment: report, stay safe
            self.get_logger().error(f"slot {msg.slot} of ring {msg.ring!r} unusable: {e}", throttle_duration_sec=2.0)
            return
        if result is None:
            self.get_logger().warning(f"slot {msg.slot} seq {msg.sequence} was overwritten before it was read")
            return
        latency = time.monotonic() - self.requested_at.pop(result.request_seq, time.monotonic())
        with self.lock:
            merged = self.controller.on_chunk(result.request_seq, result.chunk, max(self.tick, 0), latency)
            first, upcoming = self.controller.upcoming(max(self.tick, 0) + 1)
        if not merged:
            return
        self.cached_calls += int(result.used_reference)
        self._publish(result.request_seq, result.chunk, first, upcoming, "cached" if result.used_reference else "dense")
        self._publish_diagnostics(latency)

    def _publish(self, request_seq: int, chunk: np.ndarray, first_tick: int, upcoming: np.ndarray,
                 source: str) -> None:
        prof = self.profile
        period = 1.0 / prof.control_hz
        first_ns = int(self.t0_ns + first_tick * period * 1e9) if self.t0_ns is not None else 0
        out = ActionChunk()
        out.header.stamp = self.get_clock().now().to_msg()
        out.call_id, out.observation_seq = request_seq, request_seq
        out.joint_names = list(prof.joint_names)
        out.control_period, out.chunk_length, out.action_dim = period, chunk.shape[0], chunk.shape[1]
        out.actions = [float(x) for x in chunk.reshape(-1)]
        out.source = source
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
        """Per-call health for rqt / diagnostic_aggregator: latency, holds, safety, watchdog, cache."""
        c = self.controller
        values = {"call_latency_s": f"{latency_s:.4f}", "expected_latency_s": f"{c.scheduler.expected_latency_s():.4f}",
                  "calls": str(c.scheduler.counters.finished), "late_chunks": str(c.scheduler.counters.late),
                  "held_ticks": str(c.safety.counts.get("held", 0)),
                  "clamped_ticks": str(c.safety.counts.get("clamped", 0)),
                  "watchdog_stale_events": str(c.watchdog.stale_events), "request_timeouts": str(self.request_timeouts),
                  "cached_calls": str(self.cached_calls), "masks_missed": str(self.stage.masks_missed)}
        warn = "plan went stale at least once" if c.watchdog.stale_events else ""
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: policy", self.profile.name, values, warn))

    def destroy_node(self) -> None:
        self.stage.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    run(PolicyNode, threads=2, args=args)


if __name__ == "__main__":
    main()
