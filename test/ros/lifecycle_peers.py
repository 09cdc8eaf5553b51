"""Driver for test_lifecycle.py, run inside one private network namespace (not a test module).

    python lifecycle_peers.py run SPEC_JSON

Starts the vision, policy and cache manager node processes with ``autostart:=false`` and drives
each through its standard lifecycle services (as ``ros2 lifecycle set`` or nav2's lifecycle
manager would), while this process plays the robot (``vla_runtime.testing.robot``): configure,
activate, deactivate (the policy publishes a hold and then nothing), activate again, deactivate
the vision node (the policy holds, the vision node prefills nothing), cleanup (rings released),
and shutdown from each state (unconfigured, inactive, active): every process exits 0.
Prints a JSON report (per phase: what was seen) on the last line of stdout. SPEC_JSON: as
``TestRobot`` plus {"profile": path, "logs": folder, "rings": suffix, "timeout": s per wait}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from vla_runtime.testing.netns import assert_only_loopback
from vla_runtime.testing.robot import NODE_NAMES, NODES, LifecycleClient, TestRobot, start_node, stop_nodes


def rings(spec: dict) -> list[str]:
    sfx = spec["rings"]
    return sorted(r for r in (f"prefix_{sfx}", f"refs_{sfx}") if os.path.exists(f"/dev/shm/{r}"))


def scenario(spec: dict, procs: dict) -> dict:
    import rclpy

    rclpy.init()
    node = rclpy.create_node("test_robot")
    robot = TestRobot(node, spec)
    life = {n: LifecycleClient(node, NODE_NAMES[n], spec["timeout"] * 3) for n in NODES}
    rep: dict = {}

    def states() -> dict:
        return {n: c.state() for n, c in life.items()}

    def change_all(label: str, order=NODES) -> dict:
        return {n: life[n].change(label) for n in order}

    def quiet_for(seconds: float) -> dict:
        """What the policy sent during ``seconds`` from now."""
        t = time.monotonic()
        robot.spin_until(lambda: False, seconds)
        return {"trajectories": sum(1 for tt, _, _ in robot.trajectories if tt > t),
                "chunks": robot.chunks_since(t), "requests": sum(1 for tt in robot.requests if tt > t)}

    # ---- unconfigured: nothing loaded, no rings, nothing commanded
    for n in NODES:   # the services exist once the process has started
        life[n].wait()
    rep["unconfigured"] = {"states": states(), "rings": rings(spec), **quiet_for(2.0)}

    # ---- configure: loads, warms up, rings created; still no command (not active)
    rep["configure"] = {"ok": change_all("configure"), "states": states(), "rings": rings(spec), **quiet_for(3.0)}

    # ---- activate: served
    t = time.monotonic()
    ok = change_all("activate")
    served = robot.spin_until(lambda: robot.chunks_since(t) >= 2, spec["timeout"] * 3)
    rep["activate"] = {"ok": ok, "states": states(), "served": served}

    # ---- deactivate the policy: one hold trajectory (one point), then nothing
    n_traj = len(robot.trajectories)
    ok = life["policy_node"].change("deactivate")
    robot.spin_until(lambda: False, 0.5)   # let the hold arrive (published during the transition)
    after = robot.trajectories[n_traj:]
    quiet = quiet_for(3.0)
    policy = (robot.status("policy") or [{}])[-1]
    rep["policy_deactivate"] = {"ok": ok, "state": life["policy_node"].state(), "after": [n for _, n, _ in after],
                                "hold": after[-1][2] if after else None, "quiet": quiet,
                                "lifecycle": policy.get("lifecycle"), "holds": policy.get("holds_published")}

    # ---- activate the policy again: chunks resume
    t = time.monotonic()
    ok = life["policy_node"].change("activate")
    rep["policy_reactivate"] = {"ok": ok, "served": robot.spin_until(lambda: robot.chunks_since(t) >= 2,
                                                                     spec["timeout"] * 3)}

    # ---- deactivate the vision node: no prefill (requests counted), the policy holds; then back
    t = time.monotonic()
    ok = life["vision_node"].change("deactivate")
    held = robot.spin_until(lambda: any(st.get("plan_stale") == "True" for st in robot.status("policy", t))
                            and any(int(st.get("requests_while_inactive", "0")) > 0
                                    for st in robot.status("vision", t)), spec["timeout"] * 2)
    t_quiet = time.monotonic()
    robot.spin_until(lambda: False, 1.0)
    chunks_while_inactive = robot.chunks_since(t_quiet)
    t = time.monotonic()
    ok_back = life["vision_node"].change("activate")
    rep["vision_deactivate"] = {"ok": ok, "held": held, "chunks_while_inactive": chunks_while_inactive,
                                "ok_back": ok_back,
                                "served_after": robot.spin_until(lambda: robot.chunks_since(t) >= 2,
                                                                 spec["timeout"] * 3)}

    # ---- the cache manager: deactivate / activate keep the window; calls go on throughout
    t = time.monotonic()
    ok = [life["cache_manager_node"].change("deactivate"), life["cache_manager_node"].change("activate")]
    rep["cache_manager_cycle"] = {"ok": ok, "state": life["cache_manager_node"].state(),
                                  "served": robot.spin_until(lambda: robot.chunks_since(t) >= 2, spec["timeout"] * 3)}

    # ---- deactivate and clean up everything: rings unmapped and unlinked
    rep["cleanup"] = {"deactivate": change_all("deactivate", ("policy_node", "vision_node", "cache_manager_node")),
                      "cleanup": change_all("cleanup", ("policy_node", "vision_node", "cache_manager_node"))}
    rep["cleanup"] |= {"states": states(), "rings": rings(spec), **quiet_for(1.0)}

    # ---- shutdown from each state: policy from unconfigured, vision from inactive, cache manager from active
    life["vision_node"].change("configure")
    life["cache_manager_node"].change("configure")
    life["cache_manager_node"].change("activate")
    before = {n: life[n].state() for n in NODES}
    ok = {n: life[n].change("shutdown") for n in ("policy_node", "vision_node", "cache_manager_node")}
    codes = {}
    for n, p in procs.items():
        try:
            codes[n] = p.wait(timeout=spec["timeout"])
        except subprocess.TimeoutExpired:
            codes[n] = "still running"
    rep["shutdown"] = {"from": before, "ok": ok, "exit_codes": codes, "rings": rings(spec)}
    rep["violations"] = robot.violations
    node.destroy_node()
    rclpy.shutdown()
    return rep


def run(spec: dict) -> int:
    assert_only_loopback()
    procs = {n: start_node(n, spec, "-p", "autostart:=false") for n in NODES}
    try:
        report = scenario(spec, procs)
    finally:
        stop_nodes(procs)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit({"run": run}[sys.argv[1]](json.loads(sys.argv[2])))
