"""What every launch file starts: the vision, policy and cache manager nodes with one robot profile.

The launch files in launch/ only name their profile and call ``describe``, so the robots
cannot drift apart. Each launch argument is declared once here (``ARGUMENTS``) and reaches every
node the same way: as a node parameter of the same name, or as the node's namespace or log level.
CI checks the executables and parameter names statically and runs ``describe`` against recording
stand-ins of the launch classes (launch_ros is not on PyPI, so CI cannot run ``ros2 launch``).

A node that cannot start prints one line saying why and exits with ``spin.START_FAILED``; the
launch then stops every node and exits non-zero (``exit_decision``). Upstream ``ros2 launch``
returns 1 only when an exception reaches its event loop, so a failed node is reported by raising
``LaunchFailure`` from its exit handler (launch logs "Caught exception in launch ...: <reason>").
"""

from __future__ import annotations

from dataclasses import dataclass

from .spin import START_FAILED

NODES = (("vision_node", "vla_vision"), ("policy_node", "vla_policy"), ("cache_manager_node", "vla_cache_manager"))


@dataclass(frozen=True)
class Argument:
    name: str
    default: str          # a launch argument is text; "{profile}" stands for the launch file's profile
    description: str
    reaches: str = "parameter"   # "parameter" (string), "bool_parameter", "namespace" or "log_level"


ARGUMENTS = (
    Argument("profile", "{profile}", "robot profile YAML (default: the launch file's, in the package's config/)"),
    Argument("checkpoint", "", "pi0.5 checkpoint directory (overrides the profile's engine.checkpoint)"),
    Argument("device", "auto", "auto (CUDA when present, else CPU with a warning of the latency to expect), cpu, "
                               "cuda or cuda:N; overrides engine.device ('' keeps the profile's)"),
    Argument("dtype", "", "float32, bfloat16 or float16 (overrides engine.dtype; '' keeps the profile's)"),
    Argument("cache", "", "on or off (overrides cache.enabled; '' keeps the profile's; on needs cache.repository)"),
    Argument("use_sim_time", "false", "true: every node takes its time from /clock (simulation, bag replay --clock)",
             reaches="bool_parameter"),
    Argument("namespace", "", "ROS namespace of the three nodes (their topics are relative to it)", reaches="namespace"),
    Argument("log_level", "info", "log level of the three nodes (debug, info, warn, error, fatal)",
             reaches="log_level"),
)
# Parameters the launch files set on every node (use_sim_time is declared by rclpy itself).
PARAMETERS = tuple(a.name for a in ARGUMENTS if a.reaches == "parameter")


class LaunchFailure(RuntimeError):
    """A node exited with an error: raised into the launch's event loop so that it exits non-zero."""


def exit_decision(name: str, returncode: int | None, shutting_down: bool) -> tuple[str, str]:
    """What the launch does when node ``name`` exits: ("", "") while the launch is already
    shutting down (Ctrl-C), ("shutdown", reason) after a clean exit (half a pipeline must not run
    on), ("fail", reason) after an error (shut down and exit non-zero)."""
    if shutting_down:
        return "", ""
    if returncode == 0:
        return "shutdown", f"{name} exited"
    why = "it could not start (its one-line reason is above)" if returncode == START_FAILED else \
        f"exit status {returncode}"
    return "fail", f"{name} stopped: {why}"


def describe(profile_file: str):
    """The LaunchDescription for ``config/<profile_file>`` (imports launch only when called)."""
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, Shutdown
    from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
    from launch_ros.actions import Node
    from launch_ros.parameter_descriptions import ParameterValue
    from launch_ros.substitutions import FindPackageShare

    default_profile = PathJoinSubstitution([FindPackageShare("vla_runtime"), "config", profile_file])
    declared = [DeclareLaunchArgument(a.name, default_value=default_profile if a.default == "{profile}" else a.default,
                                      description=a.description) for a in ARGUMENTS]
    # value_type: a launch argument is text, and launch_ros would read "on"/"off" as YAML booleans
    params = {a.name: ParameterValue(LaunchConfiguration(a.name), value_type=str)
              for a in ARGUMENTS if a.reaches == "parameter"}
    params |= {a.name: ParameterValue(LaunchConfiguration(a.name), value_type=bool)
               for a in ARGUMENTS if a.reaches == "bool_parameter"}

    def on_exit(name: str):
        def handle(event, context):
            action, reason = exit_decision(name, event.returncode, context.is_shutdown)
            if action == "fail":
                raise LaunchFailure(reason)
            return [Shutdown(reason=reason)] if action else None
        return handle

    return LaunchDescription([
        *declared,
        *(Node(package="vla_runtime", executable=exe, name=name, namespace=LaunchConfiguration("namespace"),
               parameters=[params], ros_arguments=["--log-level", LaunchConfiguration("log_level")],
               output="screen", on_exit=on_exit(name))
          for exe, name in NODES),
    ])
