"""How regular the policy node's control tick is while calls run in its process (JSON out).

Not part of CI. Starts the three node processes (vision, policy, cache manager) inside a
private network namespace (only loopback, up: no DDS participant outside it) on a CPU copy of
the ALOHA profile with the bundled checkpoint (checkpoints/pi05-aloha-transfer-cube), and
plays the robot from this process: joint states of both arms at 50 Hz, three camera frames,
an instruction. Two windows, one run:

- idle: the robot plays, no instruction yet: the tick fires and no call runs;
- calls: the instruction is given, and once the first chunk came back the window starts with
  calls running back to back (the vision node encodes in its process, the policy node
  denoises in the process whose tick is measured).

What is measured: the policy node records the monotonic time at which each tick callback
starts (``engine/tick_timing.py``: where the tick happens, not DDS delivery) and publishes them
once a second on ``vla_runtime/tick_starts``; the gaps between consecutive starts are the tick
periods. A tick is missed when a gap exceeds 1.5 periods (``tick_timing.MISSED_FACTOR``).

    flock /tmp/heavy.lock python bench/control_tick.py --seconds 60 --out out/control_tick.json

Needs the ROS 2 side built (``make ros``: install/). Reports, per window, period p50/p99/max,
ticks missed and late (> period + 5 ms), the calls completed in the window, and the load average.

Steal time: on a virtual machine the hypervisor can take a vCPU away (``steal`` in /proc/stat,
counted in jiffies at the kernel's tick). A thread here samples it every 2 ms, so each
long gap is listed with the steal counted around it (``STEAL_SLACK_MS`` either side): a gap
that coincides with stolen time is the machine's, not the node's.

Where the policy process was: the tick loop logs a tick that starts over half a period late with
where each of the process's other threads was at that moment (``nodes/late_ticks.py``:
``LateTick``); each long gap gets the one logged within ``LATE_MATCH_S`` of its start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if "--inside" not in sys.argv:   # inside the namespace the install space's vla_runtime (with .msg) is used
    sys.path.insert(0, str(ROOT))

from vla_runtime.engine.tick_timing import long_gaps, tick_statistics  # noqa: E402

STEAL_SLACK_MS = 12.0   # a gap's neighbourhood for steal: the kernel books it at its next tick (HZ 100-1000)
LATE_MATCH_S = 0.005    # a logged late tick belongs to a long gap starting this close to it
LATE_LINE = re.compile(r"control tick [0-9.]+ ms late at monotonic ([0-9.]+) s(.*)$")

CHECKPOINT = ROOT / "checkpoints" / "pi05-aloha-transfer-cube"
TASK = "pick up the cube with the right arm and hand it over to the left arm"
NODES = ("cache_manager_node", "vision_node", "policy_node")


def bench_profile(threads: int, streaming: dict) -> dict:
    """config/aloha.yaml on the CPU (float32, ``threads`` torch threads a node), the bundled
    checkpoint, and each arm's 7 joints as a JointTrajectory (the Interbotix output needs
    interbotix_xs_msgs; the tick does the same work either way, less the per-tick publish);
    ``streaming`` overrides keys of the profile's streaming section."""
    prof = yaml.safe_load((ROOT / "config" / "aloha.yaml").read_text())
    prof.pop("controllers", None)
    prof["streaming"].update(streaming)
    prof["engine"].update(device="cpu", dtype="float32", threads=threads, checkpoint=str(CHECKPOINT))
    prof["output"] = {"kind": "joint_trajectory", "topics": ["/left_arm_controller/joint_trajectory",
                                                             "/right_arm_controller/joint_trajectory"],
                      "joint_slices": [[0, 7], [7, 14]]}
    return prof


# ------------------------------------------------------------------ inside the namespace

def robot_and_measure(spec: dict) -> dict:
    """Start the nodes, play the robot, record both windows; the report (a dict)."""
    from vla_runtime.testing.netns import assert_only_loopback

    assert_only_loopback()
    logs = Path(spec["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    args = ["--ros-args", "-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{spec['tag']}"]
    extra = {"vision_node": ["-p", f"ring:=prefix_{spec['tag']}"], "cache_manager_node": [], "policy_node": []}
    procs = [subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{n}", *args, *extra[n]],
                              stdout=open(logs / f"{n}.log", "w"), stderr=subprocess.STDOUT)
             for n in NODES]
    try:
        return _play(spec, {n: p.pid for n, p in zip(NODES, procs)})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class StealSampler:
    """Samples /proc/stat's per-CPU steal every ``period_s`` on a daemon thread; keeps each
    increase as (monotonic ns, cpu, ms stolen). Empty where the kernel reports none."""

    def __init__(self, period_s: float = 0.002) -> None:
        import threading

        self.period_s = period_s
        self.events: list[tuple[int, int, float]] = []
        self.ms_per_jiffy = 1000.0 / os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steal-sampler", daemon=True)

    @staticmethod
    def read() -> dict[int, int]:
        """Steal jiffies per CPU (field 8 of each ``cpuN`` line)."""
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    parts = line.split()
                    out[int(parts[0][3:])] = int(parts[8]) if len(parts) > 8 else 0
        return out

    def _run(self) -> None:
        last = self.read()
        while not self._stop.wait(self.period_s):
            now, t = self.read(), time.monotonic_ns()
            for cpu, v in now.items():
                if v > last.get(cpu, v):
                    self.events.append((t, cpu, (v - last[cpu]) * self.ms_per_jiffy))
            last = now

    def start(self) -> "StealSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def stolen_ms(self, t0_ns: int, t1_ns: int) -> float:
        return round(sum(ms for t, _, ms in self.events if t0_ns <= t <= t1_ns), 1)

    def chance_near(self, starts_ns: list[int], period: float) -> float:
        """The share of ticks with stolen time in the neighbourhood a gap of 1.5 periods is
        checked in: how often a gap would meet steal by chance."""
        import numpy as np

        t = np.array(sorted(e[0] for e in self.events), dtype=np.int64)
        if not starts_ns or t.size == 0:
            return 0.0
        s = np.asarray(starts_ns, dtype=np.int64)
        slack, gap = int(STEAL_SLACK_MS * 1e6), int(1.5 * period * 1e9)
        return round(float(np.mean(np.searchsorted(t, s + slack, "right") > np.searchsorted(t, s - gap - slack))), 4)


def _play(spec: dict, pids: dict[str, int]) -> dict:
    import numpy as np
    import rclpy
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Int64MultiArray, String

    from vla_runtime.msg import ActionChunk
    from vla_runtime.testing.scenarios import rgb_image, spin_until

    prof = yaml.safe_load(Path(spec["profile"]).read_text())
    period = 1.0 / float(prof["control_hz"])
    rclpy.init()
    node = rclpy.create_node("control_tick_robot")
    starts: list[int] = []
    chunks: list[int] = []   # monotonic arrival of each ActionChunk (the calls completed)
    node.create_subscription(Int64MultiArray, "/vla_runtime/tick_starts", lambda m: starts.extend(m.data), 100)
    node.create_subscription(ActionChunk, "/vla_runtime/action_chunk", lambda m: chunks.append(time.monotonic_ns()),
                             10)
    names = prof["joint_names"]
    halves = {t: names[i * 7:(i + 1) * 7] for i, t in enumerate(prof["joint_states_topics"])}
    joint_pubs = {t: node.create_publisher(JointState, t, 10) for t in halves}
    cams = {c: node.create_publisher(Image, v["topic"], 10)
            for c, v in prof["cameras"].items()}
    rng = np.random.default_rng(0)
    frames = {c: rng.integers(0, 256, (spec["image_size"], spec["image_size"], 3), dtype=np.uint8) for c in cams}
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    instruction = node.create_publisher(String, prof["instruction_topic"], latched)
    state = [0.0] * len(names)

    def play_joints() -> None:
        stamp = node.get_clock().now().to_msg()
        for t, js in halves.items():
            m = JointState(name=js, position=[state[names.index(j)] for j in js])
            m.header.stamp = stamp
            joint_pubs[t].publish(m)

    def play_cameras() -> None:
        stamp = node.get_clock().now().to_msg()
        for c, pub in cams.items():
            pub.publish(rgb_image(frames[c], stamp))

    def discovered() -> bool:
        return (node.count_subscribers(prof["joint_states_topics"][0]) >= 1
                and node.count_publishers("/vla_runtime/tick_starts") >= 1
                and node.count_subscribers("/vla_runtime/prefix_request") >= 1)

    if not spin_until(node, discovered, spec["start_timeout"]):
        raise RuntimeError(f"the nodes were not up after {spec['start_timeout']} s; see {spec['logs']}")
    node.create_timer(period, play_joints)
    node.create_timer(1.0 / spec["camera_hz"], play_cameras)
    report: dict = {}
    steal = StealSampler().start()
    spin_until(node, lambda: False, spec["settle"])          # the tick runs; nothing asked yet
    report["idle"] = _window(node, starts, chunks, spec["seconds"], period, pids, steal)
    instruction.publish(String(data=TASK))
    if not spin_until(node, lambda: len(chunks) >= spec["warmup_calls"], spec["start_timeout"]):
        raise RuntimeError(f"no chunk within {spec['start_timeout']} s of the instruction; see {spec['logs']}")
    report["calls"] = _window(node, starts, chunks, spec["seconds"], period, pids, steal)
    steal.stop()
    node.destroy_node()
    rclpy.shutdown()
    return report


def _cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each node process has used so far."""
    import psutil

    return {n: sum(psutil.Process(p).cpu_times()[:2]) for n, p in pids.items()}


def _window(node, starts: list[int], chunks: list[int], seconds: float, period: float, pids: dict[str, int],
            steal: StealSampler) -> dict:
    """Spin ``seconds``; the statistics of the ticks that started inside, the calls completed,
    the share of a core each node process used, and the steal time (in all and near each gap)."""
    from vla_runtime.testing.scenarios import spin_until

    t0 = time.monotonic_ns()
    load_before, cpu0 = os.getloadavg(), _cpu_s(pids)
    spin_until(node, lambda: False, seconds)
    t1 = time.monotonic_ns()
    cpu = {n: round((c - cpu0[n]) / ((t1 - t0) * 1e-9), 3) for n, c in _cpu_s(pids).items()}
    spin_until(node, lambda: False, 1.5)   # the trace of the window's last second is on its way
    inside = sorted(s for s in starts if t0 <= s <= t1)
    stats = tick_statistics(inside, period).as_dict()
    expected = round((t1 - t0) * 1e-9 / period)
    slack = int(STEAL_SLACK_MS * 1e6)
    gaps = [[round(s * 1e-9, 3), round(g_ms, 2), steal.stolen_ms(s - int(g_ms * 1e6) - slack, s + slack)]
            for s, g_ms in long_gaps(inside, period)]
    # missed (a gap over 1.5 periods) also counts a tick that ran late but ran; not_run: ticks
    # the window should have held and did not (the schedule skipped them)
    return {**stats, "seconds": (t1 - t0) * 1e-9, "expected_ticks": expected,
            "not_run": max(0, expected - stats["ticks"]),
            # [monotonic s of the late start, gap ms, ms stolen around it] (and, added outside the
            # namespace, where the policy process's threads were), each over 1.5 periods
            "long_gaps": gaps,
            "steal_ms": steal.stolen_ms(t0, t1),   # stolen from all CPUs by the hypervisor in the window
            "steal_chance_near_a_tick": steal.chance_near(inside, period),
            "calls_completed": sum(t0 <= c <= t1 for c in chunks), "cores_used": cpu, "load_average_before": load_before,
            "load_average_after": os.getloadavg()}


# ------------------------------------------------------------------ outside

def late_ticks(log: Path) -> list[tuple[float, str]]:
    """(monotonic s, where the other threads were) of each late tick the policy node logged."""
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = LATE_LINE.search(line)
        if m:
            out.append((float(m.group(1)), m.group(2).strip()))
    return out


def where_late(late: list[tuple[float, str]], at_s: float) -> str:
    """Where the threads were at the late tick logged at ``at_s`` ('' if none was logged then:
    the log keeps at most one a second)."""
    near = [w for t, w in late if abs(t - at_s) <= LATE_MATCH_S]
    return near[0] if near else ""

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each window (idle, calls)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per node process (the profile's engine.threads)")
    ap.add_argument("--camera-hz", type=float, default=15.0)
    ap.add_argument("--image-size", type=int, default=64, help="square camera frames (the checkpoint's 64x64)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds the robot plays before the idle window")
    ap.add_argument("--warmup-calls", type=int, default=3, help="chunks before the calls window starts")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "control_tick", help="profile and node logs")
    ap.add_argument("--install", type=Path, default=ROOT / "install")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tick-rt-priority", type=int, default=None, help="override streaming.tick_rt_priority")
    ap.add_argument("--policy-nice", default=None, help="override streaming.policy_nice (an int, or 'null')")
    ap.add_argument("--inside", help=argparse.SUPPRESS)   # the run inside the namespace: its spec
    args = ap.parse_args()
    if args.inside:
        print(json.dumps(robot_and_measure(json.loads(args.inside))))
        return 0

    from vla_runtime.testing.netns import ros_env, run_in_private_netns

    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    profile = args.work / "profile.yaml"
    overrides: dict = {}
    if args.tick_rt_priority is not None:
        overrides["tick_rt_priority"] = args.tick_rt_priority
    if args.policy_nice is not None:
        overrides["policy_nice"] = None if args.policy_nice == "null" else int(args.policy_nice)
    prof = bench_profile(args.threads, overrides)
    profile.write_text(yaml.safe_dump(prof))
    spec = {"profile": str(profile), "logs": str(args.work / "logs"), "tag": f"ct{os.getpid()}",
            "seconds": args.seconds, "camera_hz": args.camera_hz, "image_size": args.image_size,
            "settle": args.settle, "warmup_calls": args.warmup_calls, "start_timeout": args.start_timeout}
    load = os.getloadavg()
    out = run_in_private_netns([sys.executable, str(Path(__file__).resolve()), "--inside", json.dumps(spec)],
                               env=ros_env(args.install), timeout=2 * args.seconds + 2 * args.start_timeout + 120,
                               cwd=args.work)
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-5000:], f"node logs: {spec['logs']}", sep="\n", file=sys.stderr)
        return 1
    windows = json.loads(out.stdout.strip().splitlines()[-1])
    late = late_ticks(Path(spec["logs"]) / "policy_node.log")
    for w in windows.values():
        w["long_gaps"] = [g + [where_late(late, g[0])] for g in w["long_gaps"]]
    report = {"profile": str(profile), "checkpoint": str(CHECKPOINT), "threads": args.threads,
              "control_hz": prof["control_hz"], "streaming": prof["streaming"], "cpus": os.cpu_count(),
              "load_average_at_start": load, "measured": "tick callback start, monotonic clock, in the policy node",
              "missed_rule": "gap between consecutive tick starts > 1.5 periods; round(gap/period) - 1 ticks (>= 1)",
              **windows}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for w in ("idle", "calls"):
        r = report[w]
        print(f"{w:5}: period p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} max {r['max_ms']:.2f} ms, "
              f"{r['missed']} missed ({r['not_run']} not run), {r['late']} late, {r['ticks']} ticks, {r['calls_completed']} calls", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
