"""Bad inputs and faults against the real vision, policy and cache manager node processes (rclpy,
shared-memory rings), started once in a private network namespace; a test robot process feeds
the cases in sequence (fault_peers.py). Throughout, nothing the policy publishes is NaN or beyond
a joint limit, every case shows in the nodes' diagnostics, and the robot is served again after
each one: bad images, a frozen camera, bad joint states, stamps from the future and too old, an
empty and a changed instruction, run-time parameter changes (refused and accepted), a stalled
vision node (held; its late slot not executed), and the vision, cache manager and policy nodes
killed (SIGKILL) and restarted: the vision node and the cache manager after the launch's respawn
delay (``launching.RESPAWN_DELAY_S``, as its respawn does) while the policy keeps the robot safe;
the policy node, which the launch does not restart, reported by both peers as an ERROR naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from vla_runtime.testing.scenarios import node_logs, run_scenario

INSTALL = Path(__file__).resolve().parents[2] / "install"
PEERS = Path(__file__).with_name("fault_peers.py")


@pytest.fixture(scope="module")
def report(ros_demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ros_faults")
    profile = ros_demo["profile"]
    (tmp / "profile.yaml").write_text(yaml.safe_dump(profile))
    (tmp / "logs").mkdir()
    spec = {"profile": str(tmp / "profile.yaml"), "logs": str(tmp / "logs"), "images": ros_demo["images"],
            "state": ros_demo["state"], "task": ros_demo["task"], "other_task": "wipe the table",
            "joint_names": profile["joint_names"], "lower": profile["joint_lower"], "upper": profile["joint_upper"],
            "cameras": {c: v["topic"] for c, v in profile["cameras"].items()}, "rings": f"f{os.getpid()}",
            "timeout": 20.0}
    rep = run_scenario(PEERS, spec, INSTALL, timeout=420, cwd=tmp)
    (tmp / "report.json").write_text(json.dumps(rep, indent=1))   # what each phase saw, for a reader
    rep["logs"] = node_logs(spec)
    return rep


def _phase(report: dict, name: str) -> dict:
    return report["phases"][name]


def test_nothing_published_is_nan_or_beyond_a_joint_limit(report):
    assert report["violations"] == [], report["violations"][:5]
    assert report["trajectories"] > 0 and report["chunks"] > 0
    assert _phase(report, "warm_up")["ok"], report["logs"]


@pytest.mark.parametrize("bad", ["encoding", "size", "future", "old"])
def test_bad_image_is_refused_reported_and_the_robot_served_again(report, bad):
    p = _phase(report, f"image_{bad}")
    assert p["ok"] and p["served_after"], p
    assert p["refusal"].startswith("image refused: camera "), p


def test_frozen_camera_holds_the_robot_until_it_sends_new_frames(report):
    p = _phase(report, "camera_frozen")
    assert p["ok"] and p["served_after"], p
    assert "camera 'wrist' frozen" in p["stale_cameras"] and p["vision_level"] == 1, p   # WARN


@pytest.mark.parametrize("what", ["wrong_names", "wrong_length", "nan", "future_stamp", "old_stamp"])
def test_bad_joint_state_is_refused_and_reported(report, what):
    p = _phase(report, f"joint_state_{what}")
    assert p["ok"] and p["refusal"].startswith("joint state refused: "), p


def test_empty_instruction_is_ignored_and_the_task_continues(report):
    p = _phase(report, "instruction_empty")
    assert p["ok"] and p["task"] and "empty instruction ignored" in p["refusal"], p


def test_changed_instruction_starts_a_new_episode_in_the_cache_manager(report):
    p = _phase(report, "instruction_changed")
    assert p["ok"] and p["back"], (p, report["logs"])      # switch_s, back_s, sources_since: where it waited
    assert int(p["changes"]) >= 1 and "unknown task" in p["cache_reason"], p


def test_episode_start_is_prepared_by_the_cache_manager_ahead_of_the_first_query(report):
    p = _phase(report, "episode_start")
    assert p["ok"] and p["started"] == 1, (p, report["logs"])    # 2 would mean the first query started it again


def test_a_late_selection_of_a_task_switched_away_from_is_not_followed(report):
    p = _phase(report, "late_note_of_another_task")
    assert p["ok"] and p["served_after"] and p["started"] == 0, (p, report["logs"])
    assert p["task"] == p["instruction"], p


def test_parameters_are_validated_at_run_time(report):
    p = _phase(report, "parameters")
    assert p["out_of_range"][0] is False and "must be in (0, 600]" in p["out_of_range"][1], p
    assert p["fixed"][0] is False and p["seed_after"] == 0, p          # read-only: fixed at start-up
    assert p["vision_out_of_range"][0] is False and "frozen_after" in p["vision_out_of_range"][1], p
    assert p["accepted"] == [True, ""] and p["value_after"] == 2.5, p


def test_stalled_vision_node_holds_and_its_late_slot_is_not_executed(report):
    p = _phase(report, "vision_stalled")
    assert p["ok"] and p["served_after"] and p["abandoned"], p
    assert p["late_executed"] == [], p


def test_vision_node_killed_the_policy_holds_and_recovers_on_restart(report):
    p = _phase(report, "vision_killed")
    assert p["ok"] and p["held"] == ["True", "plan stale: holding"], p
    assert p["recovered"], report["logs"]


def test_cache_manager_killed_calls_go_on_at_once_then_cached_again_on_restart(report):
    p = _phase(report, "cache_manager_killed")
    assert p["served"] and p["recovered_cached"], (p, report["logs"])   # sources: from its last window, or dense


def test_policy_node_killed_the_others_survive_and_it_resumes(report):
    p = _phase(report, "policy_killed")
    assert p["others_alive"] == {"cache_manager_node": True, "vision_node": True} and p["recovered"], p
    assert report["exit_codes"] == {"cache_manager_node": 0, "vision_node": 0, "policy_node": 0}, report["logs"]


def test_policy_node_killed_its_peers_report_it_as_an_error_naming_it_until_it_is_back(report):
    """The launch does not restart the policy node: its loss must be visible. Its peers hear its
    1 Hz diagnostics; silent for peer_timeout_s (3 s), it is an ERROR on /diagnostics naming it."""
    p = _phase(report, "policy_killed")
    assert p["reported_ok"], p
    for peer in ("vision", "cache manager"):
        assert p["reported"][peer].startswith("policy node silent for "), p
    assert p["cleared"], (p, report["logs"])   # the restarted policy is heard again
