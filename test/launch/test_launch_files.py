"""Static checks of the launch files (launch_ros is not on PyPI, so CI cannot run `ros2 launch`):
every executable they start is installed by CMakeLists.txt and exists in scripts/, every
parameter they pass is declared by that node, and every profile they name loads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vla_runtime.nodes.launching import NODES, PARAMETERS
from vla_runtime.nodes.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = sorted((ROOT / "launch").glob("*.launch.py"))
NODE_SOURCES = {"vision_node": ROOT / "vla_runtime/nodes/vision_node.py",
                "policy_node": ROOT / "vla_runtime/nodes/policy_node.py",
                "cache_manager_node": ROOT / "vla_runtime/nodes/cache_manager_node.py"}


def _declared_parameters(source: Path) -> set[str]:
    """The keys of the node module's ``PARAMETERS`` table (every one is declared with its
    description by ``params.declare_parameters``), read without importing rclpy: a dict literal,
    or one of the tables of ``vla_runtime.nodes.params`` by name."""
    from vla_runtime.nodes import params

    tree = ast.parse(source.read_text())
    tables = [n.value for n in tree.body if isinstance(n, ast.Assign)
              and any(getattr(t, "id", "") == "PARAMETERS" for t in n.targets)]
    assert len(tables) == 1, f"{source.name} needs one PARAMETERS table"
    assert "declare_parameters(self, PARAMETERS" in source.read_text(), f"{source.name} must declare its table"
    if isinstance(tables[0], ast.Name):
        return set(getattr(params, tables[0].id))
    assert isinstance(tables[0], ast.Dict), f"{source.name}: PARAMETERS must be a dict or a table of params.py"
    return {ast.literal_eval(k) for k in tables[0].keys}


def _nodes_and_params(path: Path) -> tuple[list[str], set[str], str]:
    """What a launch file starts: it must delegate to launching.describe with a profile name."""
    tree = ast.parse(path.read_text())
    profile = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                   if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "PROFILE" for t in n.targets))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "describe"]
    assert len(calls) == 1, f"{path.name} must return launching.describe(PROFILE)"
    return [exe for exe, _ in NODES], set(PARAMETERS), profile


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.name)
def test_launch_file_refers_only_to_what_exists(path: Path):
    cmake = (ROOT / "CMakeLists.txt").read_text()
    executables, params, profile = _nodes_and_params(path)
    assert set(executables) == set(NODE_SOURCES)
    for exe in executables:
        assert (ROOT / "scripts" / exe).is_file(), exe
        assert f"scripts/{exe}" in cmake, f"{exe} is not installed by CMakeLists.txt"
        declared = _declared_parameters(NODE_SOURCES[exe])
        assert params <= declared, f"{path.name}: {exe} does not declare {sorted(params - declared)}"
    assert load_profile(ROOT / "config" / profile).name == profile.removesuffix(".yaml")


def test_every_robot_profile_has_a_launch_file():
    profiles = {p.stem for p in (ROOT / "config").glob("*.yaml")}
    assert profiles == {p.name.removesuffix(".launch.py") for p in LAUNCH}
