"""What every launch file starts: the vision, policy and cache manager nodes with one robot profile.

The launch files in launch/ only name their profile and call ``describe``, so the robots
cannot drift apart; CI checks the executables and parameter names used here statically
(launch_ros is not on PyPI, so CI cannot run ``ros2 launch``).
"""

from __future__ import annotations

NODES = (("vision_node", "vla_vision"), ("policy_node", "vla_policy"), ("cache_manager_node", "vla_cache_manager"))
PARAMETERS = ("profile", "checkpoint")


def describe(profile_file: str):
    """The LaunchDescription for ``config/<profile_file>`` (imports launch only when called)."""
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, Shutdown
    from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
    from launch_ros.actions import Node
    from launch_ros.substitutions import FindPackageShare

    default_profile = PathJoinSubstitution([FindPackageShare("vla_runtime"), "config", profile_file])
    params = {name: LaunchConfiguration(name) for name in PARAMETERS}
    return LaunchDescription([
        DeclareLaunchArgument("profile", default_value=default_profile, description="robot profile YAML"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="pi0.5 checkpoint directory (overrides the profile's engine.checkpoint)"),
        # One node dying (bad profile, wrong checkpoint) takes the launch down with a reason, instead
        # of leaving half a pipeline running.
        *(Node(package="vla_runtime", executable=exe, name=name, parameters=[params], output="screen",
               on_exit=Shutdown(reason=f"{name} exited"))
          for exe, name in NODES),
    ])
