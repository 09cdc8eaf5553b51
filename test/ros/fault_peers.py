"""Driver for test_faults.py, run inside one private network namespace (not a test module).

    python fault_peers.py run SPEC_JSON

Starts the real vision, policy and cache manager node processes once, then plays a test robot
(rclpy, this process) through a sequence of bad inputs and faults, one phase at a time: each
phase changes what the robot publishes (or kills, stalls, restarts a node) and waits, bounded,
for the nodes' diagnostics to report it and for the robot to be served again. Every
JointTrajectory and ActionChunk the policy publishes is checked: finite, within the joint
limits. Prints a JSON report (per phase: what was seen) on the last line of stdout.
SPEC_JSON: {"profile": path, "images": {camera: [[...]]}, "state": [...], "task": str,
"other_task": str, "joint_names": [...], "lower": [...], "upper": [...], "cameras": {camera:
topic}, "rings": suffix, "timeout": seconds per phase}.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

from vla_runtime.nodes.launching import RESPAWN_DELAY_S
from vla_runtime.testing.netns import assert_only_loopback
from vla_runtime.testing.scenarios import rgb_image

NODES = ("cache_manager_node", "vision_node", "policy_node")


def start_node(name: str, spec: dict) -> subprocess.Popen:
    sfx = spec["rings"]
    args = ["--ros-args", "-p", f"profile:={spec['profile']}", "-p", f"working_set:=refs_{sfx}"]
    # The vision node's stamp limit is raised from 1 s to 5 s: on a loaded 2-core machine its image
    # queue can lag a second, and the frozen-camera phase needs its first frame accepted (the bad
    # stamps the phases send are 30 s off, refused either way).
    extra = {"vision_node": ["-p", f"ring:=prefix_{sfx}", "-p", "max_input_age_s:=5.0"],
             "cache_manager_node": [],
             # On a slow machine a call can take seconds, and re-asking before it is answered only
             # makes the answer a stale slot.
             "policy_node": ["-p", "request_timeout_s:=6.0"]}
    log = open(os.path.join(spec["logs"], f"{name}.log"), "a")
    return subprocess.Popen([sys.executable, "-m", f"vla_runtime.nodes.{name}", *args, *extra[name]],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def scenario(spec: dict, nodes: dict) -> dict:
    import numpy as np
    import rclpy
    from builtin_interfaces.msg import Time
    from diagnostic_msgs.msg import DiagnosticArray
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import GetParameters, SetParameters
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Empty, String
    from trajectory_msgs.msg import JointTrajectory

    from vla_runtime.msg import ActionChunk, PrefixRequest, ReferenceSelection

    rclpy.init()
    node = rclpy.create_node("test_robot")
    lower, upper = np.asarray(spec["lower"]), np.asarray(spec["upper"])
    report: dict = {"phases": {}, "violations": [], "trajectories": 0, "chunks": 0, "holds": 0}
    diag: dict = {}          # newest status per node
    diag_log: list = []      # every status received, in order: a phase looks for what it expects
                             # among all statuses since it began, since a later one may overwrite it
    chunks: list = []
    requests: list = []

    def check(values, what: str) -> None:
        a = np.asarray(values, dtype=np.float64)
        if not np.isfinite(a).all() or (a < lower - 1e-9).any() or (a > upper + 1e-9).any():
            report["violations"].append(f"{what}: {a.tolist()}")

    def on_traj(m) -> None:
        report["trajectories"] += 1
        report["holds"] += int(len(m.points) == 1)
        for p in m.points:
            check(p.positions, "trajectory point")

    def on_chunk(m) -> None:
        report["chunks"] += 1
        check(np.asarray(m.actions).reshape(m.chunk_length, m.action_dim), f"action chunk {m.call_id}")
        chunks.append((time.monotonic(), int(m.call_id), m.source))

    def on_diag(m) -> None:
        s = m.status[0]
        diag[s.name] = {"level": int.from_bytes(s.level, "little") if isinstance(s.level, bytes) else int(s.level),
                        "message": s.message, **{kv.key: kv.value for kv in s.values}}
        diag_log.append((s.name, diag[s.name]))

    node.create_subscription(JointTrajectory, "/joint_trajectory_controller/joint_trajectory", on_traj, 50)
    node.create_subscription(ActionChunk, "/vla_runtime/action_chunk", on_chunk, 50)
    node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 50)
    node.create_subscription(PrefixRequest, "/vla_runtime/prefix_request",
                             lambda m: requests.append((time.monotonic(), int(m.request_seq))), 50)
    cams = {c: node.create_publisher(Image, t, 10) for c, t in spec["cameras"].items()}
    joints = node.create_publisher(JointState, "/joint_states", 10)
    instruction = node.create_publisher(String, "/instruction", 10)
    episode_start = node.create_publisher(Empty, "/vla_runtime/episode_start", 10)
    selections = node.create_publisher(ReferenceSelection, "/vla_runtime/reference_selection", 10)
    images = {c: np.asarray(v, dtype=np.uint8) for c, v in spec["images"].items()}
    names = list(spec["joint_names"])
    state = [float(x) for x in spec["state"]]
    # What the robot publishes each period; phases change it.
    mode: dict = {"task": spec["task"], "frozen": None, "image": {}, "joints_extra": None}

    def now_stamp(offset_s: float = 0.0) -> Time:
        ns = node.get_clock().now().nanoseconds + int(offset_s * 1e9)
        return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)

    def image_msg(cam: str):
        img = images[cam]
        m = rgb_image(img, now_stamp())
        bad = mode["image"].get(cam)
        if bad == "encoding":
            m.encoding = "yuv422"
        elif bad == "size":
            m.height = img.shape[0] * 4
        elif bad == "future":
            m.header.stamp = now_stamp(+30.0)
        elif bad == "old":
            m.header.stamp = now_stamp(-30.0)
        if mode["frozen"] is not None and mode["frozen"][0] == cam:
            m.header.stamp = mode["frozen"][1]                   # the same (recent) stamp, again and again
        return m

    def publish() -> None:
        for c in cams:
            cams[c].publish(image_msg(c))
        js = JointState(name=names, position=state)
        js.header.stamp = now_stamp()
        joints.publish(js)
        if mode["joints_extra"] is not None:
            joints.publish(mode["joints_extra"])
        instruction.publish(String(data=mode["task"]))

    node.create_timer(0.05, publish)

    def spin_until(pred, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (timeout or spec["timeout"])
        while time.monotonic() < deadline:
            rclpy.spin_once(node, timeout_sec=0.05)
            if pred():
                return True
        return False

    def d(name: str, key: str, default: str = "") -> str:
        return diag.get(f"vla_runtime: {name}", {}).get(key, default)

    def n(name: str, key: str) -> int:
        return int(d(name, key, "0") or 0)

    def reported(name: str, key: str, text: str, since: int) -> dict | None:
        """The first status of node ``name`` since ``diag_log[since]`` whose ``key`` contains ``text``."""
        return next((st for nm, st in diag_log[since:] if nm == f"vla_runtime: {name}" and text in st.get(key, "")),
                    None)

    def chunk_after(t: float, source: str | None = None) -> bool:
        return any(ct > t and (source is None or src == source) for ct, _, src in chunks)

    def phase(name: str, **seen) -> None:
        report["phases"][name] = {**seen, "violations_so_far": len(report["violations"])}

    # ---- 0: the pipeline serves the robot
    ok = spin_until(lambda: chunk_after(0, "cached") and n("vision", "calls") >= 1 and n("vision", "queries") >= 1,
                    timeout=spec["timeout"] * 3)
    phase("warm_up", ok=ok, sources=sorted({s for _, _, s in chunks}))

    # ---- 1-4: bad images (each camera message refused at the boundary, the others keep the robot served)
    for bad, cam, text in [("encoding", "top", "unsupported Image encoding"), ("size", "wrist", "inconsistent"),
                           ("future", "top", "in the future"), ("old", "wrist", "s old, older than")]:
        before, since = n("vision", "refused_images"), len(diag_log)
        mode["image"] = {cam: bad}
        ok = spin_until(lambda: n("vision", "refused_images") > before
                        and reported("vision", "last_refusal", text, since) is not None)
        mode["image"] = {}
        refusal = (reported("vision", "last_refusal", text, since) or {}).get("last_refusal", "")
        t = time.monotonic()
        served = spin_until(lambda: chunk_after(t), timeout=2 * spec["timeout"])
        phase(f"image_{bad}", ok=ok, refusal=refusal, served_after=served)

    # ---- 5: a frozen camera: calls refused, the policy holds; served again once it sends new frames
    # The frozen stamp must pass the age check for the whole phase on a slow machine, so the
    # vision node is judged on what it reported while the phase ran (not just its last status).
    holds, since = n("policy", "holds_published"), len(diag_log)
    mode["frozen"] = ("wrist", now_stamp())
    ok = spin_until(lambda: reported("vision", "stale_cameras", "frozen", since) is not None
                    and n("policy", "holds_published") > holds)
    frozen = reported("vision", "stale_cameras", "frozen", since) or {}
    stale, level = frozen.get("stale_cameras", d("vision", "stale_cameras")), frozen.get("level")
    mode["frozen"] = None
    t = time.monotonic()
    served = spin_until(lambda: chunk_after(t), timeout=2 * spec["timeout"])
    phase("camera_frozen", ok=ok, stale_cameras=stale, vision_level=level, served_after=served)

    # ---- 6-9: bad joint states next to the good ones
    for what, msg, text in [("wrong_names", JointState(name=["elbow", "wrist"], position=[0.0, 0.0]), "match none"),
                            ("wrong_length", JointState(name=names, position=state[:-1]), "names but"),
                            ("nan", JointState(name=names, position=[math.nan] + state[1:]), "non-finite"),
                            ("future_stamp", JointState(name=names, position=state), "in the future"),
                            ("old_stamp", JointState(name=names, position=state), "s old, older than")]:
        if what == "future_stamp":
            msg.header.stamp = now_stamp(+30.0)
        elif what == "old_stamp":
            msg.header.stamp = now_stamp(-30.0)
        before, since = n("policy", "refused_joint_states"), len(diag_log)
        mode["joints_extra"] = msg
        ok = spin_until(lambda: n("policy", "refused_joint_states") > before
                        and reported("policy", "last_refusal", text, since) is not None)
        mode["joints_extra"] = None
        refusal = (reported("policy", "last_refusal", text, since) or {}).get("last_refusal", "")
        phase(f"joint_state_{what}", ok=ok, refusal=refusal)

    # ---- 10: an empty instruction is ignored
    # Sent every period, as a robot's UI would keep sending it: the subscription keeps only the
    # newest few messages, so one message among 20 Hz of others may be dropped on a busy machine.
    before, since = n("policy", "refused_instructions"), len(diag_log)
    mode["task"] = "   "
    ok = spin_until(lambda: n("policy", "refused_instructions") > before
                    and reported("policy", "last_refusal", "empty instruction", since) is not None)
    mode["task"] = spec["task"]
    refusal = (reported("policy", "last_refusal", "empty instruction", since) or {}).get("last_refusal", "")
    phase("instruction_empty", ok=ok, task=d("policy", "task"), refusal=refusal)

    # ---- 11: a changed instruction starts a new episode in the cache manager (and back)
    episodes, changes = n("cache manager", "episodes_started"), n("policy", "instruction_changes")
    mode["task"] = spec["other_task"]
    t = time.monotonic()
    ok = spin_until(lambda: d("cache manager", "task") == spec["other_task"]
                    and n("cache manager", "episodes_started") > episodes
                    and n("policy", "instruction_changes") > changes)
    changed = (d("policy", "instruction_changes"), d("vision", "dense_reason"), time.monotonic() - t)
    mode["task"] = spec["task"]
    t = time.monotonic()
    back = spin_until(lambda: d("cache manager", "task") == spec["task"] and chunk_after(t, "cached"))
    # the times and the chunks' sources since the switch say where a slow phase waited
    phase("instruction_changed", ok=ok, back=back, changes=d("policy", "instruction_changes"), cache_reason=changed[1],
          episodes_started=d("cache manager", "episodes_started"), switch_s=round(changed[2], 2),
          back_s=round(time.monotonic() - t, 2), sources_since=[(round(ct - t, 2), src) for ct, _, src in chunks
                                                                 if ct > t - changed[2]][-40:])

    # ---- 11b: the same task starts again: the cache manager prepares the episode on the
    # announcement itself, so the episode's first query does not start it a second time
    before = n("cache manager", "episodes_started")
    episode_start.publish(Empty())
    prepared = spin_until(lambda: n("cache manager", "episodes_started") > before)
    t = time.monotonic()
    served = spin_until(lambda: len([1 for ct, _, src in chunks if ct > t and src == "cached"]) >= 2,
                        timeout=2 * spec["timeout"])
    phase("episode_start", ok=prepared and served,
          started=n("cache manager", "episodes_started") - before)

    # ---- 11c: a late selection of the task switched away from (a call in flight at the switch,
    # as phase 11 can leave one): dropped, not followed (following it restarted that task's
    # episode, then the next call restarted the current one)
    before, dropped = n("cache manager", "episodes_started"), n("cache manager", "notes_of_other_tasks")
    selections.publish(ReferenceSelection(request_seq=0, task=spec["other_task"], episode=0, found=False,
                                          reason="a late note"))   # request 0: its chunk is out, due at once
    ok = spin_until(lambda: n("cache manager", "notes_of_other_tasks") > dropped)
    t = time.monotonic()
    served = spin_until(lambda: chunk_after(t, "cached"), timeout=2 * spec["timeout"])
    phase("late_note_of_another_task", ok=ok, served_after=served, task=d("cache manager", "task"),
          instruction=spec["task"], started=n("cache manager", "episodes_started") - before)

    # ---- 12: parameters at run time (what `ros2 param set` does)
    def set_param(target: str, name: str, value) -> tuple[bool, str]:
        cli = node.create_client(SetParameters, f"/{target}/set_parameters")
        if not cli.wait_for_service(timeout_sec=10.0):
            return False, "no service"
        pv = ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value) if isinstance(value, float) \
            else ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
        fut = cli.call_async(SetParameters.Request(parameters=[Parameter(name=name, value=pv)]))
        rclpy.spin_until_future_complete(node, fut, timeout_sec=10.0)
        r = fut.result().results[0]
        return bool(r.successful), r.reason

    def get_param(target: str, name: str):
        cli = node.create_client(GetParameters, f"/{target}/get_parameters")
        cli.wait_for_service(timeout_sec=10.0)
        fut = cli.call_async(GetParameters.Request(names=[name]))
        rclpy.spin_until_future_complete(node, fut, timeout_sec=10.0)
        v = fut.result().values[0]
        return v.double_value if v.type == ParameterType.PARAMETER_DOUBLE else v.integer_value

    phase("parameters", out_of_range=set_param("vla_policy", "request_timeout_s", -1.0),
          fixed=set_param("vla_policy", "seed", 5), vision_out_of_range=set_param("vla_vision", "frozen_after", 1),
          accepted=set_param("vla_policy", "request_timeout_s", 2.5),
          value_after=get_param("vla_policy", "request_timeout_s"), seed_after=get_param("vla_policy", "seed"))

    # ---- 13: the vision node stalls: the policy holds; its late slot is not executed
    seen = len(requests)
    nodes["vision_node"].send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    # Held: a new hold published, or (when the plan had already gone stale before the stop and its
    # hold was published then) the policy reporting its plan stale during the stall; and asked again.
    holds, since = n("policy", "holds_published"), len(diag_log)
    ok = spin_until(lambda: (n("policy", "holds_published") > holds
                             or reported("policy", "plan_stale", "True", since) is not None) and len(requests) > seen + 1)
    in_flight = [s for t_, s in requests if t_ < t_stop][-1:]
    during = [s for t_, s in requests if t_ >= t_stop]
    nodes["vision_node"].send_signal(signal.SIGCONT)
    t = time.monotonic()
    served = spin_until(lambda: chunk_after(t), timeout=2 * spec["timeout"])
    spin_until(lambda: False, timeout=1.0)
    abandoned = sorted(set(in_flight + during) - {max(during)}) if during else []
    phase("vision_stalled", ok=ok, served_after=served, abandoned=abandoned,
          late_executed=[c for ct, c, _ in chunks if ct > t and c in abandoned], stale_slots=d("policy", "stale_slots"))

    # ---- 14: the vision node dies: the policy holds within its watchdog, says so; recovery on restart
    holds = n("policy", "holds_published")
    nodes["vision_node"].kill()
    nodes["vision_node"].wait()
    t = time.monotonic()
    ok = spin_until(lambda: n("policy", "holds_published") > holds and d("policy", "plan_stale") == "True")
    held = (d("policy", "plan_stale"), diag.get("vla_runtime: policy", {}).get("message"))
    spin_until(lambda: False, timeout=RESPAWN_DELAY_S)   # restarted as the launch respawns it
    nodes["vision_node"] = start_node("vision_node", spec)
    t = time.monotonic()
    back = spin_until(lambda: chunk_after(t), timeout=spec["timeout"] * 3)
    phase("vision_killed", ok=ok, held=held, recovered=back)

    # ---- 15: the cache manager dies: calls go on at once (from the window it left, or dense);
    # cached again from the new one when it returns
    nodes["cache_manager_node"].kill()
    nodes["cache_manager_node"].wait()
    t = time.monotonic()
    served = spin_until(lambda: len([1 for ct, _, _ in chunks if ct > t]) >= 3)
    sources = [src for ct, _, src in chunks if ct > t][:10]
    spin_until(lambda: False, timeout=max(0.0, RESPAWN_DELAY_S - (time.monotonic() - t)))   # as respawn does
    nodes["cache_manager_node"] = start_node("cache_manager_node", spec)
    t, since = time.monotonic(), len(diag_log)
    back = spin_until(lambda: chunk_after(t, "cached"), timeout=spec["timeout"] * 3)
    # when it is not back: whether the restarted node was heard at all (DDS), and what it said
    heard = [st for nm, st in diag_log[since:] if nm == "vla_runtime: cache manager"]
    phase("cache_manager_killed", served=served, sources=sources, recovered_cached=back,
          restarted_heard=len(heard), restarted_last={k: heard[-1].get(k) for k in ("message", "episodes_started",
                                                                                  "policy_heard")} if heard else {})

    # ---- 16: the policy node dies: the others and the rings survive, and both report it as an
    # ERROR naming it (the launch does not restart it); it resumes when restarted, and the ERROR clears.
    # First both peers must have heard it: the cache manager restarted above may not have yet (a
    # peer never heard is only a warning: a node still starting is not a node that died)
    spin_until(lambda: d("vision", "policy_heard") == "True" and d("cache manager", "policy_heard") == "True")
    nodes["policy_node"].kill()
    nodes["policy_node"].wait()
    since = len(diag_log)
    t = time.monotonic()

    def peer_error(name: str) -> dict | None:
        return next((st for nm, st in diag_log[since:] if nm == f"vla_runtime: {name}" and st["level"] == 2
                     and "policy node silent" in st["message"]), None)
    reported_ok = spin_until(lambda: peer_error("vision") is not None and peer_error("cache manager") is not None)
    reported = {n: (peer_error(n) or {}).get("message", "") for n in ("vision", "cache manager")}
    reported_after_s = round(time.monotonic() - t, 2)
    alive = {k: p.poll() is None for k, p in nodes.items() if k != "policy_node"}
    nodes["policy_node"] = start_node("policy_node", spec)
    t = time.monotonic()
    back = spin_until(lambda: chunk_after(t), timeout=spec["timeout"] * 3)
    cleared = spin_until(lambda: all(diag.get(f"vla_runtime: {n}", {}).get("level") in (0, 1)
                                     for n in ("vision", "cache manager")))
    phase("policy_killed", others_alive=alive, recovered=back, reported=reported, reported_ok=reported_ok,
          reported_after_s=reported_after_s, cleared=cleared)

    node.destroy_node()
    rclpy.shutdown()
    return report


def run(spec: dict) -> int:
    assert_only_loopback()
    nodes = {name: start_node(name, spec) for name in NODES}
    try:
        report = scenario(spec, nodes)
    finally:
        for p in nodes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in nodes.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    report["exit_codes"] = {k: p.returncode for k, p in nodes.items()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit({"run": run}[sys.argv[1]](json.loads(sys.argv[2])))
