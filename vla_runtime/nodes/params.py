"""Node parameters: declared with a description each (``ros2 param describe`` shows it), read once."""

from __future__ import annotations

from typing import Any

from .profile import RobotProfile, load_profile
from .stages import RingNames


def declare_parameters(node: Any, table: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """Declare every ``name: (default, description)`` of ``table`` on ``node`` and return the values."""
    from rcl_interfaces.msg import ParameterDescriptor

    for name, (default, text) in table.items():
        node.declare_parameter(name, default, ParameterDescriptor(description=text))
    return {name: node.get_parameter(name).value for name in table}


def ring_names(values: dict[str, Any]) -> RingNames:
    """The shared-memory names from a node's parameters (defaults where a node has no such parameter)."""
    d = RingNames()
    names = RingNames(values.get("ring", d.prefix), values.get("query_ring", d.query),
                      values.get("working_set", d.working_set))
    for n in (names.prefix, names.query, names.working_set):
        if not n or "/" in n or len(n) > 200:
            raise ValueError(f"ring names must be non-empty, without '/', at most 200 characters; got {n!r}")
    return names


def profile_and_checkpoint(values: dict[str, Any]) -> tuple[RobotProfile, str]:
    """The node's robot profile and checkpoint (the parameter overrides the profile's)."""
    profile = load_profile(values["profile"])
    ckpt = values.get("checkpoint") or profile.engine.checkpoint
    if not ckpt:
        raise ValueError("no checkpoint: set the 'checkpoint' parameter or engine.checkpoint in the profile")
    return profile, ckpt
