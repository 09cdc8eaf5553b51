"""Driver for test_shutdown.py, run inside one private network namespace (not a test module).

    python shutdown_peers.py run SPEC_JSON

Starts the cache manager and vision node processes and plays the policy node's side by hand
(camera images, prefix requests). One call is served normally; then the cache manager is
stopped (SIGSTOP) and the next call must still be served (the vision node selects from the
published window, it never waits for the cache manager); then the vision node is interrupted
(SIGINT). Reports whether the second call was served, how long the vision node took to exit,
its exit code and whether its shared-memory ring is gone, on the last line of stdout.
SPEC_JSON: {"profile": path, "logs": folder, "images": {camera: [[...]]}, "state": [...],
"task": str, "cameras": {camera: topic}, "rings": suffix, "timeout": seconds per wait}.
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


def start_node(name: str, spec: dict, *args: str) -> subprocess.Popen:
    log = open(os.path.join(spec["logs"], f"{name}.log"), "a")
    return subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{name}", "--ros-args",
                             "-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{spec['rings']}", *args],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def run(spec: dict) -> int:
    assert_only_loopback()
    import numpy as np
    import rclpy
    from sensor_msgs.msg import Image

    from vla_runtime.msg import PrefixRequest, SlotReady

    sfx = spec["rings"]
    rings = [f"prefix_{sfx}"]
    cache = start_node("cache_manager_node", spec)
    vision = start_node("vision_node", spec, "-p", f"ring:=prefix_{sfx}")
    report: dict = {}
    rclpy.init()
    node = rclpy.create_node("test_policy_side")
    ready: list[int] = []
    node.create_subscription(SlotReady, "/vla_runtime/slot_ready", lambda m: ready.append(int(m.sequence)), 10)
    cams = {c: node.create_publisher(Image, t, 10) for c, t in spec["cameras"].items()}
    requests = node.create_publisher(PrefixRequest, "/vla_runtime/prefix_request", 10)
    images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}

    def publish_images() -> None:
        for c, img in images.items():
            cams[c].publish(rgb_image(img, node.get_clock().now().to_msg()))

    node.create_timer(0.05, publish_images)

    def ask(seq: int) -> None:
        requests.publish(PrefixRequest(request_seq=seq, start_tick=0, state=[float(x) for x in spec["state"]],
                                       task=spec["task"], episode=1))

    try:
        # 1. a normal call, asked again until the vision node (and the cache manager) have come up
        served = False
        deadline = time.monotonic() + spec["timeout"] * 3
        while not served and time.monotonic() < deadline:
            ask(1)
            served = spin_until(node, lambda: bool(ready), 2.0)
        report["first_served"] = served
        # quiet: the repeated first requests (sent while the nodes came up) have all been answered
        last = [len(ready), time.monotonic()]

        def quiet() -> bool:
            if len(ready) != last[0]:
                last[:] = [len(ready), time.monotonic()]
            return time.monotonic() - last[1] > 1.5
        report["quiet"] = spin_until(node, quiet, spec["timeout"])
        # 2. the cache manager freezes; the next call is served all the same
        cache.send_signal(signal.SIGSTOP)
        n_ready = len(ready)
        ask(2)
        report["second_served_while_cache_manager_stopped"] = spin_until(node, lambda: len(ready) > n_ready,
                                                                          spec["timeout"])
        t = time.monotonic()
        vision.send_signal(signal.SIGINT)
        try:
            vision.wait(timeout=spec["timeout"])
        except subprocess.TimeoutExpired:
            vision.kill()
            vision.wait()
        report["vision_exit_s"] = time.monotonic() - t
        report["vision_exit_code"] = vision.returncode
        report["rings_left"] = [r for r in rings if os.path.exists(f"/dev/shm/{r}")]
    finally:
        cache.send_signal(signal.SIGCONT)
        for p in (vision, cache):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        node.destroy_node()
        rclpy.shutdown()
    report["cache_manager_exit_code"] = cache.returncode
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit({"run": run}[sys.argv[1]](json.loads(sys.argv[2])))
