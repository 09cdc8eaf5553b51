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

from vla_runtime.msg import ReferenceQuery, ReferenceReply

from .diagnostics import DIAGNOSTICS_TOPIC, diagnostic_array
from .params import declare_parameters, profile_and_checkpoint, ring_names
from .prefix_ring import QUERY_TOPIC, REPLY_TOPIC
from .spin import run
from .stages import CacheStage, QueryNote, load_policy

PARAMETERS = {
    "profile": ("", "robot profile YAML (config/<robot>.yaml); its cache section configures this node"),
    "checkpoint": ("", "checkpoint directory; overrides the profile's engine.checkpoint"),
    "query_ring": ("vla_query", "name of the vision node's retrieval-query ring buffer"),
    "working_set": ("vla_refs", "name of the working-set ring buffer this node creates"),
    "time_available_s": (0.0, "rebuild budget per call for entries entering the window (rMuscle T_avl), "
                              "seconds; 0: one chunk's execution time"),
}


class CacheManagerNode(Node):
    def __init__(self) -> None:
        super().__init__("vla_cache_manager")
        v = declare_parameters(self, PARAMETERS)
        self.profile, ckpt = profile_and_checkpoint(v)
        prof = self.profile
        t_avl = float(v["time_available_s"])
        if not 0 <= t_avl <= 3600:
            raise ValueError(f"time_available_s must be in [0, 3600] s, got {t_avl}")
        policy = load_policy(ckpt, self.profile.engine, [c.name for c in self.profile.cameras])
        self.time_available_s = t_avl or policy.engine.cfg.chunk_size / prof.control_hz
        self.stage = CacheStage(policy, prof.cache, ring_names(v), prof.arm_slices)
        self.reply_pub = self.create_publisher(ReferenceReply, REPLY_TOPIC, 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS_TOPIC, 10)
        self.create_subscription(ReferenceQuery, QUERY_TOPIC, self._on_query, 10)
        self.create_timer(0.1, self.stage.heartbeat)
        state = "on" if self.stage.enabled else f"off ({self.stage.disabled_reason})"
        self.get_logger().info(f"cache manager up: profile {prof.name}, repository {prof.cache.repository}, "
                               f"cache {state}")

    def _on_query(self, q: ReferenceQuery) -> None:
        t0 = time.perf_counter()
        choice = self.stage.answer(QueryNote(int(q.request_seq), q.task, int(q.slot), int(q.sequence)))
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
        self._publish_diagnostics(answer_s, time.perf_counter() - t0 - answer_s)

    def _publish_diagnostics(self, answer_s: float, upkeep_s: float) -> None:
        values = {"answer_s": f"{answer_s:.4f}", "upkeep_s": f"{upkeep_s:.4f}", "enabled": str(self.stage.enabled)}
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
