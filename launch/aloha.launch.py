"""ros2 launch vla_runtime aloha.launch.py [checkpoint:=DIR] [profile:=YAML]

Starts the vision and policy nodes with the aloha robot profile (config/aloha.yaml). Thin on
purpose: everything robot-specific is in the profile, and CI checks that every executable and
parameter named here exists and is declared by the node.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PROFILE = "aloha.yaml"


def generate_launch_description() -> LaunchDescription:
    default_profile = PathJoinSubstitution([FindPackageShare("vla_runtime"), "config", PROFILE])
    params = {"profile": LaunchConfiguration("profile"), "checkpoint": LaunchConfiguration("checkpoint")}
    return LaunchDescription([
        DeclareLaunchArgument("profile", default_value=default_profile, description="robot profile YAML"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="pi0.5 checkpoint directory (overrides the profile's engine.checkpoint)"),
        Node(package="vla_runtime", executable="vision_node", name="vla_vision", parameters=[params], output="screen"),
        Node(package="vla_runtime", executable="policy_node", name="vla_policy", parameters=[params], output="screen"),
    ])
