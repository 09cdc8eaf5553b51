"""Robot profiles: everything robot-specific the nodes need, from one YAML file, validated at load.

A profile names the camera topics (in the model's camera order), the joint-state and instruction
topics, the controller the chunks go to, joint names and limits, the control rate, and the engine,
streaming and cache settings. Every key is checked when the file is read, with a message naming
the key, so a typo fails at start-up instead of on the robot.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ..cache.halves import HALVES, parse_setting
from ..engine.safety import JointLimits
from ..engine.stitching import StitchConfig
from ..models.config import PRESETS
from .devices import device_problem

log = logging.getLogger(__name__)

OUTPUT_KINDS = ("joint_trajectory", "interbotix_joint_group")
GRIPPER_KINDS = ("joint_trajectory", "float64_array")
PREDICTORS = ("absolute", "delta", "observed")


def topic_problem(topic: object) -> str:
    """Why ``topic`` is not a topic name ('' when it is one). Relative names ('joint_states')
    resolve under the node's namespace (one robot per namespace); absolute ones ('/joint_states')
    do not."""
    ok = isinstance(topic, str) and topic.strip("/") and " " not in topic and "//" not in topic \
        and not topic.endswith("/")
    return "" if ok else f"must be a topic name (relative, or absolute with a leading /), got {topic!r}"


class ProfileError(ValueError):
    """The profile file is not usable; the message names the key and the problem."""


@dataclass(frozen=True)
class CameraSpec:
    name: str
    topic: str
    compressed: bool = False


@dataclass(frozen=True)
class OutputSpec:
    """Where action chunks go: a ros2_control joint_trajectory_controller (or MoveIt), or
    Interbotix joint-group commands (ALOHA), one per arm."""

    kind: str = "joint_trajectory"
    topics: tuple[str, ...] = ("/joint_trajectory_controller/joint_trajectory",)
    groups: tuple[str, ...] = ()          # interbotix: group name per topic (e.g. "arm")
    joint_slices: tuple[tuple[int, int], ...] = ()   # which joints each topic gets (default: all to the first)
    single_topics: tuple[str, ...] = ()   # interbotix: JointSingleCommand topics (grippers)
    single_names: tuple[str, ...] = ()    # interbotix joint name per single topic (e.g. "gripper")
    single_joints: tuple[int, ...] = ()   # which action index each single topic gets
    # A gripper on its own controller (an arm controller refuses joints it does not own): the
    # action column ``gripper_joint`` (e.g. a finger width), times ``gripper_scale``, to every one
    # of ``gripper_joint_names`` (Franka: the two fingers at half the width each), as a
    # JointTrajectory (``joint_trajectory``: a gripper trajectory controller, the whole plan) or
    # a Float64MultiArray (``float64_array``: a forward command controller, every control tick).
    gripper_kind: str = ""
    gripper_topic: str = ""
    gripper_joint: int = -1
    gripper_joint_names: tuple[str, ...] = ()
    gripper_scale: float = 1.0


@dataclass(frozen=True)
class EngineSpec:
    checkpoint: str | None = None
    preset: str | None = None    # when set: the checkpoint's architecture must be this preset's (checked at start-up)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    share_weights: bool = True   # CPU: every node maps one file of fused weights instead of a copy each
    norm_asset: str | None = None  # openpi checkpoints: which assets/<id>/norm_stats.json (needed if several)
    weights_per_role: bool = True   # each node process keeps only the model parts it runs (models.parts)


@dataclass(frozen=True)
class StreamingSpec:
    stitch: StitchConfig = field(default_factory=StitchConfig)
    predictor: str = "absolute"
    max_obs_age_s: float = 0.2
    watchdog_s: float = 1.0
    on_stale: str = "hold"
    stream_horizon: int = 1
    # the policy node's control tick thread: SCHED_FIFO priority 1-99 (0: ordinary scheduling);
    # refused without CAP_SYS_NICE / an rtprio limit (a warning, then ordinary). nodes/tick_loop.py
    tick_rt_priority: int = 10
    # the policy node's process nice value (-20..19; null: as started): its threads hand the
    # interpreter lock to the tick without waiting behind other processes. nodes/priority.py
    policy_nice: int | None = -10


@dataclass(frozen=True)
class CacheSpec:
    enabled: bool = False
    repository: str | None = None
    rho_p: float | None = None   # Context Cache fraction; unset: the repository's profiled one (halves.choose_rho_p)
    episodes: int = 4        # T
    lookahead: int = 4       # L
    memory_budget_mb: int = 4096
    reuse_budget_mb: int = 1024  # entries rebuilt earlier kept for the next window that wants them (0: none)
    background_nice: int = 10    # the cache manager's process runs this much nicer: rebuilds yield to calls
    # each half of the cache: auto (run it where build-cache --profile showed it faster than dense
    # on this machine, its paired ratio's 95 % interval above 1.0; unmeasured: run it), on, off
    # (true/false of older profiles read as on/off);
    # resolved at start-up by cache.halves.resolve_halves
    context_cache: str = "auto"   # reuse the reference's VLM FFN outputs in the prefill (Context Cache)
    action_cache: str = "auto"    # the reference's neuron masks between anchor steps (Action Cache)
    min_similarity: float = 0.8  # an episode whose best reference is less similar (cosine of ViT features) runs dense
    first_scene_floor: bool = False   # also run dense an episode whose first scene is less like the repository
    #                                   than any reference's first scene is to the others (retrieval.first_call_floors)
    max_end_matches: int = 3     # an episode matching references' last calls more often runs dense (0: no limit)
    first_search_wait_s: float = 1.0   # an episode's first search waits at most this long for its initial window
    # auto only: after this many calls the vision stage compares what choosing a reference cost them
    # (median) with what the auto-chosen halves save, and runs the rest dense if choosing costs more
    # (cache.selection_budget); 0: never check
    selection_check_calls: int = 50

    def __post_init__(self) -> None:
        # one spelling from here on ("auto" | "on" | "off"); anything else is refused naming the key
        for key in HALVES:
            object.__setattr__(self, key, parse_setting(getattr(self, key), f"cache.{key}"))


@dataclass(frozen=True)
class DatasetSpec:
    """Which features of a LeRobot dataset hold this robot's cameras, state and actions.

    ``cameras`` maps a profile camera name to its dataset key; a camera not listed is read from
    ``observation.images.<name>``, LeRobot's own naming."""

    cameras: dict[str, str] = field(default_factory=dict)
    state: str = "observation.state"
    action: str = "action"

    def camera_key(self, name: str) -> str:
        return self.cameras.get(name, f"observation.images.{name}")


@dataclass(frozen=True)
class RobotProfile:
    name: str
    cameras: tuple[CameraSpec, ...]
    joint_names: tuple[str, ...]
    joint_lower: tuple[float, ...]
    joint_upper: tuple[float, ...]
    control_hz: float
    joint_states_topics: tuple[str, ...] = ("/joint_states",)
    instruction_topic: str = "/instruction"
    max_velocity: tuple[float, ...] | None = None
    arm_slices: tuple[tuple[int, int], ...] = ()
    output: OutputSpec = field(default_factory=OutputSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    streaming: StreamingSpec = field(default_factory=StreamingSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    controllers: str | None = None   # the controller configuration the outputs are written for (documentation,
    #                                  checked against the outputs by test/nodes/test_profile.py)

    @property
    def state_dim(self) -> int:
        return len(self.joint_names)

    def joint_limits(self) -> JointLimits:
        """The safety filter's limits: positions, and speeds when the profile gives them."""
        return JointLimits.from_lists(list(self.joint_lower), list(self.joint_upper),
                                      None if self.max_velocity is None else list(self.max_velocity))

    def validate(self) -> "RobotProfile":
        def bad(key: str, msg: str) -> ProfileError:
            return ProfileError(f"profile {self.name!r}: {key}: {msg}")

        if not self.cameras:
            raise bad("cameras", "at least one camera is needed")
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names):
            raise bad("cameras", f"camera names must be unique, got {names}")
        for c in self.cameras:
            if problem := topic_problem(c.topic):
                raise bad(f"cameras.{c.name}.topic", problem)
        n = len(self.joint_names)
        if n == 0 or len(set(self.joint_names)) != n:
            raise bad("joint_names", "must be a non-empty list of unique names")
        for key in ("joint_lower", "joint_upper"):
            v = getattr(self, key)
            if len(v) != n or not all(math.isfinite(x) for x in v):
                raise bad(key, f"needs {n} finite values (one per joint), got {list(v)}")
        if any(lo >= hi for lo, hi in zip(self.joint_lower, self.joint_upper)):
            raise bad("joint_lower/joint_upper", "each lower limit must be below its upper limit")
        if self.max_velocity is not None and (len(self.max_velocity) != n or any(v <= 0 for v in self.max_velocity)):
            raise bad("max_velocity", f"needs {n} positive values")
        if not (math.isfinite(self.control_hz) and 1 <= self.control_hz <= 2000):
            raise bad("control_hz", f"must be in [1, 2000] Hz, got {self.control_hz}")
        for a, b in self.arm_slices:
            if not 0 <= a < b <= n:
                raise bad("arm_slices", f"slice [{a}, {b}) outside the {n} joints")
        o = self.output
        if o.kind not in OUTPUT_KINDS:
            raise bad("output.kind", f"must be one of {OUTPUT_KINDS}, got {o.kind!r}")
        if not o.topics or any(topic_problem(t) for t in o.topics):
            raise bad("output.topics", f"needs topic names, got {list(o.topics)}")
        if o.joint_slices and len(o.joint_slices) != len(o.topics):
            raise bad("output.joint_slices", "one slice per output topic")
        if o.kind == "interbotix_joint_group" and len(o.groups) != len(o.topics):
            raise bad("output.groups", "interbotix output needs one group name per topic")
        for a, b in o.joint_slices:
            if not 0 <= a < b <= n:
                raise bad("output.joint_slices", f"slice [{a}, {b}) outside the {n} joints")
        if o.single_topics:
            if o.kind != "interbotix_joint_group":
                raise bad("output.single_topics", "single-joint commands exist for interbotix_joint_group output only")
            if not (len(o.single_names) == len(o.single_joints) == len(o.single_topics)):
                raise bad("output.single_names/single_joints", "one joint name and one action index per single topic")
            if any(topic_problem(t) for t in o.single_topics):
                raise bad("output.single_topics", f"needs topic names, got {list(o.single_topics)}")
            if any(not isinstance(j, int) or not 0 <= j < n for j in o.single_joints):
                raise bad("output.single_joints", f"action indices must be in [0, {n})")
        if o.gripper_kind:
            if o.gripper_kind not in GRIPPER_KINDS or o.kind != "joint_trajectory":
                raise bad("output.gripper_kind", f"must be one of {GRIPPER_KINDS}, with output.kind joint_trajectory; "
                                                 f"got {o.gripper_kind!r}")
            if not o.gripper_topic or not o.gripper_joint_names:
                raise bad("output.gripper_topic/gripper_joint_names", "a gripper output needs its topic and joints")
            if isinstance(o.gripper_joint, bool) or not isinstance(o.gripper_joint, int) or not 0 <= o.gripper_joint < n:
                raise bad("output.gripper_joint", f"action index must be in [0, {n}), got {o.gripper_joint!r}")
            if not (isinstance(o.gripper_scale, (int, float)) and o.gripper_scale > 0):
                raise bad("output.gripper_scale", f"must be > 0, got {o.gripper_scale!r}")
            if any(a <= o.gripper_joint < b for a, b in o.joint_slices or ((0, n),)):
                raise bad("output.joint_slices", f"the gripper joint {o.gripper_joint} also goes to an arm topic: "
                                                 "its controller would refuse the trajectory")
        s = self.streaming
        if s.predictor not in PREDICTORS:
            raise bad("streaming.predictor", f"must be one of {PREDICTORS}, got {s.predictor!r}")
        if s.on_stale not in ("hold", "finish_chunk"):
            raise bad("streaming.on_stale", f"must be 'hold' or 'finish_chunk', got {s.on_stale!r}")
        if not (s.max_obs_age_s > 0 and s.watchdog_s > 0 and s.stream_horizon >= 1):
            raise bad("streaming", "max_obs_age_s and watchdog_s must be > 0, stream_horizon >= 1")
        if isinstance(s.tick_rt_priority, bool) or not isinstance(s.tick_rt_priority, int) \
                or not 0 <= s.tick_rt_priority <= 99:
            raise bad("streaming.tick_rt_priority", f"must be an int in [0, 99] (0: ordinary scheduling), "
                                                    f"got {s.tick_rt_priority!r}")
        if s.policy_nice is not None and (isinstance(s.policy_nice, bool) or not isinstance(s.policy_nice, int)
                                          or not -20 <= s.policy_nice <= 19):
            raise bad("streaming.policy_nice", f"must be null or an int in [-20, 19], got {s.policy_nice!r}")
        c = self.cache
        if c.enabled and not c.repository:
            raise bad("cache.repository", "required when the cache is enabled")
        if c.rho_p is not None and (isinstance(c.rho_p, bool) or not isinstance(c.rho_p, (int, float))
                                    or not 0 < c.rho_p <= 1):
            raise bad("cache.rho_p", f"must be null (the repository's profiled fraction) or in (0, 1], got {c.rho_p!r}")
        if c.episodes < 1 or c.lookahead < 0 or c.memory_budget_mb < 1:
            raise bad("cache", "episodes >= 1, lookahead >= 0, memory_budget_mb >= 1")
        if isinstance(c.reuse_budget_mb, bool) or not isinstance(c.reuse_budget_mb, int) or c.reuse_budget_mb < 0:
            raise bad("cache.reuse_budget_mb", f"must be an int >= 0 (0: keep no rebuilt entry), got {c.reuse_budget_mb!r}")
        if isinstance(c.background_nice, bool) or not isinstance(c.background_nice, int) \
                or not 0 <= c.background_nice <= 19:
            raise bad("cache.background_nice", f"must be an int in [0, 19] (0: same priority as the calls), "
                                               f"got {c.background_nice!r}")
        if not (isinstance(c.min_similarity, (int, float)) and 0 < c.min_similarity <= 1):
            raise bad("cache.min_similarity", f"must be in (0, 1], got {c.min_similarity!r}")
        if not isinstance(c.first_scene_floor, bool):
            raise bad("cache.first_scene_floor", f"must be true or false, got {c.first_scene_floor!r}")
        if isinstance(c.max_end_matches, bool) or not isinstance(c.max_end_matches, int) or c.max_end_matches < 0:
            raise bad("cache.max_end_matches", f"must be an integer >= 0 (0: no limit), got {c.max_end_matches!r}")
        w = c.first_search_wait_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise bad("cache.first_search_wait_s", f"must be a number of seconds >= 0, got {w!r}")
        n = c.selection_check_calls
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad("cache.selection_check_calls", f"must be an integer >= 0 (0: never check), got {n!r}")
        if c.enabled and c.context_cache == c.action_cache == "off":
            raise bad("cache", "enabled with both context_cache and action_cache off: set enabled: false instead")
        ds = self.dataset
        if not isinstance(ds.cameras, dict) or any(k not in names for k in ds.cameras):
            raise bad("dataset.cameras", f"must map camera names of this profile ({names}) to dataset keys, "
                                         f"got {ds.cameras!r}")
        keys = [ds.camera_key(n) for n in names] + [ds.state, ds.action]
        if not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys):
            raise bad("dataset", f"dataset keys must be non-empty and distinct, got {keys}")
        e = self.engine
        if e.preset is not None and e.preset not in PRESETS:
            raise bad("engine.preset", f"must be null or one of {sorted(PRESETS)}, got {e.preset!r}")
        if e.dtype not in ("float32", "bfloat16", "float16"):
            raise bad("engine.dtype", f"must be float32, bfloat16 or float16, got {e.dtype!r}")
        if problem := device_problem(e.device):
            raise bad("engine.device", problem)
        if e.threads is not None and not (isinstance(e.threads, int) and 1 <= e.threads <= 256):
            raise bad("engine.threads", f"must be null or an int in [1, 256], got {e.threads!r}")
        if not isinstance(e.share_weights, bool):
            raise bad("engine.share_weights", f"must be true or false, got {e.share_weights!r}")
        if e.norm_asset is not None and not (isinstance(e.norm_asset, str) and e.norm_asset.strip()):
            raise bad("engine.norm_asset", f"must be null or a non-empty asset id, got {e.norm_asset!r}")
        if not isinstance(e.weights_per_role, bool):
            raise bad("engine.weights_per_role", f"must be true or false, got {e.weights_per_role!r}")
        return self


def _build(cls, data: Any, where: str):
    """Dataclass ``cls`` from a mapping, refusing unknown keys (typos) with their path."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {e}") from None


# Keys older profiles may still carry, with why they no longer do anything (warned, then ignored).
RETIRED_CACHE_KEYS = {
    "reference_timeout_s": "the vision node no longer waits for the cache manager: it selects the reference "
                           "itself from the published window",
}


def _without_retired(cache: Any, where: str) -> Any:
    if not isinstance(cache, dict):
        return cache
    for key in RETIRED_CACHE_KEYS.keys() & cache.keys():
        log.warning("%s.%s is no longer used (%s); remove it", where, key, RETIRED_CACHE_KEYS[key])
    return {k: v for k, v in cache.items() if k not in RETIRED_CACHE_KEYS}


def profile_from_dict(data: dict, where: str = "profile") -> RobotProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping at the top level")
    d = dict(data)
    try:
        cams = tuple(_build(CameraSpec, {"name": k, **(v if isinstance(v, dict) else {"topic": v})}, f"{where}.cameras.{k}")
                     for k, v in (d.pop("cameras", None) or {}).items())
        out = d.pop("output", None) or {}
        out = _build(OutputSpec, {**out, **{k: tuple(tuple(x) if isinstance(x, list) else x for x in out[k])
                                            for k in ("topics", "groups", "joint_slices", "single_topics", "single_names",
                                                      "single_joints", "gripper_joint_names") if k in out}}, f"{where}.output")
        stream = dict(d.pop("streaming", None) or {})
        stitch = _build(StitchConfig, stream.pop("stitch", None), f"{where}.streaming.stitch")
        streaming = _build(StreamingSpec, {**stream, "stitch": stitch}, f"{where}.streaming")
        engine = _build(EngineSpec, d.pop("engine", None), f"{where}.engine")
        cache = _build(CacheSpec, _without_retired(d.pop("cache", None), f"{where}.cache"), f"{where}.cache")
        dataset = _build(DatasetSpec, d.pop("dataset", None), f"{where}.dataset")
        for key in ("joint_names", "joint_lower", "joint_upper", "max_velocity", "joint_states_topics"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        if "arm_slices" in d:
            d["arm_slices"] = tuple(tuple(s) for s in d["arm_slices"])
        prof = _build(RobotProfile, {**d, "cameras": cams, "output": out, "streaming": streaming,
                                     "engine": engine, "cache": cache, "dataset": dataset}, where)
    except ProfileError:
        raise
    return prof.validate()


def profile_path(value: str | None, profile_file: Path) -> str | None:
    """A path a profile names (``engine.checkpoint``, ``cache.repository``), independent of the
    working directory: absolute (``~`` expanded) as given; relative, against the profile's
    folder, or, for a profile in a ``config/`` folder, against the folder above it (the package:
    the source tree, or ``install/share/vla_runtime``, where ``checkpoints/`` is installed too).
    The first that exists wins; when none does, the package's (or the folder's) is returned, so
    the error the loader raises names a place the profile could mean."""
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    folder = profile_file.resolve().parent
    bases = [folder] + ([folder.parent] if folder.name == "config" else [])
    candidates = [b / p for b in bases]
    return str(next((c for c in candidates if c.exists()), candidates[-1]))


def with_paths_resolved(prof: RobotProfile, profile_file: Path) -> RobotProfile:
    """``prof`` with its checkpoint and repository paths made absolute (``profile_path``)."""
    return replace(prof, engine=replace(prof.engine, checkpoint=profile_path(prof.engine.checkpoint, profile_file)),
                   cache=replace(prof.cache, repository=profile_path(prof.cache.repository, profile_file)),
                   controllers=profile_path(prof.controllers, profile_file))


def load_profile(path: str | Path) -> RobotProfile:
    """Read and validate a robot profile YAML (``config/<robot>.yaml``); relative paths in it
    are resolved against the file (``profile_path``), never the working directory."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML ({e})") from None
    return with_paths_resolved(profile_from_dict(data, where=str(path)), path)
