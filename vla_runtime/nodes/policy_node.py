"""The policy node: joint states + prefix slots -> action chunks on the robot's controller topic.

Thin rclpy wiring around ``PolicyWorker`` and ``StreamingController``. A control tick runs at
the profile's rate (its own real-time thread, ``tick_loop.py``; a ROS timer with use_sim_time)
and records when it starts (``engine/tick_timing.py``): it advances the plan, and when the scheduler says so asks the vision node
for the next prefix, conditioned on the predicted state. When the vision node announces a slot,
the chunk is denoised (on the node's call thread, ``call_thread.py``, so joint states are still taken
and control ticks go on meanwhile), merged into
the plan, and the upcoming plan is published as a ``JointTrajectory`` stamped with the time its
first point takes effect, plus an ``ActionChunk`` with the chunk (clamped to the joint limits).

Safety at this boundary: joint states and instructions are checked by ``conversions`` (names,
lengths, NaN, stamps); a chunk with NaN/Inf, of a slot encoded before its request (a restarted
node's leftover) or arriving past the watchdog deadline is not executed; nothing published
leaves the joint limits; when the plan goes stale (no chunk within ``streaming.watchdog_s``) a
one-point trajectory at the held command replaces what the controller was executing.
Diagnostics go out after every chunk, on every hold and once a second.

A managed (lifecycle) node (``managed.ManagedNode``): configure loads and warms up the model,
activate starts the control timer, deactivate stops commanding and holds the robot where it is
(``lifecycle.hold_target``), cleanup releases the ring mapping and the weights.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from sensor_msgs.msg import JointState
from std_msgs.msg import Empty, Float64MultiArray, Int64MultiArray, String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from vla_runtime.msg import ActionChunk, PrefixRequest, SlotReady

from ..engine.controller import ControllerConfig, StreamingController
from ..engine.tick_timing import TickRecord
from ..io.messages import InputError, JointStateAssembler
from ..ipc.ring import RingBufferError
from .adapters import gripper_positions, group_commands, single_commands, trajectory_parts
from .conversions import StampCheck, chunk_to_trajectory, implausible_joints, instruction_from_msg, points_passed, stamp_ns
from .diagnostics import DIAGNOSTICS_TOPIC, POLICY_STATUS, diagnostic_array
from .lifecycle import hold_target
from .managed import SHUTDOWN_WAIT_S, ManagedNode
from .params import POLICY, profile_and_checkpoint, ring_names
from .priority import control_priority
from .request_timeout import Asked, RequestTimeout
from .prefix_ring import AHEAD_TOPIC, CHUNK_TOPIC, EPISODE_TOPIC, READY_TOPIC, REQUEST_TOPIC, subscribe_instruction
from .call_thread import CallThread
from .spin import CallbackGate, gated, run
from .tick_loop import TickLoop
from .stages import PolicyStage, SlotNote, cache_config, load_policy, open_repository_meta

PARAMETERS = POLICY


TICK_WINDOW_S = 10.0    # the tick timing in the diagnostics covers this much of the recent past
TICK_TOPIC = "vla_runtime/tick_starts"   # each second: the control ticks' start times (monotonic ns)


def _slot_note(msg: SlotReady) -> SlotNote:
    """A ``SlotReady`` message as the stage's note."""
    return SlotNote(msg.ring, int(msg.slot), int(msg.sequence), msg.layout_tag)


class PolicyNode(ManagedNode):
    """Managed: configure loads and warms up the model and makes the subscriptions and outputs;
    activate starts the control timer (commands and requests go out only while active);
    deactivate stops it and holds the robot where it is; cleanup releases the ring mapping and
    the weights. Diagnostics go out whenever the node is configured."""

    def __init__(self) -> None:
        super().__init__("vla_policy", PARAMETERS)
        self.lock = threading.Lock()
        # destroy_node / deactivate wait for the chunk in flight before closing the rings; open only while active
        self.gate = CallbackGate(closed=True)
        self.call_thread = CallThread("policy-calls")   # the denoising, off the executor (call_thread.py: why)
        self.stage: PolicyStage | None = None
        self.tick_timer = None              # with use_sim_time: the node clock's timer
        self.tick_loop: TickLoop | None = None   # otherwise: the tick's own real-time thread (tick_loop.py: why)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)

    # ------------------------------------------------------------ lifecycle
    def _setup(self) -> None:
        v = self.params
        self.profile, ckpt = profile_and_checkpoint(v)
        prof = self.profile
        # the call thread was started before the profile was known: it is set too (priority.py: why)
        self.nice = control_priority(prof.streaming.policy_nice, threads=[self.call_thread.native_id])
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras], prof.state_dim,
                             role="policy",
                             control_hz=self.profile.control_hz)
        cc = cache_config(prof.cache, open_repository_meta(prof.cache, policy))
        self.stage = PolicyStage(policy, ring_names(v, self.get_namespace()), cc, int(v["seed"]))
        self.stage.warm_up()
        self.chunk_size = policy.engine.cfg.chunk_size
        self._new_plan()
        self.joints = JointStateAssembler(prof.joint_names)
        self.task: str | None = None
        self.request_timeouts = 0
        self.timeout = RequestTimeout()   # the wait for an answer, raised by answers that came too late
        self.cached_calls = 0
        self.refused_joint_states = 0
        self.refused_instructions = 0
        self.instruction_changes = 0
        self.stale_slots = 0
        self.holds_published = 0
        self.last_refusal = ""
        self.last_latency_s = float("nan")
        self.implausible_joint_states = 0
        self.last_implausible = ""
        self.ticks = TickRecord(max(2, int(TICK_WINDOW_S * prof.control_hz)), 1.0 / prof.control_hz)
        own, lifecycle_pub = self.own, self.create_lifecycle_publisher
        for topic in prof.joint_states_topics:
            own(self.create_subscription(JointState, topic, self._on_joints, 10))
        # latched: an instruction published before this node started is still received
        for sub in subscribe_instruction(self, prof.instruction_topic, self._on_instruction):   # latched or not
            own(sub)
        self.episode = 0   # bumped by EPISODE_TOPIC: the same task again (e.g. the next part at a station)
        own(self.create_subscription(Empty, EPISODE_TOPIC, self._on_episode_start, 10))
        # lifecycle publishers: requests, chunks and commands go out only while active
        self.request_pub = own(lifecycle_pub(PrefixRequest, REQUEST_TOPIC, 10))
        self.chunk_pub = own(lifecycle_pub(ActionChunk, CHUNK_TOPIC, 10))
        self.group_cmd = self.single_cmd = None
        self.traj_pubs, self.group_pubs, self.single_pubs = [], [], []
        self.gripper_traj_pub = self.gripper_array_pub = None
        if prof.output.kind == "interbotix_joint_group":
            try:
                from interbotix_xs_msgs.msg import JointGroupCommand, JointSingleCommand
            except ImportError:
                raise ValueError(f"profile {prof.name!r}: output.kind interbotix_joint_group needs the "
                                 "interbotix_xs_msgs package (the Interbotix ROS 2 workspace); source it, or set "
                                 "output.kind: joint_trajectory with a trajectory controller topic") from None
            self.group_cmd, self.single_cmd = JointGroupCommand, JointSingleCommand
            self.group_pubs = [own(lifecycle_pub(JointGroupCommand, t, 10)) for t in prof.output.topics]
            self.single_pubs = [own(lifecycle_pub(JointSingleCommand, t, 10)) for t in prof.output.single_topics]
        else:
            self.traj_pubs = [own(lifecycle_pub(JointTrajectory, t, 10)) for t in prof.output.topics]
            if prof.output.gripper_kind == "joint_trajectory":
                self.gripper_traj_pub = own(lifecycle_pub(JointTrajectory, prof.output.gripper_topic, 10))
            elif prof.output.gripper_kind == "float64_array":
                self.gripper_array_pub = own(lifecycle_pub(Float64MultiArray, prof.output.gripper_topic, 10))
        own(self.create_subscription(SlotReady, READY_TOPIC, self._on_slot, 10))
        if self.stage.worker.buffers is not None:   # the Action Cache: its weights gathered ahead of the call
            own(self.create_subscription(SlotReady, AHEAD_TOPIC, self._on_ahead, 10))
        self.tick_pub = own(self.create_publisher(Int64MultiArray, TICK_TOPIC, 10))
        own(self.create_timer(1.0, self._every_second))
        self.get_logger().info(f"policy node configured: profile {prof.name}, {prof.control_hz} Hz, checkpoint "
                               f"{ckpt}, action cache {'on' if cc is not None else 'off'}")

    def _new_plan(self) -> None:
        """A fresh plan and clock: what an activation starts from (the last one's ticks are past)."""
        prof, s = self.profile, self.profile.streaming
        self.controller = StreamingController(
            ControllerConfig(control_hz=prof.control_hz, chunk_size=self.chunk_size,
                             action_dim=prof.state_dim, stitch=s.stitch, predictor=s.predictor,
                             max_obs_age_s=s.max_obs_age_s, watchdog_s=s.watchdog_s, on_stale=s.on_stale,
                             stream_horizon=s.stream_horizon),
            prof.joint_limits())
        self.t0_ns: int | None = None
        self.tick = -1
        self.requested_at: dict[int, Asked] = {}

    def _enable(self) -> None:
        with self.lock:
            self._new_plan()
        self.gate.open()
        period_s = 1.0 / self.profile.control_hz
        if self.get_parameter("use_sim_time").value:   # simulated time: the node clock's timer
            self.tick_timer = self.own(self.create_timer(period_s, self._on_tick,
                                                         callback_group=MutuallyExclusiveCallbackGroup()))
        else:
            self.tick_loop = TickLoop(period_s, self._on_tick, self.profile.streaming.tick_rt_priority)
            self.tick_loop.start()

    def _disable(self) -> None:
        """Stop commanding: no more ticks, wait for a chunk being computed (its result is not
        merged: the gate is closed), then hold the robot where it is (``hold_target``)."""
        if self.tick_timer is not None:
            self.drop(self.tick_timer)
            self.tick_timer = None
        if self.tick_loop is not None:
            if not self.tick_loop.stop():
                self.get_logger().error("the control tick did not end within 2 s")
            self.tick_loop = None
        self.call_thread.drop_pending()   # a slot taken while active is not denoised after a reactivation
        if not self.gate.close(SHUTDOWN_WAIT_S):
            self.get_logger().error(f"a chunk was still being computed {SHUTDOWN_WAIT_S} s after deactivation "
                                    "began: its result is dropped")
        with self.lock:
            target = hold_target(self.controller, self.joints.vector() if self.joints.complete() else None)
            if self.controller.in_flight is not None:
                self.requested_at.pop(self.controller.in_flight.request_seq, None)
                self.controller.abandon(max(self.tick, 0))
        if target is not None:
            self._publish_command(target)
            if self.traj_pubs:
                self._publish_hold(target, "deactivated: holding the robot where it is")

    @property
    def request_timeout_s(self) -> float:
        """The wait for a prefix request's answer now: the parameter, or longer on a machine
        where calls were seen to take longer (``request_timeout.RequestTimeout``)."""
        return self.timeout.seconds(float(self.params["request_timeout_s"]))

    def _now_ns(self) -> int:
        """This node's clock: ROS time, or /clock with use_sim_time (ticks, ages, latencies)."""
        return self.get_clock().now().nanoseconds

    def _refuse(self, what: str) -> None:
        self.last_refusal = what
        self.get_logger().warning(what, throttle_duration_sec=2.0)

    # ------------------------------------------------------------ inputs (validated in conversions)
    def _on_joints(self, msg: JointState) -> None:
        now = self._now_ns()
        if now == 0:   # use_sim_time before the first /clock: no time to judge the stamp against yet
            return
        try:
            StampCheck(float(self.params["max_input_age_s"]), float(self.params["max_future_s"])).check(
                stamp_ns(msg), now, "JointState")
            self.joints.update(msg, now)
        except InputError as e:
            self.refused_joint_states += 1
            self._refuse(f"joint state refused: {e}")
            return
        far = implausible_joints(self.joints, self.profile.joint_lower, self.profile.joint_upper)
        if far:   # finite, so taken (the safety filter keeps commands inside the limits), but said
            self.implausible_joint_states += 1
            self.last_implausible = "joint state implausible (units? wrong joint?): " + "; ".join(far)
            self.get_logger().warning(self.last_implausible, throttle_duration_sec=2.0)

    def _on_episode_start(self, _msg: Empty) -> None:
        self.episode += 1
        self.get_logger().info(f"episode {self.episode} starts: the cache manager starts a fresh window")

    def _on_instruction(self, msg: String) -> None:
        try:
            text = instruction_from_msg(msg)
        except InputError as e:
            self.refused_instructions += 1
            self._refuse(str(e))
            return
        if self.task is not None and text != self.task:
            # A new task: the call in flight was asked for the old one, its chunk is not merged
            # (the cache manager starts a new episode on the next query).
            self.instruction_changes += 1
            self.get_logger().info(f"instruction changed to {text!r}: the call in flight for the old one is dropped")
            with self.lock:
                if self.controller.in_flight is not None:
                    self.requested_at.pop(self.controller.in_flight.request_seq, None)
                    self.controller.abandon(max(self.tick, 0))
        self.task = text

    # ------------------------------------------------------------ control timer
    def _on_tick(self) -> None:
        self.ticks.add(time.monotonic_ns())   # when this tick really starts (its timing, in the diagnostics)
        if self.task is None or not self.joints.complete():
            return
        now_ns = self._now_ns()
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
                stale_events = self.controller.watchdog.stale_events
                command = self.controller.tick(tick)
                went_stale = self.controller.watchdog.stale_events > stale_events
                age = max(0.0, (now_ns - self.joints.oldest_stamp_ns()) * 1e-9)   # stale joint states: no call
                req = self.controller.maybe_request(tick, self.joints.vector(), age)
            except (ValueError, RuntimeError) as e:  # never let one bad tick stop the control loop
                self.get_logger().error(f"tick {tick}: {e}", throttle_duration_sec=1.0)
                return
        if went_stale and self.traj_pubs:
            self._publish_hold(command.action)
        self._publish_command(command.action)
        if req is not None:
            self.requested_at[req.request_seq] = Asked(now_ns * 1e-9, time.monotonic_ns())
            msg = PrefixRequest()
            msg.header.stamp = self.get_clock().now().to_msg()
            msg.request_seq, msg.start_tick = req.request_seq, req.start_tick
            msg.state, msg.task, msg.episode = [float(x) for x in req.state], self.task, self.episode
            self.request_pub.publish(msg)

    def _expire_request(self, tick: int) -> None:
        req = self.controller.in_flight
        asked = self.requested_at.get(req.request_seq) if req is not None else None
        if asked is not None and self._now_ns() * 1e-9 - asked.clock_s > self.request_timeout_s:
            self.get_logger().warning(f"prefix request {req.request_seq} unanswered after {self.request_timeout_s:g} s: "
                                      "asking again")
            self.timeout.give_up(req.request_seq, self.requested_at.pop(req.request_seq))
            self.request_timeouts += 1
            self.controller.abandon(tick)

    # ------------------------------------------------------------ chunks
    def _on_slot(self, msg: SlotReady) -> None:
        """(The executor's thread) hand the slot to the call thread: the denoising must not hold the executor."""
        if not self.call_thread.submit(self._take_slot, msg):
            self._refuse(f"slot {msg.slot} seq {msg.sequence} dropped: {self.call_thread.name} is behind")

    def _on_ahead(self, msg: SlotReady) -> None:
        """(The executor's thread) the coming call's reference: gathered on the call thread, in
        order with the calls; dropped when that thread is behind (the call then gathers itself)."""
        self.call_thread.submit(self._take_ahead, msg)

    @gated
    def _take_ahead(self, msg: SlotReady) -> None:
        self.stage.gather_ahead(_slot_note(msg))

    @gated
    def _take_slot(self, msg: SlotReady) -> None:
        in_flight = self.controller.in_flight
        if in_flight is None or self.requested_at.get(in_flight.request_seq) is None:
            return   # nothing asked (a slot for a request of an earlier run of this node, or abandoned)
        try:
            result = self.stage.act(_slot_note(msg))
        except (RingBufferError, ValueError, OSError) as e:  # a layout mismatch, a missing segment: report, stay safe
            self._refuse(f"slot {msg.slot} of ring {msg.ring!r} unusable: {e}")
            return
        if result is None:
            self.get_logger().warning(f"slot {msg.slot} seq {msg.sequence} was overwritten before it was read")
            return
        asked = self.requested_at.get(result.request_seq)
        late = self.timeout.take_given_up(result.request_seq)
        if asked is None and late is not None and result.meta.stamp_ns >= late.monotonic_ns:
            # the answer to a request given up on: too late for the plan, but it says how long a call takes here
            warning = self.timeout.late_answer(self._now_ns() * 1e-9 - late.clock_s, float(self.params["request_timeout_s"]))
            if warning:
                self.get_logger().warning(warning)
            return
        if asked is None or result.meta.stamp_ns < asked.monotonic_ns:
            # Encoded before this request was made: a leftover for a request of this node's
            # previous run (same request number after a restart), never this call's answer.
            self.stale_slots += 1
            self._refuse(f"slot for request {result.request_seq} was encoded before that request: ignored")
            return
        self.requested_at.pop(result.request_seq, None)
        latency = self._now_ns() * 1e-9 - asked.clock_s
        try:
            with self.lock:   # the latency and the call count move together (the diagnostics timer runs concurrently)
                self.last_latency_s = latency
                merged = self.controller.on_chunk(result.request_seq, result.chunk, max(self.tick, 0), latency)
                first, upcoming = self.controller.upcoming(max(self.tick, 0) + 1)
                self.cached_calls += int(merged and result.cached)
        except (ValueError, RuntimeError) as e:   # never let one chunk stop the node
            self._refuse(f"chunk of request {result.request_seq} not merged: {e}")
            return
        if not merged:
            if self.controller.last_rejection:
                self._refuse(self.controller.last_rejection)
            self._publish_diagnostics()
            return
        self._publish(result.request_seq, self.controller.within_limits(result.chunk), first, upcoming,
                      "cached" if result.cached else "dense")
        self._publish_diagnostics()

    def _publish_command(self, action: np.ndarray) -> None:
        """The outputs that take a command every control tick (none with trajectory controllers only)."""
        if self.gripper_array_pub is not None:   # a forward command controller: the command every tick
            fingers = gripper_positions(self.profile.output, action[None])[0]
            self.gripper_array_pub.publish(Float64MultiArray(data=[float(x) for x in fingers]))
        if self.group_cmd is not None:   # Interbotix arms take their commands every control tick
            for c in group_commands(self.profile.output, action):
                self.group_pubs[c.topic_index].publish(self.group_cmd(name=c.name, cmd=list(c.values)))
            for c in single_commands(self.profile.output, action):
                self.single_pubs[c.topic_index].publish(self.single_cmd(name=c.name, cmd=c.values[0]))

    def _publish_hold(self, action: np.ndarray, why: str = "") -> None:
        """The plan went stale (or the node is deactivated): a one-point trajectory at the held
        command, effective now, replaces what the trajectory controller is executing (it would
        otherwise play the stale plan out)."""
        self._send_plan(self.controller.within_limits(action[None]), self._now_ns(), "hold")
        self.holds_published += 1
        self.get_logger().warning(why or f"no fresh chunk within {self.profile.streaming.watchdog_s} s: holding")
        self._publish_diagnostics()

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
        passed = points_passed(first_ns, period, self._now_ns(), len(upcoming))
        if passed:   # a trajectory controller refuses a start in the past: begin at the next point due
            upcoming, first_ns = upcoming[passed:], first_ns + int(round(passed * period * 1e9))
        if len(upcoming):
            self._send_plan(upcoming, first_ns, "trajectory")

    def _send_plan(self, actions: np.ndarray, first_ns: int, what: str) -> None:
        """``actions`` [points, joints] from ``first_ns`` on to every trajectory output: each arm
        topic exactly its controller's joints, a gripper trajectory controller its finger joints."""
        prof = self.profile
        parts = [(self.traj_pubs[i], names, pos) for i, names, pos in
                 trajectory_parts(prof.output, prof.joint_names, actions)]
        if self.gripper_traj_pub is not None:
            parts.append((self.gripper_traj_pub, prof.output.gripper_joint_names,
                          gripper_positions(prof.output, actions)))
        for pub, names, positions in parts:
            try:
                traj = chunk_to_trajectory(positions, names, first_ns, 1.0 / prof.control_hz, JointTrajectory,
                                           JointTrajectoryPoint, lambda s, ns: Duration(sec=s, nanosec=ns),
                                           lambda s, ns: Time(sec=s, nanosec=ns))
            except InputError as e:
                self.get_logger().error(f"{what} not published: {e}")
                continue
            pub.publish(traj)

    def _every_second(self) -> None:
        """The tick start times since the last second (bench/control_tick.py), then the diagnostics."""
        self.tick_pub.publish(Int64MultiArray(data=self.ticks.drain()))
        self._publish_diagnostics()

    def _publish_diagnostics(self) -> None:
        """Health for rqt / diagnostic_aggregator: latency, holds, safety, watchdog, refusals, cache."""
        with self.lock:   # one consistent snapshot: calls counted with their latency
            values = self._diagnostic_values()
        values.update(self._tick_values())   # outside the lock: the tick takes it
        c = self.controller
        warn = ("plan stale: holding" if self.tick >= 0 and c.watchdog.is_stale(self.tick) else
                "plan went stale at least once" if c.watchdog.stale_events else "")
        self.diag_pub.publish(diagnostic_array(self, POLICY_STATUS, self.profile.name, values, warn))

    def _diagnostic_values(self) -> dict[str, str]:
        c = self.controller
        values = {"call_latency_s": f"{self.last_latency_s:.4f}",
                  "expected_latency_s": f"{c.scheduler.expected_latency_s():.4f}",
                  "calls": str(c.scheduler.counters.finished), "late_chunks": str(c.scheduler.counters.late),
                  "held_ticks": str(c.safety.counts.get("held", 0)),
                  "clamped_ticks": str(c.safety.counts.get("clamped", 0)),
                  "watchdog_stale_events": str(c.watchdog.stale_events), "request_timeouts": str(self.request_timeouts),
                  "request_wait_s": f"{self.request_timeout_s:.2f}",
                  "cached_calls": str(self.cached_calls),
                  # Action Cache weight gathers: ahead of the calls (reference_ahead) / on a call's path
                  "gathered_ahead": str(self.stage.gathered_ahead), "gathered_in_calls": str(self.stage.gathered_in_calls),
                  "rejected_chunks": str(c.rejected), "stale_slots": str(self.stale_slots),
                  "holds_published": str(self.holds_published),
                  "refused_joint_states": str(self.refused_joint_states),
                  "refused_instructions": str(self.refused_instructions),
                  "implausible_joint_states": str(self.implausible_joint_states),
                  "last_implausible": self.last_implausible,
                  "instruction_changes": str(self.instruction_changes), "task": self.task or "",
                  "last_refusal": self.last_refusal,
                  "plan_stale": str(self.tick >= 0 and c.watchdog.is_stale(self.tick)),
                  "lifecycle": self.state_label}
        return values

    def _tick_values(self) -> dict[str, str]:
        """The control tick's regularity over the last TICK_WINDOW_S, how it is scheduled, and the
        last tick that started over half a period late with where the other threads were."""
        t, loop = self.ticks.statistics(), self.tick_loop
        late = loop.late.ticks if loop is not None else ()
        return {"tick_period_p99_ms": f"{t.p99_ms:.2f}", "tick_period_max_ms": f"{t.max_ms:.2f}",
                "ticks_missed": str(self.ticks.missed), "tick_scheduling": self._tick_scheduling(),
                "nice": str(self.nice), "ticks_late": str(loop.late.count if loop is not None else 0),
                "last_late_tick": str(late[-1]) if late else ""}

    def _tick_scheduling(self) -> str:
        loop = self.tick_loop
        if loop is None:
            return "ROS timer (use_sim_time)" if self.tick_timer is not None else "not ticking (inactive)"
        if loop.priority_problem or loop.rt_priority == 0:
            return "own thread, ordinary priority" + (f" ({loop.priority_problem})" if loop.priority_problem else "")
        return f"own thread, SCHED_FIFO {loop.rt_priority}"


def main(args: list[str] | None = None) -> None:
    run(PolicyNode, "vla_policy", args=args)


if __name__ == "__main__":
    main()
