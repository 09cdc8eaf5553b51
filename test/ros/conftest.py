"""What the ROS scenarios share: one demo checkpoint, its reference repository and a camera frame,
built once per test session (the scenarios then write their own profiles around them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import list_episode_bags, read_episode
from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install"
CAMERAS = ("top", "wrist")


@pytest.fixture(scope="session")
def ros_demo(tmp_path_factory) -> dict:
    """A pi05-tiny demo checkpoint, a repository built from its reference episodes, the sim
    profile pointed at both (cache on), and the first frame of a held-out episode. Scenarios
    change a deep copy of the profile, never the dict itself."""
    if not (INSTALL / "setup.bash").is_file():
        pytest.fail(f"{INSTALL}/setup.bash missing: build the ROS 2 side first with `make ros`")
    tmp = tmp_path_factory.mktemp("ros_demo")
    demo = make_demo(tmp / "demo", DemoSpec(preset="pi05-tiny", episodes=3, held_out=1, steps_per_episode=20),
                     log=lambda m: None)
    builder = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMERAS))
    build_repository(builder, builder.checkpoint_hash, list_episode_bags(demo["references"]), tmp / "repo",
                     demo_topics(CAMERAS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    profile = yaml.safe_load((ROOT / "config" / "sim.yaml").read_text())
    profile["engine"].update(checkpoint=str(demo["checkpoint"]), preset="pi05-tiny", threads=1)
    profile["control_hz"] = 20.0
    profile["cache"] = {"enabled": True, "repository": str(tmp / "repo")}
    episode = read_episode(list_episode_bags(demo["held_out"])[0], demo_topics(CAMERAS), call_period=0.5)
    frame = episode.frames[0]
    return {"checkpoint": demo["checkpoint"], "repo": tmp / "repo", "profile": profile, "task": episode.task, "state": np.asarray(frame.state).tolist(),
            "images": {c: np.asarray(frame.images[c], dtype=np.uint8).tolist() for c in CAMERAS}}
