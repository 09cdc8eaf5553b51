"""ros2 launch vla_runtime franka.launch.py [checkpoint:=DIR] [profile:=YAML]

The vision and policy nodes with the franka robot profile (config/franka.yaml); everything
robot-specific lives in the profile (see vla_runtime/nodes/launching.py).
"""

from vla_runtime.nodes.launching import describe

PROFILE = "franka.yaml"


def generate_launch_description():
    return describe(PROFILE)
