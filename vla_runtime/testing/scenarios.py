"""Running a ROS scenario script (a test robot plus node processes) in a private network
namespace, and what its test robot publishes. The scripts themselves live next to their tests
(``test/ros/*_peers.py``); every one is called as ``script run SPEC_JSON`` and prints its JSON
report on the last line of stdout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .netns import ros_env, run_in_private_netns


def run_scenario(script: Path, spec: dict, install: Path, timeout: float, cwd: Path) -> dict:
    """The report of ``script`` run with ``spec`` in a private netns. Raises AssertionError with
    its stderr and the node logs (``spec["logs"]``, when given) if it fails or times out."""
    try:
        out = run_in_private_netns([sys.executable, str(script), "run", json.dumps(spec)], env=ros_env(install),
                                   timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script.name} timed out after {timeout} s; stderr:\n{exc.stderr}\n"
                             f"logs: {node_logs(spec)}") from None
    if out.returncode != 0:
        raise AssertionError(f"{script.name} failed:\n{out.stderr}\nlogs: {node_logs(spec)}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_logs(spec: dict, tail: int = 3000) -> str:
    """The end of every node log in ``spec["logs"]`` (empty without one)."""
    if not spec.get("logs"):
        return ""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(Path(spec["logs"]).glob("*.log")))


def rgb_image(img: np.ndarray, stamp: Any = None) -> Any:
    """A ``sensor_msgs/Image`` (rgb8) of an HxWx3 uint8 array; ``stamp`` a ``builtin_interfaces/Time``."""
    from sensor_msgs.msg import Image

    m = Image(height=img.shape[0], width=img.shape[1], encoding="rgb8", step=img.shape[1] * 3)
    m.data = np.ascontiguousarray(img, dtype=np.uint8).tobytes()
    if stamp is not None:
        m.header.stamp = stamp
    return m


def spin_until(node: Any, pred: Any, timeout: float) -> bool:
    """Spin the scenario's test node until ``pred()`` holds (True) or ``timeout`` s pass (False)."""
    import rclpy

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
        if pred():
            return True
    return False
