"""ros2 launch vla_runtime aloha.launch.py [checkpoint:=DIR] [profile:=YAML]

The vision and policy nodes with the aloha robot profile (config/aloha.yaml); everything
robot-specific lives in the profile (see vla_runtime/nodes/launching.py).
"""

from vla_runtime.nodes.launching import describe

PROFILE = "aloha.yaml"


def generate_launch_description():
    return describe(PROFILE)
