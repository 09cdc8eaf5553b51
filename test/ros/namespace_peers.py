"""Driver for test_namespaces.py, run inside one private network namespace (not a test module).

    python namespace_peers.py run SPEC_JSON

Two complete pipelines (cache manager, vision, policy) in two ROS namespaces, every node with
use_sim_time, driven by one simulated clock: this process publishes /clock (starting at
``clock_start`` s, advancing with the wall clock) and plays two robots, one per namespace, each
with its own instruction, images and joint states stamped in simulated time. It records what
each namespace's controller topic, chunk topic and diagnostics receive, which shared-memory rings
exist while both run, and the exit statuses after Ctrl-C; the report is the last line of stdout.
SPEC_JSON: {"profile": path (relative topics), "logs": folder, "images": {camera: [[...]]},
"state": [...], "tasks": {namespace: task}, "cameras": {camera: relative topic},
"clock_start": seconds, "timeout": seconds per wait}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from vla_runtime.testing.netns import assert_only_loopback
from vla_runtime.testing.scenarios import rgb_image, spin_until

NODES = ("cache_manager_node", "vision_node", "policy_node")


def start_node(name: str, ns: str, spec: dict) -> subprocess.Popen:
    log = open(os.path.join(spec["logs"], f"{ns}_{name}.log"), "a")
    return subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{name}", "--ros-args", "-r", f"__ns:=/{ns}",
                             "-p", f"profile:={spec['profile']}", "-p", "use_sim_time:=true"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def run(spec: dict) -> int:
    assert_only_loopback()
    import numpy as np
    import rclpy
    from builtin_interfaces.msg import Time
    from diagnostic_msgs.msg import DiagnosticArray
    from rosgraph_msgs.msg import Clock
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String
    from trajectory_msgs.msg import JointTrajectory

    from vla_runtime.msg import ActionChunk

    rclpy.init()
    node = rclpy.create_node("test_robots")
    namespaces = list(spec["tasks"])
    wall0, sim0 = time.monotonic(), int(spec["clock_start"] * 1e9)

    def sim_ns() -> int:
        return sim0 + int((time.monotonic() - wall0) * 1e9)

    clock = node.create_publisher(Clock, "/clock", 10)
    got: dict = {ns: {"trajectories": [], "chunks": 0} for ns in namespaces + ["root"]}
    diag: dict = {}

    def on_traj(ns: str, m) -> None:
        stamp = m.header.stamp.sec * 10**9 + m.header.stamp.nanosec
        got[ns]["trajectories"].append((stamp, sim_ns()))

    def on_diag(m) -> None:
        for s in m.status:
            diag[s.name] = {kv.key: kv.value for kv in s.values}

    for ns in namespaces:
        node.create_subscription(JointTrajectory, f"/{ns}/joint_trajectory_controller/joint_trajectory",
                                 lambda m, ns=ns: on_traj(ns, m), 50)
        node.create_subscription(ActionChunk, f"/{ns}/vla_runtime/action_chunk",
                                 lambda m, ns=ns: got[ns].__setitem__("chunks", got[ns]["chunks"] + 1), 50)
    node.create_subscription(JointTrajectory, "/joint_trajectory_controller/joint_trajectory",
                             lambda m: on_traj("root", m), 50)   # nothing may arrive outside the namespaces
    node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 100)
    pubs = {ns: {"cams": {c: node.create_publisher(Image, f"/{ns}/{t}", 10) for c, t in spec["cameras"].items()},
                 "joints": node.create_publisher(JointState, f"/{ns}/joint_states", 10),
                 "instruction": node.create_publisher(String, f"/{ns}/instruction", 10)} for ns in namespaces}
    images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}
    names = list(spec["joint_names"])

    def publish() -> None:
        now = sim_ns()
        clock.publish(Clock(clock=Time(sec=now // 10**9, nanosec=now % 10**9)))
        stamp = Time(sec=now // 10**9, nanosec=now % 10**9)
        for ns, p in pubs.items():
            for c, pub in p["cams"].items():
                pub.publish(rgb_image(images[c], stamp))
            js = JointState(name=names, position=[float(x) for x in spec["state"]])
            js.header.stamp = stamp
            p["joints"].publish(js)
            p["instruction"].publish(String(data=spec["tasks"][ns]))

    node.create_timer(0.05, publish)

    def policy(ns: str, key: str) -> str:
        return diag.get(f"/{ns}/vla_runtime: policy", {}).get(key, "")

    procs = {(ns, n): start_node(n, ns, spec) for ns in namespaces for n in NODES}
    report: dict = {}
    try:
        report["served"] = spin_until(node, lambda: all(len(got[ns]["trajectories"]) >= 3 for ns in namespaces),
                                      spec["timeout"] * 8)
        spin_until(node, lambda: all(policy(ns, "task") for ns in namespaces), spec["timeout"])
        # every node's status (a cache manager busy preparing its first window reports a little later)
        spin_until(node, lambda: {f"/{ns}/vla_runtime: {n}" for ns in namespaces
                                  for n in ("policy", "vision", "cache manager")} <= set(diag), spec["timeout"])
        report["rings"] = sorted(f for f in os.listdir("/dev/shm") if f.startswith(("vla_prefix", "vla_refs")))
        report["tasks"] = {ns: policy(ns, "task") for ns in namespaces}
        report["refused_joint_states"] = {ns: policy(ns, "refused_joint_states") for ns in namespaces}
        report["vision_calls"] = {ns: diag.get(f"/{ns}/vla_runtime: vision", {}).get("calls", "")
                                  for ns in namespaces}
        report["diagnostic_names"] = sorted(diag)
        report["chunks"] = {ns: got[ns]["chunks"] for ns in namespaces}
        report["root_trajectories"] = len(got["root"]["trajectories"])
        # header stamp of each trajectory against the simulated time it arrived at, in seconds
        report["stamps"] = {ns: [((s - sim0) / 1e9, (a - sim0) / 1e9) for s, a in got[ns]["trajectories"]]
                            for ns in namespaces}
        report["alive"] = {f"{ns}/{n}": p.poll() is None for (ns, n), p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        codes = {}
        for (ns, n), p in procs.items():
            try:
                codes[f"{ns}/{n}"] = p.wait(timeout=spec["timeout"])
            except subprocess.TimeoutExpired:
                p.kill()
                codes[f"{ns}/{n}"] = "killed"
        node.destroy_node()
        rclpy.try_shutdown()
    report["exit_codes"] = codes
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit({"run": run}[sys.argv[1]](json.loads(sys.argv[2])))
