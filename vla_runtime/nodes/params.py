"""Node parameters: declared with a description each (``ros2 param describe`` shows it), checked
at start-up and on every run-time change.

Each node's table lives here (``VISION``, ``POLICY``, ``CACHE_MANAGER``) so the checks can be
tested without ROS. A parameter is either fixed at start-up (profile, checkpoint, ring names,
seed, ...: declared read-only, ``ros2 param set`` is refused) or ``dynamic``: a time-out or a
freshness bound the node reads on every use, which an operator may tune on a running robot.
Values out of range are refused at start-up (the node does not start, the message names the
parameter) and at run time (the set is refused with the reason; the old value stays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from .devices import device_problem
from .profile import RobotProfile, load_profile
from .stages import RingNames


@dataclass(frozen=True)
class Param:
    default: Any
    description: str
    check: Callable[[Any], str] | None = None   # the problem with a value, '' when there is none
    dynamic: bool = False                      # may change at run time

    def problem(self, value: Any) -> str:
        if type(value) is not type(self.default) and not (isinstance(self.default, float) and type(value) is int):
            return f"must be a {type(self.default).__name__}, got {value!r}"
        return self.check(value) if self.check is not None else ""


def in_range(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], str]:
    """A number in [lo, hi] ((lo, hi] with ``lo_open``), finite."""
    def check(v: Any) -> str:
        ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
        return "" if ok else f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}"
    return check


def ring_name(v: Any) -> str:
    ok = isinstance(v, str) and v and "/" not in v and len(v) <= 200
    return "" if ok else f"must be a non-empty shared-memory name without '/', at most 200 characters; got {v!r}"


def ring_param(v: Any) -> str:
    """A ring parameter: '' (derived from the node's namespace) or a name."""
    return "" if v == "" else ring_name(v)


def one_of(*choices: str) -> Callable[[Any], str]:
    return lambda v: "" if v in choices else f"must be one of {list(choices)}, got {v!r}"


PROFILE = Param("", "robot profile YAML (config/<robot>.yaml)")
CHECKPOINT = Param("", "checkpoint directory; overrides the profile's engine.checkpoint")
# Overrides of the profile, so that one profile starts on the machine at hand ('' keeps the profile's).
DEVICE = Param("", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N; overrides engine.device ('' keeps it)",
               lambda v: "" if v == "" else device_problem(v))
DTYPE = Param("", "float32, bfloat16 or float16; overrides engine.dtype ('' keeps it)",
              one_of("", "float32", "bfloat16", "float16"))
CACHE = Param("", "on or off: overrides cache.enabled ('' keeps it; on needs cache.repository)", one_of("", "on", "off"))
OVERRIDES = {"device": DEVICE, "dtype": DTYPE, "cache": CACHE}
AUTOSTART = Param(True, "true: the node configures (loads, warms up, attaches its rings) and activates itself at "
                         "start-up; false: it waits unconfigured for its lifecycle transitions (an external "
                         "lifecycle manager, `ros2 lifecycle set`)")
PEER_TIMEOUT = Param(3.0, "the policy node not heard (its 1 Hz diagnostics) for this long (s) is reported as an "
                          "ERROR on /diagnostics naming it; in [0.5, 3600] (run-time)",
                     in_range(0.5, 3600.0), dynamic=True)
MAX_INPUT_AGE = Param(1.0, "header stamps older than this (s) are refused; 0 turns the check off (run-time)",
                      in_range(0.0, 3600.0), dynamic=True)
MAX_FUTURE = Param(0.5, "header stamps further ahead of this node's clock (s) are refused; 0 turns the check off "
                        "(run-time)", in_range(0.0, 3600.0), dynamic=True)

VISION = {
    "profile": PROFILE,
    "checkpoint": CHECKPOINT,
    **OVERRIDES,
    "autostart": AUTOSTART,
    "peer_timeout_s": PEER_TIMEOUT,
    "ring": Param("", "name of the prefix ring buffer (shared memory) this node creates; '' derives it from the "
                      "namespace (vla_prefix, vla_prefix_<ns>)", ring_param),
    "working_set": Param("", "name of the cache manager's working-set ring buffer (reference selection and the "
                             "Context Cache read it); '' derives it from the namespace (vla_refs, vla_refs_<ns>)",
                         ring_param),
    "ring_slots": Param(4, "slots in the prefix ring buffer, in [2, 64]", in_range(2, 64)),
    "max_image_age_s": Param(1.0, "a camera with no new frame for this long (s) is stale: calls are refused (the "
                                  "robot holds) until it sends again; 0 turns the check off (run-time)",
                             in_range(0.0, 3600.0), dynamic=True),
    "frozen_after": Param(10, "a camera whose frames carry the same header stamp this many times in a row is "
                              "frozen: calls are refused until a new stamp comes; 0 turns the check off (run-time)",
                          lambda v: "" if v == 0 or 2 <= v <= 100000 else f"must be 0 or in [2, 100000], got {v!r}",
                          dynamic=True),
    "max_input_age_s": MAX_INPUT_AGE,
    "max_future_s": MAX_FUTURE,
}

POLICY = {
    "profile": PROFILE,
    "checkpoint": CHECKPOINT,
    **OVERRIDES,
    "autostart": AUTOSTART,
    "working_set": Param("", "name of the cache manager's working-set ring buffer (Action Cache masks); '' derives "
                             "it from the namespace", ring_param),
    "seed": Param(0, "noise seed: call n uses seed * 1000003 + n (reproducible chunks); >= 0", in_range(0, 2**62)),
    "request_timeout_s": Param(2.0, "a prefix request unanswered this long is abandoned and asked again (lost "
                                    "message, vision node restarting); in (0, 600] (run-time)",
                               in_range(0.0, 600.0, lo_open=True), dynamic=True),
    "max_input_age_s": MAX_INPUT_AGE,
    "max_future_s": MAX_FUTURE,
}

CACHE_MANAGER = {
    "profile": Param("", "robot profile YAML (config/<robot>.yaml); its cache section configures this node"),
    "checkpoint": CHECKPOINT,
    **OVERRIDES,
    "autostart": AUTOSTART,
    "peer_timeout_s": PEER_TIMEOUT,
    "working_set": Param("", "name of the working-set ring buffer this node creates; '' derives it from the "
                             "namespace", ring_param),
    "time_available_s": Param(0.0, "rebuild budget per call for entries entering the window (rMuscle T_avl), "
                                   "seconds, in [0, 3600]; 0: one chunk's execution time (run-time)",
                              in_range(0.0, 3600.0), dynamic=True),
}


def check_values(table: dict[str, Param], values: dict[str, Any]) -> list[str]:
    """Every problem of a node's start-up values, as 'name: problem'."""
    return [f"{name}: {p}" for name, spec in table.items() if name in values and (p := spec.problem(values[name]))]


def check_change(table: dict[str, Param], name: str, value: Any) -> str:
    """Why a run-time change of ``name`` to ``value`` is refused ('' when it is accepted)."""
    spec = table.get(name)
    if spec is None:
        return ""   # not ours (e.g. use_sim_time): rclpy decides
    if not spec.dynamic:
        return f"{name} is fixed at start-up (restart the node to change it)"
    p = spec.problem(value)
    return f"{name}: {p}" if p else ""


def declare_parameters(node: Any, table: dict[str, Param],
                       on_change: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Declare every parameter of ``table`` on ``node`` (read-only unless dynamic), refuse
    out-of-range start-up values (ValueError naming each), and validate run-time changes: a
    refused set reports the reason to the caller (``ros2 param set`` prints it); an accepted
    one is passed to ``on_change(name, value)``. Returns the start-up values."""
    from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult

    for name, spec in table.items():
        node.declare_parameter(name, spec.default, ParameterDescriptor(description=spec.description,
                                                                       read_only=not spec.dynamic))
    values = {name: node.get_parameter(name).value for name in table}
    problems = check_values(table, values)
    if problems:
        raise ValueError("invalid parameter(s): " + "; ".join(problems))

    def on_set(params: list) -> Any:
        for p in params:
            why = check_change(table, p.name, p.value)
            if why:
                node.get_logger().warning(f"parameter change refused: {why}")
                return SetParametersResult(successful=False, reason=why)
        if on_change is not None:
            for p in params:
                if p.name in table:
                    on_change(p.name, p.value)
        return SetParametersResult(successful=True)

    node.add_on_set_parameters_callback(on_set)
    return values


def ring_names(values: dict[str, Any], namespace: str = "/") -> RingNames:
    """The shared-memory names from a node's parameters; those left '' (the default) are derived
    from the node's namespace, so two pipelines in two namespaces never share a ring."""
    d = RingNames.for_namespace(namespace)
    names = RingNames(values.get("ring") or d.prefix, values.get("working_set") or d.working_set)
    for n in (names.prefix, names.working_set):
        if ring_name(n):
            raise ValueError(f"ring names must be non-empty, without '/', at most 200 characters; got {n!r}")
    return names


def with_overrides(profile: RobotProfile, values: dict[str, Any]) -> RobotProfile:
    """The profile with the node's ``device``, ``dtype`` and ``cache`` parameters applied (those
    not '') and validated again (``cache: on`` without a repository is refused naming the key)."""
    engine = replace(profile.engine, **{k: values[k] for k in ("device", "dtype") if values.get(k)})
    cache = profile.cache if not values.get("cache") else replace(profile.cache, enabled=values["cache"] == "on")
    return replace(profile, engine=engine, cache=cache).validate()


def profile_and_checkpoint(values: dict[str, Any]) -> tuple[RobotProfile, str]:
    """The node's robot profile (with its parameter overrides) and checkpoint (the parameter
    overrides the profile's)."""
    if not values.get("profile"):
        raise ValueError("no profile: set the 'profile' parameter (a robot profile YAML, config/<robot>.yaml)")
    profile = with_overrides(load_profile(values["profile"]), values)
    ckpt = values.get("checkpoint") or profile.engine.checkpoint
    if not ckpt:
        raise ValueError(f"no checkpoint: set the 'checkpoint' parameter (checkpoint:=DIR) or engine.checkpoint "
                         f"in {values['profile']}")
    if not values.get("checkpoint") and not Path(ckpt).exists():
        # a relative engine.checkpoint is resolved against the profile's folder and the package
        # (profile.profile_path): from an install, a checkpoint written in a checkout is not there
        raise ValueError(f"{ckpt}: no such checkpoint (engine.checkpoint of {values['profile']}, resolved "
                         f"against the profile's folder and the package): set the 'checkpoint' parameter "
                         f"(checkpoint:=DIR)")
    return profile, ckpt
