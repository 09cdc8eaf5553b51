"""The ROS 2 side, built for real by `make ros` (colcon, rosidl) and exercised with real rclpy.

Every process that creates a ROS 2 node runs in a private network namespace whose only
interface is loopback (vla_runtime.testing.netns), so DDS discovery never leaves the machine.
Needs install/ from `make ros` (make test builds it first) and root for `unshare -n`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vla_runtime.testing.netns import ros_env, run_in_private_netns

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install"
PEERS = Path(__file__).with_name("ros_peers.py")


@pytest.fixture
def env() -> dict[str, str]:
    """rclpy + our messages from install/, fresh ROS_DOMAIN_ID for each test."""
    if not (INSTALL / "setup.bash").is_file():
        pytest.fail(f"{INSTALL}/setup.bash missing: build the ROS 2 side first with `make ros`")
    return ros_env(INSTALL)


def test_install_space_exposes_messages(env: dict[str, str], tmp_path: Path) -> None:
    # cwd outside the repo: the source tree's vla_runtime/ (no msg/) must not shadow install/.
    probe = (
        "import json, vla_runtime, vla_runtime.msg as m\n"
        "print(json.dumps({'file': vla_runtime.__file__, 'types': {n: getattr(m, n).get_fields_and_field_types()\n"
        "    for n in ('SlotReady', 'PhaseLatency', 'ActionChunk')}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert Path(got["file"]).is_relative_to(INSTALL), got["file"]
    assert got["types"]["ActionChunk"] == {
        "header": "std_msgs/Header", "call_id": "uint64", "joint_names": "sequence<string>",
        "control_period": "double", "chunk_length": "uint32", "action_dim": "uint32",
        "actions": "sequence<double>", "source": "string", "observation_seq": "uint64",
    }
    assert got["types"]["SlotReady"]["sequence"] == "uint64"
    assert got["types"]["PhaseLatency"]["total"] == "double"


def test_private_netns_has_only_loopback(env: dict[str, str]) -> None:
    check = "from vla_runtime.testing.netns import assert_only_loopback; assert_only_loopback(); print('ok')"
    out = run_in_private_netns([sys.executable, "-c", check], env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_participant_killed_in_the_namespace_leaves_no_dds_state_in_dev_shm(env: dict[str, str]) -> None:
    """/dev/shm is shared by every network namespace: a Fast DDS shared-memory port a SIGKILLed
    node left there would be opened again by a later test's node of the same domain. Inside our
    namespace DDS runs over UDP alone, so a node that dies without cleaning up leaves nothing."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir()}
    code = ("import os, rclpy; from std_msgs.msg import String; rclpy.init(); node = rclpy.create_node('dies'); "
            "pub = node.create_publisher(String, 'chatter', 10); sub = node.create_subscription(String, 'chatter', "
            "lambda m: None, 10)\nfor _ in range(5): pub.publish(String(data='x')); rclpy.spin_once(node, timeout_sec=0.1)\n"
            "print(os.environ['FASTDDS_BUILTIN_TRANSPORTS'], flush=True); os.kill(os.getpid(), 9)")
    out = run_in_private_netns([sys.executable, "-c", code], env=env, timeout=60)
    assert out.returncode == -9 and out.stdout.strip() == "UDPv4", (out.returncode, out.stdout, out.stderr)
    left = sorted(p.name for p in shm.iterdir() if p.name not in before and "fastrtps" in p.name)
    assert left == [], left


def test_two_processes_exchange_action_chunk_and_joint_state(env: dict[str, str], tmp_path: Path) -> None:
    joints = [f"left_joint_{i}" for i in range(3)]
    chunk_length, action_dim = 4, len(joints)
    spec = {
        "chunk": {
            "stamp": {"sec": 1_700_000_000, "nanosec": 123_456_789}, "frame_id": "",
            "call_id": 2**40 + 7, "joint_names": joints, "control_period": 0.02,
            "chunk_length": chunk_length, "action_dim": action_dim,
            # Values that a float32 or a text round trip would not keep exactly.
            "actions": [i / 3 - 1e-300 * (i % 2) for i in range(chunk_length * action_dim)],
            "source": "cached", "observation_seq": 2**63 + 5,
        },
        "joints": {
            "stamp": {"sec": 1_700_000_000, "nanosec": 100_000_000}, "name": joints,
            "position": [0.1, -0.2, 1 / 7], "velocity": [0.0, 1.5, -2.25], "effort": [],
        },
    }
    try:
        out = run_in_private_netns([sys.executable, str(PEERS), "exchange", json.dumps(spec)],
                                   env=env, timeout=90, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"exchange timed out; stderr:\n{exc.stderr}")
    assert out.returncode == 0, f"exchange failed ({out.returncode}):\n{out.stderr}"
    assert json.loads(out.stdout) == spec


def test_env_script_puts_the_virtualenv_on_the_ament_path(tmp_path: Path) -> None:
    """`source install/vla_runtime_env.bash` (written by `make ros`) is all a user needs: the
    ament index then holds the wheels' packages (std_msgs: what `ros2 interface show
    vla_runtime/msg/ActionChunk` resolves its header with) next to ours, as `ros2 pkg list` and
    `ros2 interface show` read it. Sourced under `set -eu`, as a careful script would."""
    script = INSTALL / "vla_runtime_env.bash"
    assert script.is_file(), "install/vla_runtime_env.bash missing: rebuild with tools/ros/build.sh"
    probe = ("from ament_index_python import get_packages_with_prefixes, get_resource; import json, sys; "
             "p = get_packages_with_prefixes(); "
             "print(json.dumps({'std_msgs': p.get('std_msgs'), 'vla_runtime': p.get('vla_runtime'), "
             "'interfaces': get_resource('rosidl_interfaces', 'vla_runtime')[0].split(), "
             "'header': 'msg/Header.msg' in get_resource('rosidl_interfaces', 'std_msgs')[0]}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMENT", "COLCON", "ROS_"))}
    env.pop("_ROS_WHEELS_BOOTSTRAP_COMPLETE", None)
    out = subprocess.run(["bash", "-c", f'set -eu; source "{script}"; echo "$AMENT_PREFIX_PATH"; '
                                        f'python3 -c "{probe}"'],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, report = out.stdout.strip().splitlines()[-2:]
    prefixes = [Path(p).resolve() for p in path.split(":")]
    assert Path(sys.prefix).resolve() in prefixes and (INSTALL / "vla_runtime").resolve() in prefixes, path
    got = json.loads(report)
    assert Path(got["std_msgs"]).resolve() == Path(sys.prefix).resolve(), got
    assert Path(got["vla_runtime"]).resolve() == (INSTALL / "vla_runtime").resolve(), got
    assert "msg/ActionChunk.msg" in got["interfaces"] and got["header"], got
