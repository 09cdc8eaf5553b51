"""The cache manager node: reference queries -> references from the robot's own past executions.

Thin rclpy wiring around ``CacheStage``. It owns the reference repository and the working set
(shared memory): for each ``ReferenceQuery`` of the vision node it retrieves a reference and
answers with a ``ReferenceReply``, then slides the working set (reconstructing entries that enter
the window) while the robot executes the chunk. A disabled or refused cache answers every query
with the reason, so the pipeline runs dense and says why.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.node import Node
from std_msgs.msg import Empty

from vla_runtime.msg import ReferenceQuery, ReferenceReply

from .diagnostics import DIAGNOSTICS_TOPIC, diagnostic_array
from .params import CACHE_MANAGER, declare_parameters, profile_and_checkpoint, ring_names
from .prefix_ring import EPISODE_TOPIC, QUERY_TOPIC, REPLY_TOPIC
from .spin import run
from .stages import CacheStage, QueryNote, load_policy

PARAMETERS = CACHE_MANAGER


class CacheManagerNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_cache_manager")
        v = declare_parameters(self, PARAMETERS, self._on_parameter)
        self.profile, ckpt = profile_and_checkpoint(v)
        prof = self.profile
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras], prof.state_dim)
        self.chunk_s = policy.engine.cfg.chunk_size / prof.control_hz
        self.time_available_s = float(v["time_available_s"]) or self.chunk_s
        self.last_answer_s = self.last_upkeep_s = 0.0
        self.stage = CacheStage(policy, prof.cache, ring_names(v), prof.arm_slices)
        self.reply_pub = self.create_publisher(ReferenceReply, REPLY_TOPIC, 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)
        self.create_subscription(ReferenceQuery, QUERY_TOPIC, self._on_query, 10)
        self.create_subscription(Empty, EPISODE_TOPIC, self._on_episode_start, 10)
        self.create_timer(0.1, self.stage.heartbeat)
        self.create_timer(1.0, self._publish_diagnostics)
        state = f"on, fallback: {self.stage.fallback_rule}" if self.stage.enabled else \
            f"off ({self.stage.disabled_reason})"
        self.get_logger().info(f"cache manager up: profile {prof.name}, repository {prof.cache.repository}, "
                               f"cache {state}")

    def _on_query(self, q: ReferenceQuery) -> None:
        t0 = time.perf_counter()
        choice = self.stage.answer(QueryNote(int(q.request_seq), q.task, int(q.slot), int(q.sequence), int(q.episode)))
        out = ReferenceReply(request_seq=choice.request_seq, found=choice.found, ring=self.stage.rings.working_set,
                             slot=max(choice.slot, 0), sequence=max(choice.seq, 0), episode_id=choice.episode,
                             index=choice.index, similarity=float(choice.similarity), reason=choice.reason)
        out.header.stamp = self.get_clock().now().to_msg()
        self.reply_pub.publish(out)
        answer_s = time.perf_counter() - t0
        try:
            self.stage.upkeep(self.time_available_s)
        except (ValueError, RuntimeError, OSError) as e:   # a broken episode file: dense from now, robot unaffected
            self.get_logger().error(f"working-set upkeep failed, cache answers dense from now on: {e}")
            self.stage.disable(f"upkeep failed: {e}")
        self.last_answer_s, self.last_upkeep_s = answer_s, time.perf_counter() - t0 - answer_s
        self._publish_diagnostics()

    def _on_episode_start(self, _msg: Empty) -> None:
        """The same task starts again: load its initial window now, while the robot resets, not in
        the first call. The policy node numbers episodes from the same message; should the two
        counts ever differ, the first query starts the episode itself (only slower)."""
        w = self.stage.worker
        if w is not None and w.manager.task is not None:
            t0 = time.perf_counter()
            self.stage.begin(w.manager.task, (w.episode or 0) + 1)
            self.get_logger().info(f"episode {w.episode} of {w.manager.task!r} prepared ahead in "
                                   f"{time.perf_counter() - t0:.3f} s")

    def _on_parameter(self, name: str, value: object) -> None:
        if name == "time_available_s":   # from the next call's upkeep on
            self.time_available_s = float(value) or self.chunk_s

    def _publish_diagnostics(self) -> None:
        values = {"answer_s": f"{self.last_answer_s:.4f}", "upkeep_s": f"{self.last_upkeep_s:.4f}",
                  "enabled": str(self.stage.enabled), "time_available_s": f"{self.time_available_s:.3f}"}
        if self.stage.worker is not None:
            values |= self.stage.worker.diagnostics()
        warn = "" if self.stage.enabled else f"cache disabled: {self.stage.disabled_reason}"
        self.diag_pub.publish(diagnostic_array(self, "vla_runtime: cache manager", self.profile.name, values, warn))

    def destroy_node(self) -> None:
        self.stage.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> None:
    run(CacheManagerNode, args=args)


if __name__ == "__main__":
    main()
