"""Recovery time per node: from a SIGKILL to the first action chunk after recovery, with the
vision, policy and cache manager node processes running in a private network namespace on the
pi05-tiny demo robot, and a test robot (``vla_runtime.testing.robot``) driving them at 20 Hz.

    flock /tmp/heavy.lock python bench/recovery.py --out out/recovery.json [--repeats 3]
    flock /tmp/heavy.lock python bench/recovery.py --launch-env ENV.sh --out out/recovery_launch.json

Without ``--launch-env`` the script starts the three node executables itself and plays the
launch's respawn: after a kill it waits ``launching.RESPAWN_DELAY_S`` and starts the node again
(``ros2 launch`` is not on PyPI). With ``--launch-env`` (a bash file that, sourced with this
worktree as its argument, makes a hand-built ``ros2 launch`` usable) the nodes run under the real
``ros2 launch vla_runtime sim.launch.py`` in a namespace of their own, and the launch respawns
the vision node and the cache manager itself.

For each node, ``--repeats`` times, from the kill:

- ``restart_s``: when the new process started (the respawn delay; under the launch, when the
  launch's new process appeared);
- ``first_chunk_s``: the first chunk published after the restart (respawn delay + process start,
  configure with checkpoint load and warm-up, activate, the first call); ``start_to_chunk_s``:
  the same from the restart. For the cache manager chunks never stop (calls run from the window
  it left, or dense): ``first_chunk_after_kill_s`` says so, and ``first_cached_s`` is the first
  chunk served from the new working set;
- vision node: ``first_hold_s``, when the policy published its one-point hold (the robot held);
- policy node: ``reported_s``, when the vision node and the cache manager had both reported it as
  an ERROR on /diagnostics. The launch does not respawn the policy (see docs/ros.md): it is
  restarted here once both reported it (standing for an operator or a lifecycle manager), so its
  ``first_chunk_s`` includes the report time.

Writes JSON (each run, and per node the median and max); wall-clock seconds on this machine,
one run at a time under the heavy-job lock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["inside"]:   # inside the namespace the install space (with vla_runtime.msg) comes first
    sys.path.insert(0, str(ROOT))

from vla_runtime.nodes.launching import NODES as LAUNCHED, RESPAWN_DELAY_S, RESPAWNS  # noqa: E402

KILLED = ("vision_node", "cache_manager_node", "policy_node")
NODE_NAME = dict(LAUNCHED)


class StartedNodes:
    """The three node executables started by this script, which also plays the launch's respawn."""

    def __init__(self, spec: dict):
        from vla_runtime.testing.robot import NODES, start_node

        self.spec, self.start_node = spec, start_node
        self.procs = {n: start_node(n, spec) for n in NODES}

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def restart(self, name: str, robot, t_kill: float) -> float:
        """Start ``name`` again (after the respawn delay from ``t_kill``); when it started."""
        robot.spin_until(lambda: False, max(0.0, RESPAWN_DELAY_S - (time.monotonic() - t_kill)))
        self.procs[name] = self.start_node(name, self.spec)
        return time.monotonic()

    def stop(self) -> None:
        from vla_runtime.testing.robot import stop_nodes

        stop_nodes(self.procs)


class LaunchedNodes:
    """``ros2 launch vla_runtime sim.launch.py`` in namespace ``spec["namespace"]``: the launch
    respawns the vision node and the cache manager; the policy node is restarted by hand."""

    def __init__(self, spec: dict):
        self.spec, self.ns = spec, spec["namespace"]
        log = open(os.path.join(spec["logs"], "launch.log"), "a")
        self.launch = subprocess.Popen(["ros2", "launch", "vla_runtime", "sim.launch.py", f"profile:={spec['profile']}",
                                        f"namespace:={self.ns}"], stdout=log, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)
        self.by_hand: subprocess.Popen | None = None

    def pid(self, name: str) -> int | None:
        """The running process of node executable ``name`` in this launch's namespace."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = [a.decode(errors="replace") for a in argv]
            if any(a.endswith(f"/{name}") or a == f"vla_runtime.nodes.{name}" for a in text) \
                    and f"__ns:=/{self.ns}" in text:
                return int(entry)
        return None

    def kill(self, name: str) -> None:
        pid = self.pid(name)
        if pid is None:
            raise RuntimeError(f"{name} is not running under the launch")
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and not self._zombie(pid):
            time.sleep(0.01)
        self.killed_pid = pid

    @staticmethod
    def _zombie(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
        except (OSError, IndexError):
            return True

    def restart(self, name: str, robot, t_kill: float) -> float:
        if RESPAWNS[NODE_NAME[name]]:   # the launch respawns it: when its new process appears
            robot.spin_until(lambda: self.pid(name) not in (None, self.killed_pid), self.spec["timeout"])
            return time.monotonic()
        robot.spin_until(lambda: False, max(0.0, RESPAWN_DELAY_S - (time.monotonic() - t_kill)))
        log = open(os.path.join(self.spec["logs"], f"{name}.log"), "a")
        self.by_hand = subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{name}", "--ros-args",
                                         "-r", f"__node:={NODE_NAME[name]}", "-r", f"__ns:=/{self.ns}",
                                         "-p", f"profile:={self.spec['profile']}"],
                                        stdout=log, stderr=subprocess.STDOUT, text=True)
        return time.monotonic()

    def stop(self) -> None:
        from vla_runtime.testing.robot import stop_nodes

        stop_nodes({"launch": self.launch, **({"policy": self.by_hand} if self.by_hand else {})}, timeout=30)


def kill_and_restart(robot, nodes, name: str, timeout: float) -> dict:
    """One measurement (inside the namespace): the robot is being served when it starts."""
    if name == "cache_manager_node":   # recovery of the cache is measured from a cached steady state
        t0 = time.monotonic()
        robot.spin_until(lambda: any(src == "cached" for ct, _, src in robot.chunks if ct > t0), timeout)
    t_kill = time.monotonic()
    nodes.kill(name)
    run: dict = {}
    if name == "policy_node":   # not respawned: its peers must report it first (then it is restarted)
        def reported(who: str) -> float | None:
            return robot.first_status(who, t_kill, lambda st: st["level"] == 2
                                      and "policy node silent" in st["message"])
        robot.spin_until(lambda: None not in (reported("vision"), reported("cache manager")), timeout)
        times = [reported("vision"), reported("cache manager")]
        run["reported_s"] = None if None in times else round(max(times) - t_kill, 3)
    t_start = nodes.restart(name, robot, t_kill)
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
    from vla_runtime.testing.robot import TestRobot

    assert_only_loopback()
    nodes = LaunchedNodes(spec) if spec.get("namespace") else StartedNodes(spec)
    rclpy.init()
    node = rclpy.create_node("bench_robot")
    robot = TestRobot(node, spec, f"/{spec['namespace']}" if spec.get("namespace") else "")
    out: dict = {"runs": {n: [] for n in KILLED}}
    try:
        t0 = time.monotonic()
        if not robot.spin_until(lambda: robot.chunks_since(t0) >= 3, spec["timeout"] * 3):
            raise RuntimeError("the pipeline never served the robot; see the node logs in " + spec["logs"])
        out["startup_s"] = round(time.monotonic() - t0, 3)
        for name in KILLED:
            for _ in range(spec["repeats"]):
                out["runs"][name].append(kill_and_restart(robot, nodes, name, spec["timeout"]))
        out["violations"] = robot.violations
    finally:
        nodes.stop()
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


def launch_env(script: Path, base: dict[str, str]) -> dict[str, str]:
    """``base`` with what sourcing ``script`` (given this worktree) sets: a hand-built ros2 launch."""
    out = subprocess.run(["bash", "-c", f'source "{script}" "{ROOT}" || exit 1; env -0'], env=base,
                         capture_output=True, timeout=60, check=False)
    if out.returncode != 0:
        raise SystemExit(f"sourcing {script} failed:\n{out.stderr.decode(errors='replace')}")
    env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
    return {**env, **{k: base[k] for k in ("ROS_DOMAIN_ID", "RMW_IMPLEMENTATION", "ROS_AUTOMATIC_DISCOVERY_RANGE")}}


def main() -> int:
    import yaml

    from vla_runtime.testing.netns import ros_env, run_in_private_netns
    from vla_runtime.testing.scenarios import demo_robot, robot_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="kills per node")
    ap.add_argument("--work", default="out/recovery", help="demo robot, repository, profile and node logs")
    ap.add_argument("--timeout", type=float, default=60.0, help="longest wait for any one event, seconds")
    ap.add_argument("--launch-env", help="bash file making a hand-built `ros2 launch` usable: run under the launch")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    install = ROOT / "install"
    if not (install / "setup.bash").is_file():
        raise SystemExit(f"{install}/setup.bash missing: build the ROS 2 side first (make ros)")
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    demo = demo_robot(work / f"demo{os.getpid()}", ROOT / "config" / "sim.yaml")
    (work / "profile.yaml").write_text(yaml.safe_dump(demo["profile"]))
    spec = robot_spec(demo, work / "profile.yaml", work / "logs", f"rec{os.getpid()}", args.timeout)
    spec["repeats"] = args.repeats
    env = ros_env(install)
    if args.launch_env:   # its own namespace: rings vla_prefix_<ns>, nothing shared with other runs
        env, spec["namespace"] = launch_env(Path(args.launch_env), env), f"rec{os.getpid()}"
    done = run_in_private_netns([sys.executable, __file__, "inside", json.dumps(spec)], env=env,
                                timeout=args.timeout * (6 + 6 * len(KILLED) * args.repeats), cwd=work)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.node(),
              "cpus": os.cpu_count(), "model": "pi05-tiny (demo checkpoint)",
              "control_hz": demo["profile"]["control_hz"], "under": "ros2 launch" if args.launch_env else "this script",
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
