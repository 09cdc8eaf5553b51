"""`vla-runtime eval` plumbing on Meta-World: a couple of short closed-loop episodes, dense and
cached on the same seeds, with a repository built from an expert demonstration. Random weights:
this checks that the harness, the recording and the evaluation bookkeeping agree with each
other, not that the policy succeeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.cache.builder import BuildConfig, build_repository
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.io.bags import write_episode_bag
from vla_runtime.models.config import preset
from vla_runtime.sim.metaworld_env import DEFAULT_CAMERAS, TASK_INSTRUCTIONS, MetaWorldConfig, MetaWorldTask
from vla_runtime.tools.demo import write_random_checkpoint
from vla_runtime.tools.eval import CALL_PERIOD_S, EvalSpec, evaluate, table as eval_table
from vla_runtime.tools.metaworld_demos import ACTION_TOPIC, bag_topics, record_episode

TASK = "button-press-topdown-v3"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval")
    env = MetaWorldTask(MetaWorldConfig(TASK, image_size=32, max_steps=150))
    try:
        roll = record_episode(env, seed=3, call_every=4, tail_steps=0)
    finally:
        env.close()
    states = np.stack([f.state for f in roll.episode.frames])
    ckpt = root / "checkpoint"
    write_random_checkpoint(ckpt, preset("pi05-tiny"), list(TASK_INSTRUCTIONS.values()), states, roll.actions.values,
                            DEFAULT_CAMERAS)
    bag = root / "demo"
    write_episode_bag(bag, roll.episode, bag_topics(DEFAULT_CAMERAS), series={ACTION_TOPIC: roll.actions})
    policy = Pi05Policy.from_checkpoint(ckpt, camera_names=list(DEFAULT_CAMERAS))
    call_period = roll.episode.frames[1].t - roll.episode.frames[0].t
    build_repository(policy, policy.checkpoint_hash, [bag], root / "repo", bag_topics(DEFAULT_CAMERAS),
                     call_period, BuildConfig(rho_n=0.5), log=lambda m: None)
    return {"root": root, "checkpoint": ckpt, "repo": root / "repo"}


def test_eval_reports_consistent_numbers(setup):
    spec = EvalSpec(checkpoint=setup["checkpoint"], out=setup["root"] / "out", tasks=(TASK,), episodes=2,
                    n_execute=4, max_steps=10, image_size=32, repository=setup["repo"])
    lines: list[str] = []
    report = evaluate(spec, log=lines.append)
    # the modes take turns episode by episode, so their times are measured side by side
    episode_lines = [line.split()[:3] for line in lines if line.split()[1:2] == [TASK]]
    assert episode_lines == [["dense", TASK, "1/2:"], ["cached", TASK, "1/2:"],
                             ["dense", TASK, "2/2:"], ["cached", TASK, "2/2:"]]
    on_disk = json.loads((spec.out / "eval.json").read_text())
    assert on_disk["comparison"] == json.loads(json.dumps(report["comparison"], default=float))
    for mode in ("dense", "cached"):
        episodes = report["episodes"][mode]
        overall = report["modes"][mode]["overall"]
        assert [e["seed"] for e in episodes] == [spec.eval_seed, spec.eval_seed + 1]     # same seeds in both modes
        assert overall["episodes"] == 2 and overall["calls"] == sum(e["calls"] for e in episodes)
        assert overall["successes"] == sum(e["success"] for e in episodes)
        for e in episodes:
            assert e["steps"] <= spec.max_steps and e["calls"] == math.ceil(e["steps"] / spec.n_execute)
            assert len(e["call_s"]) == e["calls"] and 0 <= e["cached_calls"] <= e["calls"]
    cached = report["modes"]["cached"]["overall"]
    assert cached["fallback_rate"] == pytest.approx(1 - cached["cached_calls"] / cached["calls"])
    assert report["modes"]["dense"]["overall"]["cached_calls"] == 0
    assert report["modes"]["dense"]["overall"]["fallback_rate"] is None
    assert report["modes"]["cached"]["overall"]["cached_calls"] >= 1       # the demo's pose is near enough
    assert "retrieve" in report["modes"]["cached"]["overall"]["mean_phase_s"]
    table = (spec.out / "eval.md").read_text()
    assert TASK in table and "cached vs dense" in table and "| fallback |" in table
    # a task none of whose reference episodes succeeded is named: its cached episodes ran dense
    assert "no reference episode succeeded" not in table
    unreferenced = eval_table({**report, "repository": {"reference_successes": {TASK: 0}}})
    assert f"no reference episode succeeded for {TASK}: the repository has nothing for it" in unreferenced
    assert (spec.out / "eval.png").stat().st_size > 1000


def test_eval_refuses_overlapping_seeds(setup, tmp_path):
    with pytest.raises(ValueError, match="overlap"):
        EvalSpec(checkpoint=setup["checkpoint"], out=tmp_path, eval_seed=10, episodes=5, reference_seed=12)
