"""The cache manager node: the window of references from the robot's own past executions.

Thin rclpy wiring around ``CacheStage``. It owns the reference repository and the working set
(shared memory) the vision node selects from. It is never on a call's path: each
``ReferenceSelection`` (what the vision node chose, after the fact) slides the working set once
the policy has published that call's chunk (``after_call.AfterCall``), reconstructing the entries
that enter the window while the robot executes the chunk, at a lower CPU priority than the nodes
that serve calls (``cache.background_nice``). A disabled or refused
cache publishes no window, so the vision node runs dense and says why.

A managed (lifecycle) node (``managed.ManagedNode``): configure loads the model and creates the
working set, activate starts following selections and episodes, cleanup releases the working
set and weights. Its diagnostics report the policy node as an ERROR, by name, when the policy's
own diagnostics stop for ``peer_timeout_s``.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray
from std_msgs.msg import Empty, String

from vla_runtime.msg import ActionChunk, ReferenceSelection

from ..cache.retrieval import Match
from ..io.messages import InputError
from .after_call import AfterCall
from .conversions import instruction_from_msg
from .diagnostics import DIAGNOSTICS_TOPIC, POLICY_STATUS, diagnostic_array
from .managed import ManagedNode
from .params import CACHE_MANAGER, profile_and_checkpoint, ring_names
from .prefix_ring import CHUNK_TOPIC, EPISODE_TOPIC, SELECTION_TOPIC, subscribe_instruction
from .priority import background_priority
from .spin import run
from .stages import CacheStage, Selection, load_policy

PARAMETERS = CACHE_MANAGER


class CacheManagerNode(ManagedNode):
    """Managed: configure loads the model, opens the repository and creates the working set;
    activate starts following the selections and announced episodes (inactive, the published
    window stays as it is and the vision node keeps selecting from it); cleanup unmaps and
    unlinks the working set and drops the weights."""

    def __init__(self) -> None:
        super().__init__("vla_cache_manager", PARAMETERS)
        self.stage: CacheStage | None = None
        self.nice: int | None = None   # lowered once per process, at the first configure
        self.after_call = AfterCall()  # selections held until their call's chunk is out
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)

    def _setup(self) -> None:
        v = self.params
        self.profile, ckpt = profile_and_checkpoint(v)
        prof = self.profile
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras], prof.state_dim,
                             role="cache",
                             control_hz=self.profile.control_hz)
        self.chunk_s = policy.engine.cfg.chunk_size / prof.control_hz
        self.time_available_s = float(v["time_available_s"]) or self.chunk_s
        self.last_upkeep_s = 0.0
        if self.nice is None:   # once per process: a nice value, once raised, cannot go back down
            self.nice = background_priority(prof.cache.background_nice)
        self.stage = CacheStage(policy, prof.cache, ring_names(v, self.get_namespace()), prof.arm_slices)
        self.after_call.clear()
        own = self.own
        own(self.create_subscription(ReferenceSelection, SELECTION_TOPIC, self._on_selection, 10))
        own(self.create_subscription(ActionChunk, CHUNK_TOPIC, self._on_chunk, 10))
        own(self.create_timer(0.1, self._on_wait_over))
        self.episode = 0   # counted from EPISODE_TOPIC as the policy node counts it (its requests carry it)
        own(self.create_subscription(Empty, EPISODE_TOPIC, self._on_episode_start, 10))
        for sub in subscribe_instruction(self, prof.instruction_topic, self._on_instruction):   # latched or not
            own(sub)
        self.watch_peers({POLICY_STATUS: "policy"})
        own(self.create_timer(0.1, self.stage.heartbeat))
        own(self.create_timer(1.0, self._publish_diagnostics))
        state = f"on, fallback: {self.stage.fallback_rule}" if self.stage.enabled else \
            f"off ({self.stage.disabled_reason})"
        self.get_logger().info(f"cache manager configured: profile {prof.name}, repository {prof.cache.repository}, "
                               f"cache {state}")

    def _on_selection(self, msg: ReferenceSelection) -> None:
        if not self.active:   # inactive: the window stays as published
            return
        match = Match(msg.episode_id, int(msg.index), float(msg.similarity), float("nan")) if msg.found else None
        sel = Selection(int(msg.request_seq), msg.task, int(msg.episode), match, tuple(msg.candidates), msg.reason,
                        bool(msg.restart), bool(msg.dense_for_episode))
        self._follow(self.after_call.add(sel, time.monotonic()))

    def _on_chunk(self, msg: ActionChunk) -> None:
        """The policy published a call's chunk: the calls up to it are over, their selections due."""
        if self.active:
            self._follow(self.after_call.chunk_published(int(msg.call_id), time.monotonic()))

    def _on_wait_over(self) -> None:
        if self.active:
            self._follow(self.after_call.overdue(time.monotonic()))

    def _follow(self, selections: list[Selection]) -> None:
        """Slide the window after the calls that selected ``selections`` (each followed in turn,
        one upkeep for all)."""
        if not selections:
            return
        t0 = time.perf_counter()
        try:
            for sel in selections:
                self.stage.follow(sel)
            self.stage.upkeep(self.time_available_s)
        except (ValueError, RuntimeError, OSError) as e:   # a broken episode file: dense from now, robot unaffected
            self.get_logger().error(f"working-set upkeep failed, no more references are prepared: {e}")
            self.stage.disable(f"upkeep failed: {e}")
        self.last_upkeep_s = time.perf_counter() - t0
        self._publish_diagnostics()

    def _disable(self) -> None:
        """Deactivated: stop following, and drop the selections held for calls still running."""
        super()._disable()
        self.after_call.clear()

    def _on_instruction(self, msg: String) -> None:
        """A new instruction: prepare its task's initial window now, before the first call needs
        it (a call finding no window of its task runs dense; it never waits). Heard while
        inactive too: the notes of other tasks are dropped from activation on."""
        try:
            task = instruction_from_msg(msg)
        except InputError:
            return   # the policy node refuses it and says why
        stage = self.stage
        if stage is None:   # released (cleanup) while the message was on its way
            return
        stage.instruct(task)
        if not self.active:
            return
        w = stage.worker
        if w is not None and task != w.manager.task:
            self._begin(task)

    def _on_episode_start(self, _msg: Empty) -> None:
        """The same task starts again: load its initial window now, while the robot resets, not in
        the first call. The policy node numbers episodes from the same message; should the two
        counts ever differ, the first selection note starts the episode itself (only later)."""
        self.episode += 1
        w = self.stage.worker
        if not self.active:
            return
        if w is not None and w.manager.task is not None:
            self._begin(w.manager.task)

    def _begin(self, task: str) -> None:
        t0 = time.perf_counter()
        self.stage.begin(task, self.episode)
        self.get_logger().info(f"episode {self.episode} of {task!r} prepared ahead in {time.perf_counter() - t0:.3f} s")

    def _on_parameter(self, name: str, value: object) -> None:
        super()._on_parameter(name, value)
        if name == "time_available_s" and self.stage is not None:   # from the next call's upkeep on
            self.time_available_s = float(value) or self.chunk_s

    def _publish_diagnostics(self) -> None:
        values = {"upkeep_s": f"{self.last_upkeep_s:.4f}", "selections_held": str(len(self.after_call)),
                  "nice": str(self.nice),
                  "enabled": str(self.stage.enabled), "time_available_s": f"{self.time_available_s:.3f}",
                  "notes_of_other_tasks": str(self.stage.notes_of_other_tasks)}
        if self.stage.worker is not None:
            values |= self.stage.worker.diagnostics()
        if self.stage.gate is not None:   # what waiting for the gaps between calls cost the upkeep
            g = self.stage.gate.stats
            values |= {"upkeep_waits": str(g.waits), "upkeep_waited_s": f"{g.waited_s:.3f}",
                       "upkeep_waits_bounded": str(g.gave_up)}
        peers, silent, unheard = self.peer_health()
        values |= peers | {"lifecycle": self.state_label}
        warn = "" if self.stage.enabled else f"cache disabled: {self.stage.disabled_reason}"
        warn = "; ".join(w for w in (warn, unheard) if w)
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: cache manager", self.profile.name, values, warn,
                                               silent))


def main(args: list[str] | None = None) -> None:
    run(CacheManagerNode, "vla_cache_manager", args=args)


if __name__ == "__main__":
    main()
