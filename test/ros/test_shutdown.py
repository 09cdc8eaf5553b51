"""A stopped cache manager holds up no call, and Ctrl-C ends the vision node cleanly: with the
cache manager stopped (SIGSTOP) the vision node still serves the next call from the published
window (it once waited for an answer that could not come), then it is interrupted and must exit
with code 0, leaving no shared memory behind."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml

from vla_runtime.testing.scenarios import node_logs, run_scenario

INSTALL = Path(__file__).resolve().parents[2] / "install"
PEERS = Path(__file__).with_name("shutdown_peers.py")


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_shutdown")
    profile = copy.deepcopy(ros_demo["profile"])
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    spec = {"profile": str(tmp / "profile.yaml"), "logs": str(tmp / "logs"), "images": ros_demo["images"],
            "state": ros_demo["state"], "task": ros_demo["task"], "rings": f"s{os.getpid()}",
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "timeout": 30.0}
    rep = run_scenario(PEERS, spec, INSTALL, timeout=300, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))   # the exit time, for a reader
    rep["logs"] = node_logs(spec)
    return rep


def test_a_call_is_served_while_the_cache_manager_is_stopped_and_the_vision_node_exits_cleanly(report):
    assert report["first_served"] and report["quiet"], report["logs"]
    assert report["second_served_while_cache_manager_stopped"], report
    assert report["vision_exit_code"] == 0, report["logs"]   # not the driver's SIGKILL
    assert report["rings_left"] == [], report
    assert report["cache_manager_exit_code"] == 0, report["logs"]
