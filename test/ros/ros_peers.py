"""Peer processes for test_ros_build.py: a real rclpy publisher and subscriber.

Not a test module (pytest collects test_*.py only). Run inside a private network namespace
(vla_runtime.testing.netns.run_in_private_netns) with the environment of ros_env():

    python ros_peers.py exchange SPEC_JSON

The `exchange` driver checks that only loopback exists, starts a subscriber process and a
publisher process, waits (bounded) for the subscriber, stops the publisher and prints the
subscriber's JSON report of what it received on stdout. SPEC_JSON says what to publish:
{"chunk": {ActionChunk fields}, "joints": {JointState fields}}, with stamps as
{"sec": int, "nanosec": int}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from vla_runtime.testing.netns import assert_only_loopback

CHUNK_TOPIC = "vla_runtime/test/action_chunk"
JOINTS_TOPIC = "vla_runtime/test/joint_states"
PUBLISH_PERIOD = 0.05     # publisher resends until stopped: no reliance on discovery timing
PUBLISHER_LIFETIME = 60.0  # publisher exits by itself after this, even if never stopped
SUBSCRIBER_TIMEOUT = 30.0  # subscriber gives up (exit 2) if it has not received both by then


def _stamp_from(d: dict) -> object:
    from builtin_interfaces.msg import Time
    return Time(sec=d["sec"], nanosec=d["nanosec"])


def _stamp_to(t: object) -> dict:
    return {"sec": t.sec, "nanosec": t.nanosec}


def build_messages(spec: dict) -> tuple[object, object]:
    """The ActionChunk and JointState described by `spec`."""
    from sensor_msgs.msg import JointState

    from vla_runtime.msg import ActionChunk

    c = spec["chunk"]
    chunk = ActionChunk()
    chunk.header.stamp = _stamp_from(c["stamp"])
    chunk.header.frame_id = c["frame_id"]
    chunk.call_id = c["call_id"]
    chunk.joint_names = c["joint_names"]
    chunk.control_period = c["control_period"]
    chunk.chunk_length = c["chunk_length"]
    chunk.action_dim = c["action_dim"]
    chunk.actions = c["actions"]
    chunk.source = c["source"]
    chunk.observation_seq = c["observation_seq"]

    j = spec["joints"]
    joints = JointState()
    joints.header.stamp = _stamp_from(j["stamp"])
    joints.name = j["name"]
    joints.position = j["position"]
    joints.velocity = j["velocity"]
    joints.effort = j["effort"]
    return chunk, joints


def report(chunk: object, joints: object) -> dict:
    """What the subscriber received, in the SPEC_JSON layout."""
    return {
        "chunk": {
            "stamp": _stamp_to(chunk.header.stamp), "frame_id": chunk.header.frame_id,
            "call_id": chunk.call_id, "joint_names": list(chunk.joint_names),
            "control_period": chunk.control_period, "chunk_length": chunk.chunk_length,
            "action_dim": chunk.action_dim, "actions": [float(a) for a in chunk.actions],
            "source": chunk.source, "observation_seq": chunk.observation_seq,
        },
        "joints": {
            "stamp": _stamp_to(joints.header.stamp), "name": list(joints.name),
            "position": [float(x) for x in joints.position],
            "velocity": [float(x) for x in joints.velocity],
            "effort": [float(x) for x in joints.effort],
        },
    }


def publish(spec: dict) -> int:
    import rclpy
    from rclpy.executors import ExternalShutdownException
    from sensor_msgs.msg import JointState

    from vla_runtime.msg import ActionChunk

    assert_only_loopback()
    chunk, joints = build_messages(spec)
    rclpy.init()
    node = rclpy.create_node("vla_runtime_test_publisher")
    chunk_pub = node.create_publisher(ActionChunk, CHUNK_TOPIC, 10)
    joints_pub = node.create_publisher(JointState, JOINTS_TOPIC, 10)
    deadline = time.monotonic() + PUBLISHER_LIFETIME
    try:
        while time.monotonic() < deadline:
            chunk_pub.publish(chunk)
            joints_pub.publish(joints)
            rclpy.spin_once(node, timeout_sec=PUBLISH_PERIOD)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass  # stopped by the driver
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


def subscribe() -> int:
    import rclpy
    from sensor_msgs.msg import JointState

    from vla_runtime.msg import ActionChunk

    assert_only_loopback()
    rclpy.init()
    node = rclpy.create_node("vla_runtime_test_subscriber")
    got: dict[str, object] = {}
    node.create_subscription(ActionChunk, CHUNK_TOPIC, lambda m: got.setdefault("chunk", m), 10)
    node.create_subscription(JointState, JOINTS_TOPIC, lambda m: got.setdefault("joints", m), 10)
    deadline = time.monotonic() + SUBSCRIBER_TIMEOUT
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            rclpy.spin_once(node, timeout_sec=0.1)
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    if len(got) < 2:
        print(f"subscriber: timed out after {SUBSCRIBER_TIMEOUT}s, received only {sorted(got)}", file=sys.stderr)
        return 2
    print(json.dumps(report(got["chunk"], got["joints"])))
    return 0


def exchange(spec_json: str) -> int:
    """Subscriber and publisher as two processes; print the subscriber's report."""
    assert_only_loopback()
    me = [sys.executable, __file__]
    sub = subprocess.Popen(me + ["sub"], stdout=subprocess.PIPE, text=True)
    pub = subprocess.Popen(me + ["pub", spec_json])
    try:
        out, _ = sub.communicate(timeout=SUBSCRIBER_TIMEOUT + 15)
    except subprocess.TimeoutExpired:
        sub.kill()
        out, _ = sub.communicate()
        print("exchange: subscriber did not exit in time", file=sys.stderr)
    finally:
        pub.terminate()
        try:
            pub.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pub.kill()
            pub.wait()
    sys.stdout.write(out)
    print(f"exchange: subscriber exit {sub.returncode}, publisher exit {pub.returncode}", file=sys.stderr)
    return sub.returncode


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "exchange" and len(argv) == 3:
        return exchange(argv[2])
    if mode == "pub" and len(argv) == 3:
        return publish(json.loads(argv[2]))
    if mode == "sub" and len(argv) == 2:
        return subscribe()
    print(__doc__, file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv))
