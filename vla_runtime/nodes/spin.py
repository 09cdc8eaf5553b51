"""The entry point every node shares: init, spin, clean shutdown (also on Ctrl-C)."""

from __future__ import annotations

from typing import Callable


def run(make_node: Callable[[], object], threads: int = 1, args: list[str] | None = None) -> None:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    rclpy.init(args=args)
    node = make_node()
    executor = MultiThreadedExecutor(num_threads=threads) if threads > 1 else SingleThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except KeyboardInterrupt:
        pass
    finally:
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
