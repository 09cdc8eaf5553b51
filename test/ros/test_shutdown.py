"""Ctrl-C while a call is in flight: the vision node is interrupted while it waits for a
reference that will not come (the cache manager is stopped), with a reference wait far longer
than any shutdown may take. It must exit at once, with code 0, and leave no shared memory
behind; before, its worker thread sat out the whole wait and the ring was closed under it."""

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
REFERENCE_WAIT_S = 60.0


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_shutdown")
    profile = copy.deepcopy(ros_demo["profile"])
    profile["cache"]["reference_timeout_s"] = REFERENCE_WAIT_S
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    spec = {"profile": str(tmp / "profile.yaml"), "logs": str(tmp / "logs"), "images": ros_demo["images"],
            "state": ros_demo["state"], "task": ros_demo["task"], "rings": f"s{os.getpid()}",
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "timeout": 30.0}
    rep = run_scenario(PEERS, spec, INSTALL, timeout=300, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))   # the exit time, for a reader
    rep["logs"] = node_logs(spec)
    return rep


def test_vision_node_interrupted_while_waiting_for_a_reference_exits_cleanly(report):
    assert report["first_served"] and report["quiet"], report["logs"]
    assert not report["second_served_before_interrupt"], report   # it was waiting, as arranged
    # Exit code 0, not the driver's SIGKILL: the driver gives up after 30 s, half the reference
    # wait, so a wait sat out would end in -9 (the time taken is in the report, not judged here).
    assert report["vision_exit_code"] == 0, report["logs"]
    assert report["rings_left"] == [], report
    assert report["cache_manager_exit_code"] == 0, report["logs"]
