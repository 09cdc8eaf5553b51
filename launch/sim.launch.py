"""ros2 launch vla_runtime sim.launch.py [checkpoint:=DIR] [profile:=YAML]

The vision and policy nodes with the sim robot profile (config/sim.yaml); everything
robot-specific lives in the profile (see vla_runtime/nodes/launching.py).
"""

from vla_runtime.nodes.launching import describe

PROFILE = "sim.yaml"


def generate_launch_description():
    return describe(PROFILE)
