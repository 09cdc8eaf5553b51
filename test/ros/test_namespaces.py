"""Two namespaced pipelines side by side on one machine, both on simulated time (namespace_peers.py,
one private network namespace): each robot is served on its own topics with its own task and its
own shared-memory rings, nothing reaches the other or the root namespace, and every timestamp
(input freshness, trajectory stamps) is on the /clock the test publishes, 1000 s after zero while
the wall clock reads decades: a node reading the wall clock would refuse every input as stale."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from vla_runtime.testing.scenarios import node_logs, run_scenario

INSTALL = Path(__file__).resolve().parents[2] / "install"
PEERS = Path(__file__).with_name("namespace_peers.py")
NAMESPACES = ("r1", "r2")
CLOCK_START_S = 1000.0


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_namespaces")
    profile = copy.deepcopy(ros_demo["profile"])
    # relative topics: each pipeline's under its namespace
    profile["cameras"] = {c: {"topic": v["topic"].lstrip("/")} for c, v in profile["cameras"].items()}
    profile["joint_states_topics"] = ["joint_states"]
    profile["instruction_topic"] = "instruction"
    profile["output"]["topics"] = ["joint_trajectory_controller/joint_trajectory"]
    profile["streaming"]["watchdog_s"] = 30.0   # six node processes share the cores: calls are slow here
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    spec = {"profile": str(tmp / "profile.yaml"), "logs": str(tmp / "logs"), "images": ros_demo["images"],
            "state": ros_demo["state"], "joint_names": profile["joint_names"],
            "tasks": {"r1": ros_demo["task"], "r2": "wipe the table"},
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "clock_start": CLOCK_START_S,
            "timeout": 30.0}
    rep = run_scenario(PEERS, spec, INSTALL, timeout=540, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))
    rep["logs"] = node_logs(spec, tail=4000)
    return rep


def test_each_namespace_is_served_with_its_own_task_and_nothing_crosses(report):
    assert report["served"], report["logs"]
    assert report["tasks"] == {"r1": report["tasks"]["r1"], "r2": "wipe the table"} and report["tasks"]["r1"], report
    assert all(int(report["vision_calls"][ns]) >= 1 for ns in NAMESPACES), report
    assert all(report["chunks"][ns] >= 1 for ns in NAMESPACES), report
    assert report["root_trajectories"] == 0, report
    assert {f"/{ns}/vla_runtime: {n}" for ns in NAMESPACES for n in ("policy", "vision", "cache manager")} \
        <= set(report["diagnostic_names"]), report["diagnostic_names"]


def test_each_namespace_has_its_own_rings(report):
    assert {"vla_prefix_r1", "vla_prefix_r2", "vla_refs_r1", "vla_refs_r2"} <= set(report["rings"]), report
    assert "vla_prefix" not in report["rings"] and "vla_refs" not in report["rings"], report


def test_every_timestamp_is_on_the_simulated_clock(report):
    """Inputs stamped in simulated time are accepted (none refused), and each trajectory starts
    at the simulated time it arrived at or after it (within the chunk it plans, seconds)."""
    assert all(report["refused_joint_states"][ns] == "0" for ns in NAMESPACES), report
    for ns in NAMESPACES:
        for stamp, arrived in report["stamps"][ns]:
            assert arrived - 1.0 <= stamp <= arrived + 5.0, (ns, stamp, arrived)


def test_both_pipelines_stop_cleanly(report):
    assert all(report["alive"].values()), report["alive"]
    assert set(report["exit_codes"].values()) == {0}, (report["exit_codes"], report["logs"])
