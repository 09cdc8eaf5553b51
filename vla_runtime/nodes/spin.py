"""The entry point every node shares: init, spin, clean shutdown (also on Ctrl-C)."""

from __future__ import annotations

import signal
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
        # Ctrl-C in a terminal reaches the node twice (directly and relayed by ros2 launch): the
        # clean-up (closing the ring buffer, destroying the node) must not be cut by the second.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
