"""The real vision, policy and cache manager node processes (rclpy, shared-memory rings) against a
test robot process publishing a frame of a committed episode bag, in a private network namespace:
the chunk they publish equals the in-process cached engine's (Context and Action Cache, reference
chosen by the cache manager) for the same observation, state and noise."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import torch
import yaml

from vla_runtime.cache.manager import CacheManager
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.io.bags import BagTopics, read_episode
from vla_runtime.nodes.profile import CacheSpec
from vla_runtime.nodes.stages import manager_config
from vla_runtime.testing.scenarios import run_scenario

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install"
PEERS = Path(__file__).with_name("pipeline_peers.py")


def test_nodes_publish_the_engines_chunk(ros_demo, tmp_path: Path) -> None:
    cams = ["top", "wrist"]
    profile = copy.deepcopy(ros_demo["profile"])
    # likewise the watchdog: a chunk arriving later than watchdog_s after its call is not executed
    profile["streaming"]["watchdog_s"] = 30.0
    # the robot repeats one frame, so its calls keep matching one reference call, which may be that
    # episode's last: the fallback past the references would turn later calls dense, and the
    # vision node's newest diagnostics would name no reference. This test is about the chunk.
    profile["cache"]["max_end_matches"] = 0
    # the episode's first search waits for the complete initial window however loaded the machine
    # (the bounded default would search a partial one: another reference than in one process)
    profile["cache"]["first_search_wait_s"] = 240.0
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
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "timeout": 120,
            "rings": f"t{os.getpid()}"}
    report = run_scenario(PEERS, spec, INSTALL, timeout=240, cwd=tmp_path)
    diag = report["diagnostics"]
    assert float(diag["vla_runtime: policy"]["call_latency_s"]) > 0 and int(diag["vla_runtime: policy"]["calls"]) >= 1
    assert float(diag["vla_runtime: vision"]["vision_s"]) > 0
    assert int(diag["vla_runtime: vision"]["hits"]) >= 1 and int(diag["vla_runtime: cache manager"]["selections"]) >= 1
    # the cached call's reference was announced before its prefill (reference_ahead) and gathered then
    assert int(diag["vla_runtime: policy"]["gathered_ahead"]) >= 1
    got = report["chunk"]
    assert got["source"] == "cached"
    # The first cached chunk's call: call 0, or a later one when the initial window was not
    # published yet (those ran dense) or an early request went unanswered (sent before the vision
    # node was up). Its prompt state is the one its request carried (the predicted state once a
    # dense chunk is executing), its noise is seeded by its call id, and its reference is the
    # episode's first search, which sees exactly the initial window (nodes/selection.py), after
    # the earlier calls' states entered the joint history, as in-process.
    call_id = got["call_id"]
    assert report.get("dense_before", 0) <= call_id
    ran = sorted(int(c) for c in report["reasons"] if int(c) <= call_id)   # the calls the vision node ran
    before = [report["reasons"][str(i)] for i in ran[:-1]]
    assert all(r.startswith(("no working set yet", "initial window still being prepared")) for r in before), before
    states = [np.asarray(report["states"][str(i)], dtype=np.float32) for i in ran]

    policy = Pi05Policy.from_checkpoint(ros_demo["checkpoint"], camera_names=cams)
    repo = ReferenceRepository.open(ros_demo["repo"])
    manager = CacheManager(policy.engine.model, repo, manager_config(CacheSpec(**profile["cache"]), repo))
    engine = CachedEngine(policy.engine.model, CacheConfig(rho_p=0.4, rho_n=repo.meta.rho_n,
                                                           groups=tuple(tuple(g) for g in repo.meta.mask_groups)))
    manager.start_episode(task)
    for s in states:
        manager.observe_state(torch.as_tensor(s))
    inputs = policy.prepare(Observation(images=images, state=states[-1], task=task))
    noise = policy.engine.make_noise(1, torch.Generator().manual_seed(call_id))
    result = engine.infer(inputs, noise=noise, select=manager.select)
    assert result.reference is not None
    assert tuple(report["references"][str(call_id)]) == tuple(result.reference.key), report
    expected = policy.action_norm.unnormalize(result.actions[0]).numpy()
    # Published within the joint limits (random weights do leave them: the gripper goes past 1.0).
    expected = np.clip(expected, profile["joint_lower"], profile["joint_upper"])
    assert got["shape"] == list(expected.shape)
    np.testing.assert_allclose(np.asarray(got["actions"]).reshape(expected.shape), expected, rtol=1e-4, atol=1e-4,
                               err_msg=f"call {call_id}: {report}")
