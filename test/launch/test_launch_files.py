"""Static checks of the launch files (launch_ros is not on PyPI, so CI cannot run `ros2 launch`):
every executable they start is installed by CMakeLists.txt and exists in scripts/, every
parameter they pass is declared by that node, and every profile they name loads. Then each
launch file's ``generate_launch_description`` runs against recording stand-ins of the launch
classes: every launch argument is declared and reaches every node (as a parameter of its name,
the namespace or the log level), the vision node and the cache manager respawn after the
declared delay while the policy node does not, and what each node's exit does to the launch."""

from __future__ import annotations

import ast
import re
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from vla_runtime.nodes.launching import (ARGUMENTS, BOOL_PARAMETERS, NODES, PARAMETERS, RESPAWN_DELAY_S, RESPAWNS,
                                         LaunchFailure)
from vla_runtime.nodes.spin import START_FAILED
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
    # a managed node declares its table in ManagedNode.__init__ (params.declare_parameters)
    assert re.search(r"super\(\).__init__\(\"vla_\w+\", PARAMETERS\)", source.read_text()), \
        f"{source.name} must declare its table"
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
    # use_sim_time is declared by rclpy itself, the other booleans by each node's table
    return [exe for exe, _ in NODES], set(PARAMETERS) | set(BOOL_PARAMETERS) - {"use_sim_time"}, profile


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


class Recorded:
    """Stand-in for a launch class: keeps its constructor arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _stand_ins(monkeypatch) -> dict[str, type]:
    """Modules launch / launch_ros with recording classes of the names launching.describe uses."""
    names = {"launch": ["LaunchDescription"], "launch.actions": ["DeclareLaunchArgument", "LogInfo", "Shutdown"],
             "launch.substitutions": ["LaunchConfiguration", "PathJoinSubstitution"],
             "launch_ros.actions": ["Node"], "launch_ros.parameter_descriptions": ["ParameterValue"],
             "launch_ros.substitutions": ["FindPackageShare"]}
    classes = {}
    for module, members in names.items():
        mod = types.ModuleType(module)
        for m in members:
            classes[m] = type(m, (Recorded,), {})
            setattr(mod, m, classes[m])
        monkeypatch.setitem(sys.modules, module, mod)
    for pkg in ("launch", "launch_ros"):
        if pkg not in names:
            monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
        sys.modules[pkg].__path__ = []   # a package, so that its submodules import
    return classes


def _described(path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generate_launch_description()


def _config_name(sub) -> str:
    assert type(sub).__name__ == "LaunchConfiguration", sub
    return sub.args[0]


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.name)
def test_every_launch_argument_is_declared_and_reaches_every_node(path: Path, monkeypatch):
    cls = _stand_ins(monkeypatch)
    entities = _described(path, monkeypatch).args[0]
    declared = {e.args[0]: e.kwargs for e in entities if isinstance(e, cls["DeclareLaunchArgument"])}
    assert set(declared) == {a.name for a in ARGUMENTS} >= {"profile", "checkpoint", "device", "dtype", "cache",
                                                            "namespace", "use_sim_time", "log_level", "autostart"}
    assert declared["device"]["default_value"] == "auto" and declared["use_sim_time"]["default_value"] == "false"
    assert declared["autostart"]["default_value"] == "true"   # active by default
    profile = declared["profile"]["default_value"]
    assert profile.args[0][1:] == ["config", path.name.removesuffix(".launch.py") + ".yaml"]
    nodes = [e for e in entities if isinstance(e, cls["Node"])]
    assert sorted((n.kwargs["executable"], n.kwargs["name"]) for n in nodes) == sorted(NODES)
    for n in nodes:
        k = n.kwargs
        assert _config_name(k["namespace"]) == "namespace"
        assert k["ros_arguments"][0] == "--log-level" and _config_name(k["ros_arguments"][1]) == "log_level"
        (params,) = k["parameters"]
        # every parameter argument reaches the node under its own name, typed (launch_ros would read
        # "on"/"off" as YAML booleans without value_type)
        typed = {name: (_config_name(v.args[0]), v.kwargs["value_type"]) for name, v in params.items()}
        assert typed == {**{p: (p, str) for p in PARAMETERS}, "use_sim_time": ("use_sim_time", bool),
                         "autostart": ("autostart", bool)}


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.name)
def test_vision_and_cache_manager_respawn_the_policy_does_not(path: Path, monkeypatch):
    cls = _stand_ins(monkeypatch)
    nodes = {e.kwargs["name"]: e.kwargs for e in _described(path, monkeypatch).args[0] if isinstance(e, cls["Node"])}
    assert RESPAWN_DELAY_S > 0   # launch waits the delay before respawning: a START_FAILED exit cancels it then
    for name in ("vla_vision", "vla_cache_manager"):
        assert nodes[name]["respawn"] is True and nodes[name]["respawn_delay"] == RESPAWN_DELAY_S, nodes[name]
    assert "respawn" not in nodes["vla_policy"] and not RESPAWNS["vla_policy"]


class _Exit:
    def __init__(self, returncode: int):
        self.returncode = returncode


class _Context:
    def __init__(self, shutting_down: bool):
        self.is_shutdown = shutting_down


@pytest.mark.parametrize("path", LAUNCH[:1], ids=lambda p: p.name)
def test_what_each_node_exit_does_to_the_launch(path: Path, monkeypatch):
    cls = _stand_ins(monkeypatch)
    nodes = [e for e in _described(path, monkeypatch).args[0] if isinstance(e, cls["Node"])]
    for n in nodes:
        on_exit, name = n.kwargs["on_exit"], n.kwargs["name"]
        with pytest.raises(LaunchFailure, match=f"{name} stopped: it could not start"):
            on_exit(_Exit(START_FAILED), _Context(False))   # a respawn would fail the same way: stop
        (shutdown,) = on_exit(_Exit(0), _Context(False))     # stopped on purpose: the launch stops
        assert isinstance(shutdown, cls["Shutdown"]) and shutdown.kwargs["reason"] == f"{name} exited"
        assert on_exit(_Exit(-2), _Context(True)) is None    # Ctrl-C: the launch is stopping them anyway
        (log,) = on_exit(_Exit(-9), _Context(False))         # killed: never the whole launch
        assert isinstance(log, cls["LogInfo"]) and log.kwargs["msg"].startswith(f"{name} died (exit status -9)")
        expected = f"respawning in {RESPAWN_DELAY_S:g} s" if name != "vla_policy" else "not restarted"
        assert expected in log.kwargs["msg"], log.kwargs["msg"]
