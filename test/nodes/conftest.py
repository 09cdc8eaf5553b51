"""Fixtures shared by the node-layer tests: one pi05-tiny demo robot (checkpoint, episode bags)
with a reference repository built from its episodes, made once per test session."""

from __future__ import annotations

import pytest

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import list_episode_bags, read_episode
from vla_runtime.tools.demo import DemoSpec, demo_topics, make_demo

CAMS = ("top", "wrist")


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline_demo")
    info = make_demo(root, DemoSpec(preset="pi05-tiny", episodes=4, held_out=1, steps_per_episode=30), log=lambda m: None)
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMS))
    build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), root / "repo",
                     demo_topics(CAMS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    episode = read_episode(list_episode_bags(info["held_out"])[0], demo_topics(CAMS), call_period=0.5)
    return {**info, "repo": root / "repo", "episode": episode}
