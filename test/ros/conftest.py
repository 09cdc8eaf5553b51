"""What the ROS scenarios share: one demo checkpoint, its reference repository and a camera frame,
built once per test session (the scenarios then write their own profiles around them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vla_runtime.testing.scenarios import demo_robot

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install"


@pytest.fixture(scope="session")
def ros_demo(tmp_path_factory) -> dict:
    """A pi05-tiny demo checkpoint, a repository built from its reference episodes, the sim
    profile pointed at both (cache on), and the first frame of a held-out episode. Scenarios
    change a deep copy of the profile, never the dict itself."""
    if not (INSTALL / "setup.bash").is_file():
        pytest.fail(f"{INSTALL}/setup.bash missing: build the ROS 2 side first with `make ros`")
    return demo_robot(tmp_path_factory.mktemp("ros_demo"), ROOT / "config" / "sim.yaml")
