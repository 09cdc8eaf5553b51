"""The real vision and policy node processes (rclpy, shared-memory ring buffer) against a test
robot process publishing a frame of a committed episode bag, in a private network namespace: the
chunk they publish equals the in-process engine's for the same observation, state and noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.io.bags import BagTopics, read_episode
from vla_runtime.testing.netns import ros_env, run_in_private_netns
from vla_runtime.tools.demo import DemoSpec, make_demo

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install"
PEERS = Path(__file__).with_name("pipeline_peers.py")


def test_nodes_publish_the_engines_chunk(tmp_path: Path) -> None:
    if not (INSTALL / "setup.bash").is_file():
        pytest.fail(f"{INSTALL}/setup.bash missing: build the ROS 2 side first with `make ros`")
    demo = make_demo(tmp_path / "demo", DemoSpec(preset="pi05-tiny", episodes=2, held_out=1, steps_per_episode=20),
                     log=lambda m: None)
    profile = yaml.safe_load((ROOT / "config" / "sim.yaml").read_text())
    profile["engine"]["checkpoint"] = demo["checkpoint"]
    profile["control_hz"] = 20.0
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile))
    # The robot publishes a frame of the small episode bag committed under test/data (decoded to
    # raw images, as the profile's camera topics carry sensor_msgs/Image).
    topics = BagTopics(cameras={c: v["topic"] for c, v in profile["cameras"].items()})
    episode = read_episode(ROOT / "test" / "data" / "replay" / "episode", topics, call_period=0.5)
    frame = episode.frames[1]
    images = {c: np.asarray(frame.images[c], dtype=np.uint8) for c in ("top", "wrist")}
    state = np.asarray(frame.state, dtype=np.float32)
    task = episode.task
    spec = {"profile": str(tmp_path / "profile.yaml"), "images": {c: v.tolist() for c, v in images.items()},
            "state": state.tolist(), "task": task, "joint_names": profile["joint_names"],
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "timeout": 90}
    try:
        out = run_in_private_netns([sys.executable, str(PEERS), "run", json.dumps(spec)], env=ros_env(INSTALL),
                                   timeout=180, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"pipeline timed out; stderr:\n{exc.stderr}")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert float(report["diagnostics"]["call_latency_s"]) > 0 and int(report["diagnostics"]["calls"]) >= 1
    got = report["chunk"]
    # The first chunk's call: call 0, or a later one when an early request went unanswered (sent
    # before the vision node was up) and was asked again. No chunk was merged before it, so its
    # prompt state is the observed state; its noise is seeded by its call id.
    call_id = got["call_id"]
    assert call_id <= 5

    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=["top", "wrist"])
    expected = policy.predict(Observation(images=images, state=state, task=task),
                              generator=torch.Generator().manual_seed(call_id)).actions
    assert got["shape"] == list(expected.shape)
    np.testing.assert_allclose(np.asarray(got["actions"]).reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
