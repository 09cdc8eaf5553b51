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

CAMERAS = ("top", "wrist")


def demo_robot(root: Path, sim_profile: Path) -> dict:
    """What ROS scenarios and benchmarks run on: a pi05-tiny demo checkpoint, a repository built
    from its reference episodes, the sim profile (``sim_profile``) pointed at both (cache on, 20 Hz,
    one torch thread per node), and the first frame of a held-out episode. Callers change a deep
    copy of the profile, never the dict itself."""
    import yaml

    from ..cache.builder import BuildConfig, build_repository
    from ..commands.demo import DemoSpec, demo_topics, make_demo
    from ..engine.policy import Pi05Policy
    from ..io.bags import list_episode_bags, read_episode

    demo = make_demo(root / "demo", DemoSpec(preset="pi05-tiny", episodes=3, held_out=1, steps_per_episode=20),
                     log=lambda m: None)
    builder = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMERAS))
    build_repository(builder, builder.checkpoint_hash, list_episode_bags(demo["references"]), root / "repo",
                     demo_topics(CAMERAS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    profile = yaml.safe_load(Path(sim_profile).read_text())
    profile["engine"].update(checkpoint=str(demo["checkpoint"]), preset="pi05-tiny", threads=1)
    profile["control_hz"] = 20.0
    profile["cache"] = {"enabled": True, "repository": str(root / "repo")}
    episode = read_episode(list_episode_bags(demo["held_out"])[0], demo_topics(CAMERAS), call_period=0.5)
    frame = episode.frames[0]
    return {"checkpoint": demo["checkpoint"], "repo": root / "repo", "profile": profile, "task": episode.task,
            "state": np.asarray(frame.state).tolist(),
            "images": {c: np.asarray(frame.images[c], dtype=np.uint8).tolist() for c in CAMERAS}}


def robot_spec(demo: dict, profile_path: Path, logs: Path, rings: str, timeout: float) -> dict:
    """The spec a scenario's ``TestRobot`` (``testing.robot``) and node processes start from."""
    profile = demo["profile"]
    return {"profile": str(profile_path), "logs": str(logs), "images": demo["images"], "state": demo["state"],
            "task": demo["task"], "joint_names": profile["joint_names"], "lower": profile["joint_lower"],
            "upper": profile["joint_upper"], "cameras": {c: v["topic"] for c, v in profile["cameras"].items()},
            "rings": rings, "timeout": timeout}


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
