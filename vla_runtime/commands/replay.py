"""``vla-runtime replay``: run the policy over a recorded episode bag, offline, at its recorded timing.

A recorded bag (cameras, joint states, instruction) is replayed the way the robot's nodes would
have seen it: a policy call every ``call_period`` seconds of bag time, each on the newest message
of every topic at that moment (:func:`vla_runtime.io.bags.read_episode`). Each call runs
``VisionWorker.encode`` then ``PolicyWorker.act`` in-process, the same code the vision and policy
nodes run, with the policy node's noise seeding (``seed * 1000003 + call index``), so a replayed
chunk is the chunk the robot would have got for that observation.

The observation is validated and assembled by the nodes' own boundary code: images through the
vision node's ``image_from_msg``, joint states by name from *every* joint-state topic of the
profile (one per arm on ALOHA) into the profile's joint order through the policy node's
``JointStateAssembler``. A recording is therefore read in whatever order or split the robot
published it. A joint the profile names but the bag never has, or a message the node would refuse
(a NaN position, say; live, the node logs it and keeps its last state), is an error naming the
joint and the topic: a regression check must not pass quietly over inputs the robot could not use.
A camera whose message type differs from the profile's ``compressed`` flag is replayed with a
warning, since the vision node, subscribed with the profile's type, would not receive it.

Replay has no plan to predict a state from, so every call is conditioned on the *observed* joint
state. Chunks and per-call latencies go to an output bag (``vla_runtime/msg/ActionChunk`` and
``vla_runtime/msg/PhaseLatency``, stamped at the call's bag time), readable by ``ros2 bag`` and
by rosbags. As the policy node does, the chunk on ``/vla_runtime/action_chunk`` is clamped to the
profile's joint limits (what the robot would be sent); the model's raw chunk goes to
``/vla_runtime/action_chunk_raw`` beside it, and the regression check compares raw chunks (a
clamp would hide drift past a limit).

Regression mode (``golden``) compares the chunks with those of a golden output bag made earlier:
a model, kernel or preprocessing change that moves the actions by more than the tolerance is
caught on real recorded inputs instead of on synthetic tensors.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, get_args

import numpy as np
import torch
import yaml
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from ..engine.policy import Observation, Pi05Policy
from ..engine.safety import JointLimits
from ..engine.timing import PhaseTimer
from ..io.bags import (BAG_FORMAT_VERSION, COMPRESSED_IMAGE_TYPE, IMAGE_TYPE, Episode, Storage, profile_topics,
                       read_episode)
from ..models.checkpoint import checkpoint_files, infer_config, read_tensor_index
from ..models.config import Pi05Config
from ..nodes.profile import RobotProfile, load_profile
from ..nodes.workers import PolicyWorker, PrefixSlotSpec, VisionWorker

ACTION_CHUNK_TYPE = "vla_runtime/msg/ActionChunk"
PHASE_LATENCY_TYPE = "vla_runtime/msg/PhaseLatency"
#: The topics the policy node publishes on (chunks) and diagnostics use (latency).
ACTION_CHUNK_TOPIC = "/vla_runtime/action_chunk"
RAW_CHUNK_TOPIC = "/vla_runtime/action_chunk_raw"   # replay only: the chunk before the joint-limit clamp
LATENCY_TOPIC = "/vla_runtime/latency"
DIAGNOSTICS_TOPIC = "/diagnostics"
DIAGNOSTICS_TYPE = "diagnostic_msgs/msg/DiagnosticArray"

#: Same as the policy node: call n uses ``seed * NOISE_SEED_STRIDE + n``.
NOISE_SEED_STRIDE = 1_000_003
LATENCY_PHASES = ("vision", "prefill", "denoise", "total")
#: Prefix of the keys this tool writes into the bag metadata's ``custom_data``.
CUSTOM_DATA_PREFIX = "vla_runtime.replay."

_STORAGE_PLUGINS = {"sqlite3": StoragePlugin.SQLITE3, "mcap": StoragePlugin.MCAP}


# --------------------------------------------------------------------------------------------
# Message definitions
# --------------------------------------------------------------------------------------------


def find_msg_dir() -> Path:
    """The directory of this package's ``.msg`` files.

    In a source checkout it is ``msg/`` at the repository root; in a colcon install it is
    ``<prefix>/share/vla_runtime/msg``. Looked up rather than embedded so the bag's message
    definitions are exactly the ones the ROS build generates code from.
    """
    candidates = [Path(__file__).resolve().parents[2] / "msg", Path(sys.prefix) / "share" / "vla_runtime" / "msg"]
    for c in candidates:
        if (c / "ActionChunk.msg").is_file():
            return c
    raise FileNotFoundError(f"vla_runtime message definitions not found (looked for ActionChunk.msg in "
                            f"{', '.join(map(str, candidates))})")


def runtime_typestore(msg_dir: str | Path | None = None) -> Typestore:
    """A ROS 2 Jazzy typestore with the ``vla_runtime/msg/*`` types registered.

    ``std_msgs/Header`` inside our definitions is normalised by rosbags to
    ``std_msgs/msg/Header``, which the Jazzy store already holds, so registering our own types
    is all that is needed; they must be registered together because nothing else defines them.
    """
    msg_dir = find_msg_dir() if msg_dir is None else Path(msg_dir)
    files = sorted(msg_dir.glob("*.msg"))
    if not files:
        raise FileNotFoundError(f"no .msg files in {msg_dir}")
    types: dict[str, Any] = {}
    for f in files:
        types.update(get_types_from_msg(f.read_text(), f"vla_runtime/msg/{f.stem}"))
    store = get_typestore(Stores.ROS2_JAZZY)
    store.register(types)
    return store


# --------------------------------------------------------------------------------------------
# Spec and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySpec:
    """One replay run. ``checkpoint=None`` means the profile's ``engine.checkpoint``;
    ``golden=None`` means no regression check."""

    in_bag: Path
    out_bag: Path
    profile: Path
    checkpoint: Path | None = None
    call_period: float = 0.5
    seed: int = 0
    realtime: bool = False
    storage: Storage = "sqlite3"
    overwrite: bool = False
    golden: Path | None = None
    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("in_bag", "out_bag", "profile", "checkpoint", "golden"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if not (isinstance(self.call_period, (int, float)) and math.isfinite(self.call_period)
                and self.call_period > 0):
            raise ValueError(f"call_period must be a positive number of seconds, got {self.call_period!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.storage not in get_args(Storage):
            raise ValueError(f"storage must be one of {list(get_args(Storage))}, got {self.storage!r}")
        if not (isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a finite number >= 0, got {self.tolerance!r}")
        out = self.out_bag.resolve()
        for name in ("in_bag", "golden"):
            other = getattr(self, name)
            if other is not None and other.resolve() == out:
                raise ValueError(f"the output bag {self.out_bag} is the {name.replace('_', ' ')}; "
                                 "choose another output path")


@dataclass(frozen=True)
class CallResult:
    """One replayed policy call: when (bag time), what came out, how long each phase took."""

    call_id: int
    t: float                 # seconds since the input bag's first message
    stamp_ns: int            # the call's bag time (absolute, as in the input bag)
    actions: np.ndarray      # [chunk_length, action_dim], robot units, as the model gave them
    latency: dict[str, float]
    clamped: np.ndarray | None = None   # ``actions`` within the profile's joint limits (None: no limits known)

    @property
    def published(self) -> np.ndarray:
        """What the policy node would publish for this call."""
        return self.actions if self.clamped is None else self.clamped


@dataclass(frozen=True)
class GoldenChunk:
    """One ``ActionChunk`` read back from a bag."""

    call_id: int
    stamp_ns: int
    actions: np.ndarray


@dataclass
class Comparison:
    """Replayed chunks against golden ones; ``diffs[i]`` is call i's max abs difference."""

    tolerance: float
    diffs: list[float] = field(default_factory=list)
    problem: str | None = None     # first drift, in words; None when everything matches

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def max_diff(self) -> float | None:
        return max(self.diffs) if self.diffs else None


@dataclass
class ReplayReport:
    spec: ReplaySpec
    checkpoint: Path
    checkpoint_hash: str | None
    calls: list[CallResult]
    comparison: Comparison | None = None
    golden_provenance: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (what the CLI prints on stdout)."""
        medians = {k: statistics.median(c.latency[k] for c in self.calls) for k in LATENCY_PHASES}
        cmp = self.comparison
        return {
            "in_bag": str(self.spec.in_bag), "out_bag": str(self.spec.out_bag),
            "checkpoint": str(self.checkpoint), "checkpoint_hash": self.checkpoint_hash,
            "seed": self.spec.seed, "call_period_s": self.spec.call_period, "realtime": self.spec.realtime,
            "calls": len(self.calls), "chunk_shape": list(self.calls[0].actions.shape),
            "latency_median_s": medians,
            "golden": None if self.spec.golden is None else str(self.spec.golden),
            "tolerance": None if cmp is None else cmp.tolerance,
            "max_abs_diff": None if cmp is None else _json_float(cmp.max_diff),
            "per_call_max_abs_diff": None if cmp is None else [_json_float(d) for d in cmp.diffs],
            "drift": None if cmp is None else not cmp.ok,
            "problem": None if cmp is None else cmp.problem,
        }


def _json_float(x: float | None) -> float | str | None:
    """JSON has no inf/nan; a non-finite difference is spelled out instead."""
    return x if x is None or math.isfinite(x) else str(x)


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


def camera_type_warnings(path: Path, profile: RobotProfile) -> list[str]:
    """Cameras whose message type in the bag is not the one the profile declares.

    Replay decodes ``Image`` and ``CompressedImage`` alike, but the vision node subscribes
    with the type of the profile's ``compressed`` flag and would never receive the other: a
    replay that passes on such a bag says nothing about the live robot. A warning, not an
    error, since replaying a raw recording with a compressed profile (or back) is legitimate
    for checking the model."""
    reader = _open_reader(path)
    try:
        types = {c.topic: c.msgtype for c in reader.connections}
    finally:
        reader.close()
    out = []
    for cam in profile.cameras:
        want = COMPRESSED_IMAGE_TYPE if cam.compressed else IMAGE_TYPE
        got = types.get(cam.topic)
        if got in (IMAGE_TYPE, COMPRESSED_IMAGE_TYPE) and got != want:
            out.append(f"camera {cam.name!r}: the bag carries {got} on {cam.topic}, the profile declares {want} "
                       f"(compressed: {str(cam.compressed).lower()}); replay decodes it, but the vision node "
                       f"subscribes to {want} and would not receive these images")
    return out


def check_cameras_match_profile(cfg: Pi05Config, profile: RobotProfile, checkpoint: Path) -> None:
    """A profile with more cameras than the model has image slots cannot be served."""
    cams = [c.name for c in profile.cameras]
    if len(cams) > cfg.num_cameras:
        raise ValueError(f"checkpoint {checkpoint} takes {cfg.num_cameras} camera(s), profile {profile.name!r} "
                         f"has {len(cams)} ({cams})")


def check_policy_matches_profile(policy: Pi05Policy, profile: RobotProfile, checkpoint: Path) -> None:
    """Refuse a checkpoint built for another robot before any call runs: a camera or joint
    count mismatch would otherwise surface as a shape error deep in the model, or worse, as
    silently wrong actions."""
    check_cameras_match_profile(policy.engine.cfg, profile, checkpoint)
    for what, dim in (("state", policy.state_norm.dim), ("action", policy.action_norm.dim)):
        if dim != profile.state_dim:
            raise ValueError(f"checkpoint {checkpoint} has {dim}-dim {what}s, profile {profile.name!r} has "
                             f"{profile.state_dim} joints ({list(profile.joint_names)})")


def _open_reader(path: Path) -> Reader:
    """An opened rosbags Reader, or a ValueError that says the path is not a bag."""
    reader = Reader(path)
    try:
        reader.open()
    except ReaderError as exc:
        raise ValueError(f"{path} is not a readable rosbag2 bag: {exc}") from exc
    return reader


def _bag_start_ns(path: Path) -> int:
    reader = _open_reader(path)
    try:
        return int(reader.start_time)
    finally:
        reader.close()


def replay_episode(policy: Pi05Policy, episode: Episode, start_ns: int, seed: int, realtime: bool = False,
                   log: Callable[[str], None] = print, limits: JointLimits | None = None) -> list[CallResult]:
    """Run one policy call per frame of ``episode`` through the vision and policy workers.

    The two workers share ``policy``: the policy worker copies the slot into the model's KV
    cache before denoising, so the prefill the vision worker left there is never relied on,
    exactly as across the nodes' process boundary. With ``realtime`` each call waits until its
    bag time has elapsed on the wall clock since the first call (a call that overruns is not
    skipped, it just starts late, so the output stays the same as without ``realtime``). With
    ``limits`` each result also carries the chunk clamped to them, as the policy node publishes it.
    """
    vision, actor = VisionWorker(policy), PolicyWorker(policy)
    slot = PrefixSlotSpec.for_config(policy.engine.cfg, policy.engine.dtype).allocate()
    device = policy.engine.device
    results: list[CallResult] = []
    wall0 = time.monotonic()
    t0 = episode.frames[0].t
    for i, frame in enumerate(episode.frames):
        if realtime:
            delay = (frame.t - t0) - (time.monotonic() - wall0)
            if delay > 0:
                time.sleep(delay)
        stamp_ns = start_ns + round(frame.t * 1e9)
        obs = Observation(images=frame.images, state=frame.state, task=episode.instruction_at(i))
        timer = PhaseTimer(device)
        with timer.phase("total"):
            meta = vision.encode(obs, slot, observation_seq=i, stamp_ns=stamp_ns, timer=timer)
            gen = torch.Generator().manual_seed(seed * NOISE_SEED_STRIDE + i)
            with timer.phase("denoise"):
                actions = actor.act(slot, meta, generator=gen)
        lat = {k: float(timer.times.seconds[k]) for k in LATENCY_PHASES}
        raw = np.asarray(actions)
        results.append(CallResult(call_id=i, t=frame.t, stamp_ns=stamp_ns, actions=raw, latency=lat,
                                  clamped=None if limits is None else limits.clamp(raw)))
        log(f"call {i} at t={frame.t:.3f}s: vision {lat['vision'] * 1e3:.1f} ms, prefill "
            f"{lat['prefill'] * 1e3:.1f} ms, denoise {lat['denoise'] * 1e3:.1f} ms")
    return results


# --------------------------------------------------------------------------------------------
# Output bag
# --------------------------------------------------------------------------------------------


def _prepare_out(path: Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; then delete it only if it is a bag,
    so a typo in ``--out`` cannot wipe an unrelated directory."""
    if not path.exists():
        return
    if not overwrite:
        raise FileExistsError(f"output bag {path} exists already; pass --overwrite to replace it")
    if path.is_dir() and (path / "metadata.yaml").is_file():
        shutil.rmtree(path)
    elif path.is_file() and path.suffix in (".mcap", ".db3"):
        path.unlink()
    else:
        raise FileExistsError(f"{path} exists and is not a rosbag2 bag; refusing to overwrite it")


def write_replay_bag(path: Path, calls: list[CallResult], joint_names: Sequence[str], control_hz: float, robot: str,
                     storage: Storage, typestore: Typestore, provenance: dict[str, str] | None = None) -> None:
    """Write chunks and latencies as a rosbag2 bag (metadata version 9), one of each per call,
    logged and stamped at the call's bag time: row 0 of a replayed chunk applies at the moment
    its observation was taken (there is no controller plan in replay).

    ``joint_names``, ``control_hz`` and ``robot`` label the chunks (a profile's, or a dataset's
    action names and fps). ``provenance`` (checkpoint hash, seed, ...) goes into the metadata's
    ``custom_data`` under ``vla_runtime.replay.*``, so a drifting golden can say what it was made
    with."""
    t_ = typestore.types
    chunk_cls, lat_cls = t_[ACTION_CHUNK_TYPE], t_[PHASE_LATENCY_TYPE]
    period = 1.0 / control_hz
    writer = Writer(path, version=BAG_FORMAT_VERSION, storage_plugin=_STORAGE_PLUGINS[storage])
    for key, value in (provenance or {}).items():
        writer.set_custom_data(CUSTOM_DATA_PREFIX + key, value)
    with writer:
        chunk_conn = writer.add_connection(ACTION_CHUNK_TOPIC, ACTION_CHUNK_TYPE, typestore=typestore)
        raw_conn = writer.add_connection(RAW_CHUNK_TOPIC, ACTION_CHUNK_TYPE, typestore=typestore)
        lat_conn = writer.add_connection(LATENCY_TOPIC, PHASE_LATENCY_TYPE, typestore=typestore)
        diag_conn = writer.add_connection(DIAGNOSTICS_TOPIC, DIAGNOSTICS_TYPE, typestore=typestore)
        status_cls, kv_cls = t_["diagnostic_msgs/msg/DiagnosticStatus"], t_["diagnostic_msgs/msg/KeyValue"]
        for c in calls:
            stamp = t_["builtin_interfaces/msg/Time"](sec=c.stamp_ns // 10**9, nanosec=c.stamp_ns % 10**9)
            header = t_["std_msgs/msg/Header"](stamp=stamp, frame_id="")
            rows, dim = c.actions.shape
            for conn, actions in ((chunk_conn, c.published), (raw_conn, c.actions)):
                chunk = chunk_cls(header=header, call_id=c.call_id, joint_names=list(joint_names),
                                  control_period=period, chunk_length=rows, action_dim=dim,
                                  actions=np.ascontiguousarray(actions, dtype=np.float64).reshape(-1),
                                  source="dense", observation_seq=c.call_id)
                writer.write(conn, c.stamp_ns, typestore.serialize_cdr(chunk, ACTION_CHUNK_TYPE))
            lat = lat_cls(header=header, call_id=c.call_id, mode="dense", **c.latency)
            writer.write(lat_conn, c.stamp_ns, typestore.serialize_cdr(lat, PHASE_LATENCY_TYPE))
            # what the nodes report per call, so a replay bag opens in the same dashboards
            values = {"call_id": str(c.call_id), "source": "dense", "chunk_finite": str(bool(np.isfinite(c.actions).all())),
                      "clamped_values": str(int((c.published != c.actions).sum())),
                      **{f"{k}_s": f"{v:.6f}" for k, v in c.latency.items()}}
            status = status_cls(level=0, name="vla_runtime: replay", message="ok", hardware_id=robot,
                                values=[kv_cls(key=k, value=v) for k, v in values.items()])
            diag = t_[DIAGNOSTICS_TYPE](header=header, status=[status])
            writer.write(diag_conn, c.stamp_ns, typestore.serialize_cdr(diag, DIAGNOSTICS_TYPE))


def read_action_chunks(path: str | Path, typestore: Typestore | None = None, raw: bool = False) -> list[GoldenChunk]:
    """Every ``ActionChunk`` on ``/vla_runtime/action_chunk`` of a bag (as published: clamped to
    the joint limits), in log-time order. ``raw``: the model's chunks before the clamp, from
    ``/vla_runtime/action_chunk_raw``; a bag without that topic (written before replay clamped)
    holds the raw chunks on ``/vla_runtime/action_chunk``, which are read instead."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no bag at {path}")
    typestore = runtime_typestore() if typestore is None else typestore
    reader = _open_reader(path)
    try:
        topics = {c.topic for c in reader.connections}
        topic = RAW_CHUNK_TOPIC if raw and RAW_CHUNK_TOPIC in topics else ACTION_CHUNK_TOPIC
        conns = [c for c in reader.connections if c.topic == topic]
        if not conns:
            raise ValueError(f"bag {path} has no {topic} topic; it has: {sorted(topics) or 'none'}")
        wrong = sorted({c.msgtype for c in conns} - {ACTION_CHUNK_TYPE})
        if wrong:
            raise ValueError(f"bag {path}: {topic} carries {wrong}, expected {ACTION_CHUNK_TYPE}")
        out = []
        for _, ns, raw in reader.messages(connections=conns):
            try:
                m = typestore.deserialize_cdr(raw, ACTION_CHUNK_TYPE)
            except Exception as exc:  # noqa: BLE001 - re-raised with the bag and a likely cause
                raise ValueError(f"bag {path}: cannot read an ActionChunk at log time {ns} ({exc}); was it written "
                                 f"with another ActionChunk definition? Regenerate it") from exc
            actions = np.asarray(m.actions, dtype=np.float64)
            if actions.size != m.chunk_length * m.action_dim:
                raise ValueError(f"bag {path}: ActionChunk call {m.call_id} has {actions.size} values for "
                                 f"{m.chunk_length} x {m.action_dim}")
            stamp = m.header.stamp.sec * 10**9 + m.header.stamp.nanosec
            out.append(GoldenChunk(int(m.call_id), int(stamp), actions.reshape(m.chunk_length, m.action_dim)))
        return out
    finally:
        reader.close()


def read_replay_provenance(path: str | Path) -> dict[str, str]:
    """The ``vla_runtime.replay.*`` custom data of a bag written by replay (empty if none).

    Read from ``metadata.yaml`` directly: rosbags' public ``Reader`` does not expose
    ``custom_data``, and the file is the documented rosbag2 format. A lone storage file
    (no metadata) has none."""
    meta = Path(path) / "metadata.yaml"
    if not meta.is_file():
        return {}
    try:
        info = yaml.safe_load(meta.read_text())["rosbag2_bagfile_information"]
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise ValueError(f"{meta} is not rosbag2 metadata: {exc}") from exc
    custom = info.get("custom_data") or {}
    return {k[len(CUSTOM_DATA_PREFIX):]: str(v) for k, v in custom.items() if k.startswith(CUSTOM_DATA_PREFIX)}


# --------------------------------------------------------------------------------------------
# Regression check
# --------------------------------------------------------------------------------------------


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest element-wise difference; NaN where only one side is NaN counts as infinite."""
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    d[np.isnan(a) & np.isnan(b)] = 0.0
    d[np.isnan(d)] = np.inf
    return float(d.max()) if d.size else 0.0


def compare_chunks(calls: list[CallResult], golden: list[GoldenChunk], tolerance: float,
                   joint_names: tuple[str, ...] = ()) -> Comparison:
    """Call-by-call comparison. Every comparable call is measured (so the report shows whether
    drift is local or everywhere); ``problem`` describes the first one that fails. A count
    mismatch is reported only when the calls both sides have agree, since a named drifting
    call is the more useful message."""
    cmp = Comparison(tolerance=tolerance)
    for c, g in zip(calls, golden):
        where = f"call {c.call_id} (t={c.t:.3f}s)"
        if g.call_id != c.call_id or g.stamp_ns != c.stamp_ns:
            cmp.problem = cmp.problem or (
                f"{where}: the golden chunk in this position is call {g.call_id} stamped {g.stamp_ns} ns, "
                f"replay stamped {c.stamp_ns} ns (different input bag or call period?)")
            break
        if g.actions.shape != c.actions.shape:
            cmp.problem = cmp.problem or (f"{where}: chunk shape {list(c.actions.shape)}, golden "
                                          f"{list(g.actions.shape)} (different model or profile?)")
            break
        d = max_abs_diff(c.actions, g.actions)
        cmp.diffs.append(d)
        if not d <= tolerance and cmp.problem is None:
            err = np.abs(c.actions - g.actions)
            err[np.isnan(err)] = np.inf
            row, col = np.unravel_index(int(np.argmax(err)), err.shape)
            name = joint_names[col] if col < len(joint_names) else f"column {col}"
            cmp.problem = (f"{where} drifted: max |diff| {d:.3g} > tolerance {tolerance:.3g} (row {row}, "
                           f"{name}: {c.actions[row, col]:.6g}, golden {g.actions[row, col]:.6g})")
    if cmp.problem is None and len(calls) != len(golden):
        cmp.problem = (f"{len(calls)} call(s) replayed, the golden bag has {len(golden)} chunk(s) "
                       f"(different call period or input bag?)")
    return cmp


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def run_replay(spec: ReplaySpec, log: Callable[[str], None] = print) -> ReplayReport:
    """Replay ``spec.in_bag``, write ``spec.out_bag`` and, with ``spec.golden``, compare.

    Every input is checked before the model runs (profile, paths, checkpoint against the
    profile, topics), so a mistake costs no inference time. Drift does not raise here: the
    report's ``comparison`` says; :func:`replay_main` turns it into the exit status.
    """
    profile = load_profile(spec.profile)
    if not spec.in_bag.exists():
        raise FileNotFoundError(f"no input bag at {spec.in_bag}")
    if spec.golden is not None and not spec.golden.exists():
        raise FileNotFoundError(f"no golden bag at {spec.golden}")
    if spec.out_bag.exists() and not spec.overwrite:
        raise FileExistsError(f"output bag {spec.out_bag} exists already; pass --overwrite to replace it")
    checkpoint = spec.checkpoint if spec.checkpoint is not None else profile.engine.checkpoint
    if not checkpoint:
        raise ValueError(f"no checkpoint: pass --checkpoint or set engine.checkpoint in {spec.profile}")
    checkpoint = Path(checkpoint)
    typestore = runtime_typestore()
    topics = profile_topics(profile)
    for warning in camera_type_warnings(spec.in_bag, profile):
        log(f"warning: {warning}")

    # The camera count is known from the tensor index alone: check it before loading the weights.
    index, _ = read_tensor_index(checkpoint_files(checkpoint))
    check_cameras_match_profile(infer_config(checkpoint, index), profile, checkpoint)
    # Same loading as the nodes (default dtype and device), so replay reproduces their numbers.
    policy = Pi05Policy.from_checkpoint(checkpoint, camera_names=[c.name for c in profile.cameras])
    check_policy_matches_profile(policy, profile, checkpoint)
    episode = read_episode(spec.in_bag, topics, spec.call_period, state_dim=profile.state_dim)
    golden = read_action_chunks(spec.golden, typestore, raw=True) if spec.golden is not None else None
    golden_provenance = read_replay_provenance(spec.golden) if spec.golden is not None else {}
    log(f"replaying {spec.in_bag}: {len(episode.frames)} call(s) over {episode.duration:.2f}s "
        f"of bag time, checkpoint {checkpoint}")

    calls = replay_episode(policy, episode, _bag_start_ns(spec.in_bag), spec.seed, spec.realtime, log,
                           profile.joint_limits())
    _prepare_out(spec.out_bag, spec.overwrite)
    spec.out_bag.parent.mkdir(parents=True, exist_ok=True)
    provenance = {"checkpoint_hash": policy.checkpoint_hash or "", "seed": str(spec.seed),
                  "call_period": repr(spec.call_period), "input_bag": spec.in_bag.name}
    write_replay_bag(spec.out_bag, calls, profile.joint_names, profile.control_hz, profile.name, spec.storage,
                     typestore, provenance)
    log(f"wrote {len(calls)} chunk(s) and latencies to {spec.out_bag}")

    report = ReplayReport(spec, checkpoint, policy.checkpoint_hash, calls, golden_provenance=golden_provenance)
    if golden is not None:
        report.comparison = compare_chunks(calls, golden, spec.tolerance, profile.joint_names)
        for i, d in enumerate(report.comparison.diffs):
            verdict = "ok" if d <= spec.tolerance else "DRIFT"
            log(f"call {i} (t={calls[i].t:.3f}s): max |diff| {d:.3g} (tolerance {spec.tolerance:.3g}) {verdict}")
    return report


def replay_main(spec: ReplaySpec, log: Callable[[str], None] = print,
                out: Callable[[str], None] = print) -> int:
    """Run, print the JSON summary with ``out``, and return the exit status: 0, or 2 on drift
    (the same status as the CLI's input errors: in CI both mean "this did not pass")."""
    report = run_replay(spec, log)
    out(json.dumps(report.summary(), indent=2))
    cmp = report.comparison
    if cmp is not None and not cmp.ok:
        made = report.golden_provenance
        hint = ""
        if made.get("checkpoint_hash") and made["checkpoint_hash"] != report.checkpoint_hash:
            hint += f"; the golden was made with checkpoint {made['checkpoint_hash']}, this run used " \
                    f"{report.checkpoint_hash}"
        if made.get("seed") and made["seed"] != str(spec.seed):
            hint += f"; the golden was made with --seed {made['seed']}, this run used {spec.seed}"
        log(f"replay drifted from golden {spec.golden}: {cmp.problem}{hint}")
        return 2
    if cmp is not None:
        log(f"replay matches golden {spec.golden} within {spec.tolerance:g} ({len(cmp.diffs)} call(s), "
            f"max |diff| {cmp.max_diff:.3g})")
    return 0
