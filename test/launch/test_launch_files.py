"""Static checks of the launch files (launch_ros is not on PyPI, so CI cannot run `ros2 launch`):
every executable they start is installed by CMakeLists.txt and exists in scripts/, every
parameter they pass is declared by that node, and every profile they name loads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vla_runtime.nodes.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = sorted((ROOT / "launch").glob("*.launch.py"))
NODE_SOURCES = {"vision_node": ROOT / "vla_runtime/nodes/vision_node.py",
                "policy_node": ROOT / "vla_runtime/nodes/policy_node.py"}


def _declared_parameters(source: Path) -> set[str]:
    """Names passed to declare_parameter (directly or through the nodes' small `p(...)` helper)."""
    text = source.read_text()
    return set(re.findall(r'\bp\("([a-z_]+)"', text)) | set(re.findall(r'declare_parameter\("([a-z_]+)"', text))


def _nodes_and_params(path: Path) -> tuple[list[str], set[str], str]:
    tree = ast.parse(path.read_text())
    executables, params, profile = [], set(), ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Node":
            kw = {k.arg: k.value for k in node.keywords}
            executables.append(ast.literal_eval(kw["executable"]))
        if isinstance(node, ast.Dict):
            params |= {ast.literal_eval(k) for k in node.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PROFILE" for t in node.targets):
            profile = ast.literal_eval(node.value)
    return executables, params, profile


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.name)
def test_launch_file_refers_only_to_what_exists(path: Path):
    cmake = (ROOT / "CMakeLists.txt").read_text()
    executables, params, profile = _nodes_and_params(path)
    assert set(executables) == {"vision_node", "policy_node"}
    for exe in executables:
        assert (ROOT / "scripts" / exe).is_file(), exe
        assert f"scripts/{exe}" in cmake, f"{exe} is not installed by CMakeLists.txt"
        declared = _declared_parameters(NODE_SOURCES[exe])
        assert params <= declared, f"{path.name}: {exe} does not declare {sorted(params - declared)}"
    assert load_profile(ROOT / "config" / profile).name == profile.removesuffix(".yaml")


def test_every_robot_profile_has_a_launch_file():
    profiles = {p.stem for p in (ROOT / "config").glob("*.yaml")} - {"engine"}
    assert profiles == {p.name.removesuffix(".launch.py") for p in LAUNCH}
