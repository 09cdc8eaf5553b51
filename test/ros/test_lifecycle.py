"""The three nodes as managed (lifecycle) nodes, driven through their standard lifecycle
services by a test (lifecycle_peers.py, one private network namespace), as an external lifecycle
manager would with ``autostart:=false``: nothing is loaded or commanded before configure and
activate; a deactivated policy holds the robot (one one-point trajectory) and then publishes
nothing until activated again; a deactivated vision node prefills nothing (the policy holds);
cleanup releases the shared-memory rings; shutdown ends each process with status 0 from any
state. Throughout, nothing published is NaN or beyond a joint limit."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from vla_runtime.testing.scenarios import node_logs, robot_spec, run_scenario

INSTALL = Path(__file__).resolve().parents[2] / "install"
PEERS = Path(__file__).with_name("lifecycle_peers.py")
ALL = {"cache_manager_node", "vision_node", "policy_node"}


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_lifecycle")
    profile = copy.deepcopy(ros_demo["profile"])
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    sfx = f"l{os.getpid()}"
    spec = robot_spec(ros_demo, tmp / "profile.yaml", tmp / "logs", sfx, timeout=20.0)
    rep = run_scenario(PEERS, spec, INSTALL, timeout=480, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))
    rep["logs"] = node_logs(spec, tail=6000)
    rep["ring_names"] = sorted([f"prefix_{sfx}", f"refs_{sfx}"])
    return rep


def test_unconfigured_nodes_hold_nothing_and_command_nothing(report):
    p = report["unconfigured"]
    assert p["states"] == dict.fromkeys(ALL, "unconfigured"), p
    assert p["rings"] == [] and p["trajectories"] == p["chunks"] == p["requests"] == 0, p


def test_configure_creates_the_rings_without_commanding(report):
    p = report["configure"]
    assert p["ok"] == dict.fromkeys(ALL, True) and p["states"] == dict.fromkeys(ALL, "inactive"), report["logs"]
    assert p["rings"] == report["ring_names"], p
    assert p["trajectories"] == p["chunks"] == p["requests"] == 0, p


def test_activate_serves_the_robot(report):
    p = report["activate"]
    assert p["ok"] == dict.fromkeys(ALL, True) and p["states"] == dict.fromkeys(ALL, "active"), p
    assert p["served"], report["logs"]


def test_a_deactivated_policy_holds_the_robot_then_stops_commanding(report):
    p = report["policy_deactivate"]
    assert p["ok"] and p["state"] == "inactive" and p["lifecycle"] == "inactive", p
    assert p["after"] and p["after"][-1] == 1, p          # its last message: a one-point hold
    assert np.isfinite(p["hold"]).all(), p
    assert p["quiet"] == {"trajectories": 0, "chunks": 0, "requests": 0}, p


def test_a_reactivated_policy_commands_again(report):
    assert report["policy_reactivate"] == {"ok": True, "served": True}, report["logs"]


def test_a_deactivated_vision_node_prefills_nothing_and_the_policy_holds(report):
    p = report["vision_deactivate"]
    assert p["ok"] and p["held"] and p["chunks_while_inactive"] == 0, p
    assert p["ok_back"] and p["served_after"], (p, report["logs"])


def test_the_cache_manager_cycles_while_calls_go_on(report):
    p = report["cache_manager_cycle"]
    assert p == {"ok": [True, True], "state": "active", "served": True}, p


def test_cleanup_releases_the_rings(report):
    p = report["cleanup"]
    assert p["deactivate"] == dict.fromkeys(ALL, True) and p["cleanup"] == dict.fromkeys(ALL, True), p
    assert p["states"] == dict.fromkeys(ALL, "unconfigured") and p["rings"] == [], p
    assert p["trajectories"] == p["chunks"] == p["requests"] == 0, p


def test_shutdown_from_any_state_ends_the_process_cleanly(report):
    p = report["shutdown"]
    assert p["from"] == {"policy_node": "unconfigured", "vision_node": "inactive", "cache_manager_node": "active"}, p
    assert p["ok"] == dict.fromkeys(ALL, True), p
    assert p["exit_codes"] == dict.fromkeys(ALL, 0) and p["rings"] == [], (p, report["logs"])
    for bad in ("Traceback", "context is invalid"):
        assert bad not in report["logs"], report["logs"]


def test_nothing_published_is_nan_or_beyond_a_joint_limit(report):
    assert report["violations"] == [], report["violations"][:5]
