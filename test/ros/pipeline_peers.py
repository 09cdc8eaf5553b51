"""Peers for test_pipeline.py, run inside one private network namespace (not a test module).

    python pipeline_peers.py run SPEC_JSON

starts the real vision, policy and cache manager node processes and a test robot process, waits
(bounded) for the robot to receive the first cached ActionChunk (calls before the cache manager
has its window up run dense, by design) and every node's diagnostics, stops everything and prints
the robot's JSON report.
SPEC_JSON: {"profile": path, "images": {camera: [[...]] uint8 HxWx3 lists}, "state": [...],
"task": str, "joint_names": [...], "cameras": {camera: topic}, "timeout": s, "rings": suffix}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from vla_runtime.testing.netns import assert_only_loopback
from vla_runtime.testing.scenarios import rgb_image


def robot(spec: dict) -> int:
    """Publish images, joint states and the instruction until the first ActionChunk arrives."""
    import numpy as np
    import rclpy
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String

    from diagnostic_msgs.msg import DiagnosticArray

    from vla_runtime.msg import ActionChunk, PrefixRequest, ReferenceSelection

    assert_only_loopback()
    rclpy.init()
    node = rclpy.create_node("test_robot")
    got: dict = {}
    def on_chunk(m) -> None:
        got["dense_before"] = got.get("dense_before", 0) + int("chunk" not in got and m.source != "cached")
        if m.source == "cached":
            got.setdefault("chunk", {"call_id": m.call_id, "shape": [m.chunk_length, m.action_dim],
                                     "actions": list(m.actions), "source": m.source})
    node.create_subscription(ActionChunk, "/vla_runtime/action_chunk", on_chunk, 10)
    # per call: the reference the vision node chose (or why none), and the state its prompt was
    # conditioned on (the policy's predicted state once a chunk is executing, not the observed one)
    references, reasons, states = (got.setdefault(k, {}) for k in ("references", "reasons", "states"))
    def on_selection(m) -> None:
        if m.found:
            references[str(m.request_seq)] = [m.episode_id, int(m.index)]
        reasons[str(m.request_seq)] = m.reason
    node.create_subscription(ReferenceSelection, "/vla_runtime/reference_selection", on_selection, 10)
    def on_request(m) -> None:
        states[str(m.request_seq)] = list(m.state)
    node.create_subscription(PrefixRequest, "/vla_runtime/prefix_request", on_request, 10)
    diagnostics: dict = got.setdefault("diagnostics", {})
    def on_diagnostics(m) -> None:   # each node's newest after the first cached chunk (nodes report once a second)
        values = {kv.key: kv.value for kv in m.status[0].values}
        if "chunk" in got and int(values.get("calls", values.get("selections", "0"))) >= 1:
            diagnostics[m.status[0].name] = values
    node.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 10)
    wanted = {f"vla_runtime: {n}" for n in ("policy", "vision", "cache manager")}

    def done() -> bool:
        if "chunk" not in got or not wanted <= set(diagnostics):
            return False
        # the calls the vision node ran (a request sent before it was up goes unanswered), each
        # with the state its request carried
        last = got["chunk"]["call_id"]
        return str(last) in reasons and all(c in states for c in reasons if int(c) <= last)
    pubs = {c: node.create_publisher(Image, t, 10) for c, t in spec["cameras"].items()}
    joints = node.create_publisher(JointState, "/joint_states", 10)
    task = node.create_publisher(String, "/instruction", 10)
    images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}

    def publish() -> None:
        for c, img in images.items():
            pubs[c].publish(rgb_image(img))
        js = JointState(name=spec["joint_names"], position=[float(x) for x in spec["state"]])
        joints.publish(js)
        task.publish(String(data=spec["task"]))

    deadline = time.monotonic() + spec["timeout"]
    # Publish only once the three nodes have found each other (DDS discovery): a first call sent
    # while the cache manager is not yet subscribed runs dense, by design.
    while time.monotonic() < deadline and not (node.count_subscribers("/vla_runtime/reference_selection") >= 1
                                               and node.count_publishers("/vla_runtime/reference_selection") >= 1
                                               and node.count_subscribers("/joint_states") >= 1):
        rclpy.spin_once(node, timeout_sec=0.1)
    node.create_timer(0.05, publish)
    while not done() and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    print(json.dumps(got))
    node.destroy_node()
    rclpy.shutdown()
    return 0 if done() else 2


def run(spec: dict) -> int:
    assert_only_loopback()
    sfx = spec["rings"]
    args = ["--ros-args", "-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{sfx}"]
    extra = {"vision_node": ["-p", f"ring:=prefix_{sfx}"], "cache_manager_node": [],
             "policy_node": ["-p", "request_timeout_s:=20.0"]}
    nodes = [subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{n}", *args, *extra[n]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for n in ("cache_manager_node", "vision_node", "policy_node")]
    try:
        rob = subprocess.run([sys.executable, __file__, "robot", json.dumps(spec)], capture_output=True, text=True,
                             timeout=spec["timeout"] + 30)
    finally:
        errs = []
        for p in nodes:
            p.terminate()
            try:
                _, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            errs.append(err[-3000:])
    if rob.returncode != 0:
        print(rob.stdout)
        print("robot:", rob.stderr[-3000:], "\nnodes:", *errs, file=sys.stderr)
        return rob.returncode
    print(rob.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    sys.exit({"run": run, "robot": robot}[sys.argv[1]](spec))
