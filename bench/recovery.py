"""Recovery time per node: from a SIGKILL to the first action chunk after recovery, with the
vision, policy and cache manager node processes running in a private network namespace on the
pi05-tiny demo robot, and a test robot (``vla_runtime.testing.robot``) driving them at 20 Hz.

    flock /tmp/heavy.lock python bench/recovery.py --out out/recovery.json [--repeats 3]

For each node, ``--repeats`` times: SIGKILL, wait ``launching.RESPAWN_DELAY_S`` (what the launch's
respawn waits; ``ros2 launch`` is not on PyPI, so this script restarts the node itself), start
it again, and time, from the kill:

- ``restart_s``: when the new process was started (the respawn delay);
- ``first_chunk_s``: the first chunk published after the restart (respawn delay + process start,
  configure with checkpoint load and warm-up, activate, the first call). For the cache manager
  chunks never stop (calls run from the window it left, or dense): ``first_chunk_after_kill_s``
  says so, and ``first_cached_s`` is the first chunk served from the new working set;
- vision node: ``first_hold_s``, when the policy published its one-point hold (the robot held);
- ``start_to_chunk_s``: from the restart to that first chunk (start, configure, activate, call);
- policy node: ``reported_s``, when the vision node and the cache manager had both reported it as
  an ERROR on /diagnostics. The launch does not respawn the policy (see docs/ros.md): here it is
  restarted once both reported it (standing for an operator or a lifecycle manager), so its
  ``first_chunk_s`` includes the report time.

Writes JSON (each run, and per node the median and max); timings are wall-clock seconds on this
machine (2 CPU cores, shared), one run at a time under the heavy-job lock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["inside"]:   # inside the namespace the install space (with vla_runtime.msg) comes first
    sys.path.insert(0, str(ROOT))

from vla_runtime.nodes.launching import RESPAWN_DELAY_S  # noqa: E402

KILLED = ("vision_node", "cache_manager_node", "policy_node")


def kill_and_restart(robot, procs: dict, name: str, spec: dict) -> dict:
    """One measurement (inside the namespace): the robot is being served when it starts."""
    from vla_runtime.testing.robot import start_node

    timeout = spec["timeout"]
    if name == "cache_manager_node":   # recovery of the cache is measured from a cached steady state
        t0 = time.monotonic()
        robot.spin_until(lambda: any(src == "cached" for ct, _, src in robot.chunks if ct > t0), timeout)
    t_kill = time.monotonic()
    procs[name].kill()
    procs[name].wait()
    run: dict = {}
    if name == "policy_node":   # not respawned: its peers must report it first (then it is restarted)
        def reported(who: str) -> float | None:
            return next((t for t, nm, st in robot.diag_log if t > t_kill and nm == f"vla_runtime: {who}"
                         and st["level"] == 2 and "policy node silent" in st["message"]), None)
        robot.spin_until(lambda: None not in (reported("vision"), reported("cache manager")), timeout)
        times = [reported("vision"), reported("cache manager")]
        run["reported_s"] = None if None in times else round(max(times) - t_kill, 3)
    robot.spin_until(lambda: False, max(0.0, RESPAWN_DELAY_S - (time.monotonic() - t_kill)))
    t_start = time.monotonic()
    procs[name] = start_node(name, spec)
    run["restart_s"] = round(t_start - t_kill, 3)

    def first(items, since: float, pred=lambda item: True):
        return next((item[0] for item in items if item[0] > since and pred(item)), None)

    robot.spin_until(lambda: first(robot.chunks, t_start) is not None, timeout)
    t = first(robot.chunks, t_start)
    run["first_chunk_s"] = None if t is None else round(t - t_kill, 3)
    run["start_to_chunk_s"] = None if t is None else round(t - t_start, 3)
    if name == "vision_node":
        t = first(robot.trajectories, t_kill, lambda item: item[1] == 1)
        run["first_hold_s"] = None if t is None else round(t - t_kill, 3)
    if name == "cache_manager_node":
        t = first(robot.chunks, t_kill)
        run["first_chunk_after_kill_s"] = None if t is None else round(t - t_kill, 3)
        robot.spin_until(lambda: first(robot.chunks, t_start, lambda item: item[2] == "cached") is not None, timeout)
        t = first(robot.chunks, t_start, lambda item: item[2] == "cached")
        run["first_cached_s"] = None if t is None else round(t - t_kill, 3)
    # steady again before the next kill: two more chunks
    t = time.monotonic()
    robot.spin_until(lambda: robot.chunks_since(t) >= 2, timeout)
    return run


def inside(spec: dict) -> int:
    """The measurement, run in the private network namespace; prints the JSON on the last line."""
    import rclpy

    from vla_runtime.testing.netns import assert_only_loopback
    from vla_runtime.testing.robot import NODES, TestRobot, start_node, stop_nodes

    assert_only_loopback()
    procs = {n: start_node(n, spec) for n in NODES}
    rclpy.init()
    node = rclpy.create_node("bench_robot")
    robot = TestRobot(node, spec)
    out: dict = {"runs": {n: [] for n in KILLED}}
    try:
        t0 = time.monotonic()
        if not robot.spin_until(lambda: robot.chunks_since(t0) >= 3, spec["timeout"] * 3):
            raise RuntimeError("the pipeline never served the robot; see the node logs in " + spec["logs"])
        out["startup_s"] = round(time.monotonic() - t0, 3)
        for name in KILLED:
            for _ in range(spec["repeats"]):
                out["runs"][name].append(kill_and_restart(robot, procs, name, spec))
        out["violations"] = robot.violations
    finally:
        stop_nodes(procs)
        node.destroy_node()
        rclpy.try_shutdown()
    print(json.dumps(out))
    return 0


def summarize(runs: dict) -> dict:
    out = {}
    for name, rs in runs.items():
        keys = sorted({k for r in rs for k in r})
        out[name] = {k: {"median": statistics.median(v), "max": max(v)} if (v := [r[k] for r in rs
                                                                                  if r.get(k) is not None]) else None
                     for k in keys}
    return out


def main() -> int:
    import yaml

    from vla_runtime.testing.netns import ros_env, run_in_private_netns
    from vla_runtime.testing.scenarios import demo_robot, robot_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="kills per node")
    ap.add_argument("--work", default="out/recovery", help="demo robot, repository, profile and node logs")
    ap.add_argument("--timeout", type=float, default=60.0, help="longest wait for any one event, seconds")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    install = ROOT / "install"
    if not (install / "setup.bash").is_file():
        raise SystemExit(f"{install}/setup.bash missing: build the ROS 2 side first (make ros)")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    demo = demo_robot(work / f"demo{os.getpid()}", ROOT / "config" / "sim.yaml")
    (work / "profile.yaml").write_text(yaml.safe_dump(demo["profile"]))
    spec = robot_spec(demo, work / "profile.yaml", work / "logs", f"rec{os.getpid()}", args.timeout)
    spec["repeats"] = args.repeats
    done = run_in_private_netns([sys.executable, __file__, "inside", json.dumps(spec)], env=ros_env(install),
                                timeout=args.timeout * (6 + 6 * len(KILLED) * args.repeats), cwd=work)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.node(),
              "cpus": os.cpu_count(), "model": "pi05-tiny (demo checkpoint)", "control_hz": demo["profile"]["control_hz"],
              "respawn_delay_s": RESPAWN_DELAY_S, "repeats": args.repeats, **measured,
              "summary": summarize(measured["runs"])}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0 if not measured["violations"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "inside":
        sys.exit(inside(json.loads(sys.argv[2])))
    sys.exit(main())
