"""The node processes as a ROS 2 integrator meets them (startup_peers.py, one private network
namespace): a node that cannot start exits non-zero with one line saying why; an instruction
latched before the nodes start is received; an implausible joint state is warned about naming
the joint; an instruction with a control character is refused; Ctrl-C ends every node cleanly
(status 0, no traceback, no shared memory left)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from vla_runtime.nodes.spin import START_FAILED
from vla_runtime.testing.scenarios import node_logs, run_scenario

INSTALL = Path(__file__).resolve().parents[2] / "install"
PEERS = Path(__file__).with_name("startup_peers.py")


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_startup")
    profile = copy.deepcopy(ros_demo["profile"])
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    good = str(tmp / "profile.yaml")
    failures = {"missing_checkpoint": ["policy_node", ["-p", f"profile:={good}", "-p", f"checkpoint:={tmp}/nothing"]],
                "no_profile": ["cache_manager_node", []],
                "bad_parameter": ["vision_node", ["-p", f"profile:={good}", "-p", "ring_slots:=1"]]}
    if not torch.cuda.is_available():
        failures["cuda_without_gpu"] = ["vision_node", ["-p", f"profile:={good}", "-p", "device:=cuda"]]
    spec = {"profile": good, "logs": str(tmp / "logs"), "images": ros_demo["images"], "state": ros_demo["state"],
            "task": ros_demo["task"], "joint_names": profile["joint_names"], "rings": f"u{os.getpid()}",
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "failures": failures, "timeout": 20.0}
    rep = run_scenario(PEERS, spec, INSTALL, timeout=420, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))
    rep["logs"] = node_logs(spec, tail=20000)
    return rep


@pytest.mark.parametrize("case, node, why", [
    ("missing_checkpoint", "vla_policy", "nothing"),
    ("no_profile", "vla_cache_manager", "no profile: set the 'profile' parameter"),
    ("bad_parameter", "vla_vision", "invalid parameter(s): ring_slots: must be in [2, 64], got 1"),
    ("cuda_without_gpu", "vla_vision", "engine.device is 'cuda' but no CUDA device is available"),
])
def test_a_node_that_cannot_start_exits_non_zero_with_one_line(report, case, node, why):
    if case not in report["start_failures"]:
        pytest.skip("this machine has a GPU: device:=cuda starts")
    got = report["start_failures"][case]
    assert got["returncode"] == START_FAILED, got
    (line,) = got["stderr"]          # one line, no traceback
    assert line.startswith(f"{node}: cannot start: ") and why in line, line


def test_an_instruction_latched_before_the_nodes_started_is_received(report):
    assert report["served_on_latched_instruction"], report["logs"]
    assert report["task"] != "", report


def test_an_implausible_joint_state_is_warned_naming_the_joint(report):
    assert report["implausible"].startswith("joint state implausible"), report
    assert "joint_0 = 100 (limits [-3.1416, 3.1416])" in report["implausible"], report


def test_an_instruction_with_a_control_character_is_refused_and_the_task_goes_on(report):
    assert "instruction with control characters refused" in report["control_character"], report
    assert report["served_after"] and report["task_after"] == report["task"], report


def test_ctrl_c_ends_every_node_cleanly(report):
    assert all(report["alive_before_sigint"].values()), report
    assert report["exit_codes"] == {"cache_manager_node": 0, "vision_node": 0, "policy_node": 0}, report["logs"]
    assert report["rings_left"] == [], report
    for bad in ("Traceback", "_exception", "context is invalid", "Error", "incompatible QoS"):
        assert bad not in report["logs"], report["logs"]
