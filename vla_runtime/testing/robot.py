"""A robot played by a ROS scenario or benchmark process (rclpy, inside a private network
namespace), the node processes it talks to, and a client of their lifecycle services.

``TestRobot`` publishes camera frames, joint states and the instruction every 50 ms, as a robot
driver would, and records what the pipeline sends back: trajectories (checked finite and
within the joint limits), action chunks, prefix requests and every diagnostics status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .scenarios import rgb_image, spin_until

NODES = ("cache_manager_node", "vision_node", "policy_node")
NODE_NAMES = {"cache_manager_node": "vla_cache_manager", "vision_node": "vla_vision", "policy_node": "vla_policy"}
PERIOD_S = 0.05


def start_node(name: str, spec: dict, *extra: str) -> subprocess.Popen:
    """One node process on ``spec["profile"]``, with the run's own ring names (``spec["rings"]``)
    so that parallel runs never share shared memory, logging to ``spec["logs"]/<name>.log``."""
    sfx = spec["rings"]
    args = ["-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{sfx}"]
    if name == "vision_node":
        args += ["-p", f"ring:=prefix_{sfx}"]
    log = open(os.path.join(spec["logs"], f"{name}.log"), "a")
    return subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{name}", "--ros-args", *args, *extra],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def stop_nodes(procs: dict[str, subprocess.Popen], timeout: float = 15.0) -> dict[str, int]:
    """Ctrl-C every node still running, wait for each (SIGKILL after ``timeout``); exit statuses."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs.values():
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return {name: p.returncode for name, p in procs.items()}


def status_level(status: Any) -> int:
    level = status.level
    return int.from_bytes(level, "little") if isinstance(level, bytes) else int(level)


class TestRobot:
    """``spec``: {"images": {camera: [[...]]}, "state": [...], "task": str, "joint_names": [...],
    "lower": [...], "upper": [...], "cameras": {camera: topic}}; robot topics as in the sim
    profile (absolute), the pipeline's own topics and status names under ``namespace`` ('' or
    '/name': the nodes' namespace)."""

    __test__ = False   # not a pytest class

    def __init__(self, node: Any, spec: dict, namespace: str = ""):
        from diagnostic_msgs.msg import DiagnosticArray
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String
        from trajectory_msgs.msg import JointTrajectory

        from vla_runtime.msg import ActionChunk, PrefixRequest

        self.node = node
        self.namespace = namespace
        self.lower, self.upper = np.asarray(spec["lower"]), np.asarray(spec["upper"])
        self.trajectories: list[tuple[float, int, list[float]]] = []   # (time, points, first point)
        self.chunks: list[tuple[float, int, str]] = []                 # (time, call id, source)
        self.requests: list[float] = []
        self.violations: list[str] = []
        self.diag: dict[str, dict] = {}
        self.diag_log: list[tuple[float, str, dict]] = []
        node.create_subscription(JointTrajectory, "/joint_trajectory_controller/joint_trajectory", self._on_traj, 50)
        node.create_subscription(ActionChunk, f"{namespace}/vla_runtime/action_chunk", self._on_chunk, 50)
        node.create_subscription(PrefixRequest, f"{namespace}/vla_runtime/prefix_request",
                                 lambda m: self.requests.append(time.monotonic()), 50)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50)
        self.cams = {c: node.create_publisher(Image, t, 10) for c, t in spec["cameras"].items()}
        self.joints = node.create_publisher(JointState, "/joint_states", 10)
        self.instruction = node.create_publisher(String, "/instruction", 10)
        self.images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}
        self.names, self.state, self.task = list(spec["joint_names"]), [float(x) for x in spec["state"]], spec["task"]
        self._JointState, self._String = JointState, String
        node.create_timer(PERIOD_S, self.publish)

    def _check(self, values: Any, what: str) -> None:
        a = np.asarray(values, dtype=np.float64)
        if not np.isfinite(a).all() or (a < self.lower - 1e-9).any() or (a > self.upper + 1e-9).any():
            self.violations.append(f"{what}: {a.tolist()}")

    def _on_traj(self, m: Any) -> None:
        for p in m.points:
            self._check(p.positions, "trajectory point")
        self.trajectories.append((time.monotonic(), len(m.points), [float(x) for x in m.points[0].positions]))

    def _on_chunk(self, m: Any) -> None:
        self._check(np.asarray(m.actions).reshape(m.chunk_length, m.action_dim), f"action chunk {m.call_id}")
        self.chunks.append((time.monotonic(), int(m.call_id), m.source))

    def _on_diag(self, m: Any) -> None:
        for s in m.status:
            st = {"level": status_level(s), "message": s.message, **{kv.key: kv.value for kv in s.values}}
            self.diag[s.name] = st
            self.diag_log.append((time.monotonic(), s.name, st))

    def publish(self) -> None:
        stamp = self.node.get_clock().now().to_msg()
        for c, pub in self.cams.items():
            pub.publish(rgb_image(self.images[c], stamp))
        js = self._JointState(name=self.names, position=self.state)
        js.header.stamp = stamp
        self.joints.publish(js)
        self.instruction.publish(self._String(data=self.task))

    # ------------------------------------------------------------ waiting for what the pipeline does
    def spin_until(self, pred: Any, timeout: float) -> bool:
        return spin_until(self.node, pred, timeout)

    def chunks_since(self, t: float) -> int:
        return sum(1 for ct, _, _ in self.chunks if ct > t)

    def status(self, who: str, since: float = 0.0) -> list[dict]:
        """Every status of ``who`` ("policy", "vision", "cache manager") received after ``since``."""
        return [st for t, name, st in self.diag_log if t > since and name == self.status_name(who)]

    def first_status(self, who: str, since: float, pred: Any) -> float | None:
        """When the first status of ``who`` after ``since`` satisfying ``pred`` arrived."""
        return next((t for t, name, st in self.diag_log if t > since and name == self.status_name(who) and pred(st)),
                    None)

    def status_name(self, who: str) -> str:
        return f"{self.namespace}/vla_runtime: {who}" if self.namespace else f"vla_runtime: {who}"


class LifecycleClient:
    """The standard lifecycle services of one node (what ``ros2 lifecycle`` and nav2's lifecycle
    manager call): ``state()`` and ``change(transition label)``."""

    def __init__(self, node: Any, target: str, timeout: float):
        from lifecycle_msgs.srv import ChangeState, GetState

        self.node, self.timeout = node, timeout
        self._get = node.create_client(GetState, f"/{target}/get_state")
        self._change = node.create_client(ChangeState, f"/{target}/change_state")
        self._GetState, self._ChangeState = GetState, ChangeState

    def _call(self, client: Any, request: Any) -> Any:
        import rclpy

        if not client.wait_for_service(timeout_sec=self.timeout):
            raise TimeoutError(f"service {client.srv_name} not available")
        fut = client.call_async(request)
        rclpy.spin_until_future_complete(self.node, fut, timeout_sec=self.timeout)
        if not fut.done():
            raise TimeoutError(f"service {client.srv_name} did not answer in {self.timeout} s")
        return fut.result()

    def wait(self) -> bool:
        """Wait until the node's lifecycle services are up (its process has started)."""
        return self._get.wait_for_service(timeout_sec=self.timeout)

    def state(self) -> str:
        return self._call(self._get, self._GetState.Request()).current_state.label

    def change(self, label: str) -> bool:
        """Request the transition named ``label`` (configure, activate, deactivate, cleanup,
        shutdown); True when it succeeded."""
        from lifecycle_msgs.msg import Transition

        return bool(self._call(self._change, self._ChangeState.Request(transition=Transition(label=label))).success)
