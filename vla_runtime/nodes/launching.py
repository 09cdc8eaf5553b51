"""What every launch file starts: the vision, policy and cache manager nodes with one robot profile.

The launch files in launch/ only name their profile and call ``describe``, so the robots
cannot drift apart. Each launch argument is declared once here (``ARGUMENTS``) and reaches every
node the same way: as a node parameter of the same name, or as the node's namespace or log level.
CI checks the executables and parameter names statically and runs ``describe`` against recording
stand-ins of the launch classes (launch_ros is not on PyPI, so CI cannot run ``ros2 launch``).

The nodes are managed (lifecycle) nodes. With ``autostart:=true`` (the default) each configures
and activates itself; with ``autostart:=false`` each waits unconfigured for an external
lifecycle manager (nav2's lifecycle_manager, ``ros2 lifecycle set``) to configure and activate it.

Recovery per node (``exit_decision``): the vision node and the cache manager respawn after
``RESPAWN_DELAY_S`` when they die (launch_ros ``respawn``), while the others carry on (the policy
holds the robot or runs dense calls meanwhile). The policy node is not respawned: it is the one
that commands the robot, so its loss is left to be seen and decided on (its peers report it as an
ERROR on /diagnostics, the robot's controller holds as for any silent publisher) and the launch
keeps running. A node that cannot start prints one line saying why and exits with
``spin.START_FAILED``; the launch then stops every node and exits non-zero. Upstream ``ros2
launch`` returns 1 only when an exception reaches its event loop, so a failed node is reported by
raising ``LaunchFailure`` from its exit handler (launch logs "Caught exception in launch ...:
<reason>"); raised before the respawn delay ends, it also cancels the respawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spin import START_FAILED

NODES = (("vision_node", "vla_vision"), ("policy_node", "vla_policy"), ("cache_manager_node", "vla_cache_manager"))
RESPAWNS = {"vla_vision": True, "vla_policy": False, "vla_cache_manager": True}
# Long enough that a node dying at once again (a crash loop) does not spin the machine, and for
# a START_FAILED exit to stop the launch before the respawn (launch waits out the delay first);
# short next to the policy's watchdog hold and what a restart takes (loading the checkpoint).
RESPAWN_DELAY_S = 1.0


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
    Argument("autostart", "true", "true: every node configures and activates itself; false: they wait unconfigured "
                                  "for an external lifecycle manager (configure, then activate)",
             reaches="bool_parameter"),
)
# Parameters the launch files set on every node: text ones, and booleans (use_sim_time is
# declared by rclpy itself, the others by each node's parameter table).
PARAMETERS = tuple(a.name for a in ARGUMENTS if a.reaches == "parameter")
BOOL_PARAMETERS = tuple(a.name for a in ARGUMENTS if a.reaches == "bool_parameter")


class LaunchFailure(RuntimeError):
    """A node exited with an error: raised into the launch's event loop so that it exits non-zero."""


def exit_decision(name: str, returncode: int | None, shutting_down: bool) -> tuple[str, str]:
    """What the launch does when node ``name`` exits:

    - ("", "") while the launch is already shutting down (Ctrl-C);
    - ("shutdown", reason) after a clean exit (stopped on purpose: a lifecycle shutdown, or a
      signal to that node alone): the launch stops, rather than run on with half a pipeline;
    - ("fail", reason) when it could not start (``START_FAILED``): stop and exit non-zero (a
      respawn would fail the same way);
    - ("respawn", reason) when a respawning node (``RESPAWNS``) died: the launch restarts it after
      ``RESPAWN_DELAY_S``, the others carry on;
    - ("report", reason) when the policy node died: not restarted, the launch carries on so that
      its peers report it on /diagnostics; the reason says so in the launch's log."""
    if shutting_down:
        return "", ""
    if returncode == 0:
        return "shutdown", f"{name} exited"
    if returncode == START_FAILED:
        return "fail", f"{name} stopped: it could not start (its one-line reason is above)"
    if RESPAWNS[name]:
        return "respawn", f"{name} died (exit status {returncode}): respawning in {RESPAWN_DELAY_S:g} s"
    return "report", (f"{name} died (exit status {returncode}): not restarted (it commands the robot); the robot's "
                      "controller holds, its peers report it on /diagnostics; restart the launch or the node")


def describe(profile_file: str):
    """The LaunchDescription for ``config/<profile_file>`` (imports launch only when called)."""
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, LogInfo, Shutdown
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
    params |= {name: ParameterValue(LaunchConfiguration(name), value_type=bool) for name in BOOL_PARAMETERS}

    def on_exit(name: str):
        def handle(event, context):
            action, reason = exit_decision(name, event.returncode, context.is_shutdown)
            if action == "fail":
                raise LaunchFailure(reason)
            if action in ("respawn", "report"):
                return [LogInfo(msg=reason)]
            return [Shutdown(reason=reason)] if action else None
        return handle

    return LaunchDescription([
        *declared,
        *(Node(package="vla_runtime", executable=exe, name=name, namespace=LaunchConfiguration("namespace"),
               parameters=[params], ros_arguments=["--log-level", LaunchConfiguration("log_level")],
               output="screen", on_exit=on_exit(name),
               **({"respawn": True, "respawn_delay": RESPAWN_DELAY_S} if RESPAWNS[name] else {}))
          for exe, name in NODES),
    ])
