"""ros2 launch vla_runtime aloha.launch.py [checkpoint:=DIR] [device:=auto|cpu|cuda[:N]] [dtype:=...] [cache:=on|off]
[namespace:=NS] [use_sim_time:=true] [log_level:=LEVEL] [autostart:=true|false] [profile:=YAML]

The three nodes of the pipeline (vision, policy and cache manager) with the aloha robot profile
(config/aloha.yaml). Everything robot-specific lives in the profile; the arguments and what each
node receives are declared once in vla_runtime/nodes/launching.py. A node that cannot start
prints one line saying why, and the launch stops the others and exits non-zero. The nodes are
managed (lifecycle) nodes, active by default (autostart:=false leaves them unconfigured for a
lifecycle manager); the vision node and the cache manager respawn when they die, the policy
node's loss is reported by its peers on /diagnostics.
"""

from vla_runtime.nodes.launching import describe

PROFILE = "aloha.yaml"


def generate_launch_description():
    return describe(PROFILE)
