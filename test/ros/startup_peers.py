"""Driver for test_startup.py, run inside one private network namespace (not a test module).

    python startup_peers.py run SPEC_JSON

1. Start failures: each node started with something that cannot work (a missing checkpoint, a
   CUDA device where there is none, a bad parameter); its exit status and its stderr lines.
2. A latched instruction: published once (transient local) before any node starts, never again;
   then the three nodes start and a test robot sends images and joint states: the robot must get
   trajectories (the policy node received the instruction).
3. A finite but implausible joint state (100 rad): the policy node's diagnostics name the joint.
4. An instruction with a control character: refused, said in the diagnostics, the task goes on.
5. Ctrl-C (SIGINT, twice) to the three nodes: their exit statuses and whether their rings are gone (the
   test reads their logs for tracebacks).
Prints a JSON report on the last line of stdout. SPEC_JSON: {"profile": path, "logs": folder,
"images": {camera: [[...]]}, "state": [...], "task": str, "joint_names": [...], "cameras": {camera:
topic}, "rings": suffix, "failures": {case: [node, [ros args...]]}, "timeout": seconds per wait}.
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


def node_command(name: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", f"vla_runtime.nodes.{name}", "--ros-args", *args]


def start_failures(spec: dict) -> dict:
    """Each failure case's exit status and stderr lines (bounded wait)."""
    out = {}
    for case, (name, args) in spec["failures"].items():
        p = subprocess.run(node_command(name, args), capture_output=True, text=True, timeout=spec["timeout"] * 4)
        out[case] = {"returncode": p.returncode, "stderr": [ln for ln in p.stderr.splitlines() if ln.strip()]}
    return out


def start_node(name: str, spec: dict) -> subprocess.Popen:
    sfx = spec["rings"]
    args = ["-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{sfx}"]
    if name == "vision_node":
        args += ["-p", f"ring:=prefix_{sfx}"]
    log = open(os.path.join(spec["logs"], f"{name}.log"), "a")
    return subprocess.Popen(node_command(name, args), stdout=log, stderr=subprocess.STDOUT, text=True)


def run(spec: dict) -> int:
    assert_only_loopback()
    report: dict = {"start_failures": start_failures(spec)}

    import numpy as np
    import rclpy
    from builtin_interfaces.msg import Time
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String
    from trajectory_msgs.msg import JointTrajectory

    rclpy.init()
    node = rclpy.create_node("test_robot")
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    node.create_publisher(String, "/instruction", latched).publish(String(data=spec["task"]))   # once, before the nodes
    other = node.create_publisher(String, "/instruction", 10)   # a volatile publisher, for the bad instruction
    trajectories: list = []
    diag: dict = {}
    node.create_subscription(JointTrajectory, "/joint_trajectory_controller/joint_trajectory",
                             lambda m: trajectories.append(m), 50)

    def on_diag(m) -> None:
        s = m.status[0]
        diag[s.name] = {kv.key: kv.value for kv in s.values}

    node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 50)
    cams = {c: node.create_publisher(Image, t, 10) for c, t in spec["cameras"].items()}
    joints = node.create_publisher(JointState, "/joint_states", 10)
    images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}
    state = [float(x) for x in spec["state"]]
    names = list(spec["joint_names"])
    far = {"on": False, "bad_instruction": False}

    def publish() -> None:
        ns = node.get_clock().now().nanoseconds
        stamp = Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)
        for c, pub in cams.items():
            pub.publish(rgb_image(images[c], stamp))
        js = JointState(name=names, position=[100.0] + state[1:] if far["on"] else state)
        js.header.stamp = stamp
        joints.publish(js)
        if far["bad_instruction"]:   # until refused: a single message could go out before discovery
            other.publish(String(data=spec["task"] + " \x07now"))

    node.create_timer(0.05, publish)

    def policy(key: str) -> str:
        return diag.get("vla_runtime: policy", {}).get(key, "")

    procs = {n: start_node(n, spec) for n in NODES}
    try:
        report["served_on_latched_instruction"] = spin_until(node, lambda: len(trajectories) > 0, spec["timeout"] * 6)
        report["task"] = policy("task") if spin_until(node, lambda: policy("task") != "", spec["timeout"]) else ""
        far["on"] = True
        report["implausible"] = policy("last_implausible") if spin_until(node,
            lambda: int(policy("implausible_joint_states") or 0) > 0, spec["timeout"]) else ""
        far["on"] = False
        far["bad_instruction"] = True
        report["control_character"] = policy("last_refusal") if spin_until(node,
            lambda: int(policy("refused_instructions") or 0) > 0, spec["timeout"]) else ""
        far["bad_instruction"] = False
        n_traj = len(trajectories)
        report["served_after"] = spin_until(node, lambda: len(trajectories) > n_traj, spec["timeout"] * 3)
        report["task_after"] = policy("task")
        report["alive_before_sigint"] = {n: p.poll() is None for n, p in procs.items()}
    finally:
        for _ in range(2):   # twice, as a terminal's Ctrl-C reaches a launched node (directly and relayed)
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            time.sleep(0.05)
        exit_codes = {}
        for n, p in procs.items():
            try:
                exit_codes[n] = p.wait(timeout=spec["timeout"])
            except subprocess.TimeoutExpired:
                p.kill()
                exit_codes[n] = f"killed after {spec['timeout']} s"
        node.destroy_node()
        rclpy.try_shutdown()
    report["exit_codes"] = exit_codes
    sfx = spec["rings"]
    report["rings_left"] = [r for r in (f"prefix_{sfx}", f"refs_{sfx}") if os.path.exists(f"/dev/shm/{r}")]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit({"run": run}[sys.argv[1]](json.loads(sys.argv[2])))
