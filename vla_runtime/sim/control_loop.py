"""A robot controller against an inference engine, in simulated time (no ROS, no wall clock).

Streaming only pays off if the controller never runs out of actions while a call is in
flight, and the numbers that say so (stall rate, reaction latency, smoothness at chunk
boundaries) depend on the *timing* of calls relative to ticks, not on how fast this machine
happens to be. So the loop is a deterministic discrete-event simulation: time is the tick
counter, each call's duration is a latency taken from a :class:`LatencySource` (measured wall
time of the real engine, or an injected constant / jittered value), and its chunk becomes
available at the first tick at or after ``call tick + latency``. The engine (or a cheap
stand-in ``chunk_fn``) is still run for its actions, at call start.

The decisions are the policy node's own: stream mode drives ``engine.controller.StreamingController``
(the class the node drives from its timer), sync mode its subclass :class:`SyncController`, so a
change to the controller shows in these figures. One tick, in order:

1. a call whose simulated completion has come is merged into the plan (stitcher), the
   scheduler learns its latency, the watchdog learns a fresh chunk arrived;
2. a new call may start (stream: :class:`StreamingScheduler`; sync: when the executed part
   of the chunk is used up). Its observation is the robot's state and images at this tick
   (minus an optional camera delay); the state written into the prompt is the future-state
   predictor's guess for the tick the chunk starts at;
3. the controller pops the plan's action for this tick through the watchdog and the safety
   filter (holding when nothing is planned: a *stall*), and the robot moves towards the
   command with a first-order lag.

Sync mode is the LeRobot-sync / openpi-serving baseline: execute ``n_execute`` actions of a
chunk, then observe and stand still until the next chunk arrives. Stream mode uses the same
execution horizon, but starts the next call early enough that the chunk is there when the
horizon ends, so the comparison isolates what overlapping inference with execution buys.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np

from ..engine.controller import CallRequest, ControllerConfig, StreamingController
from ..engine.predictor import PREDICTORS
from ..engine.safety import JointLimits
from ..engine.scheduler import seconds_to_ticks
from ..engine.stitching import StitchConfig, boundary_jerk
from ..engine.timing import summarize

HARNESS_MODES = ("sync", "stream")
DEFAULT_TASK = "pick up the red block and put it in the bowl"

Latency = Union[str, float, tuple[float, float]]


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class HarnessConfig:
    """One simulated run. ``latency``: ``"measured"`` (wall time of each real call),
    a number of seconds (injected constant) or ``(mean_s, jitter_s)`` (injected, normal
    jitter clipped at zero, seeded). ``n_execute``: actions executed per chunk before the
    next one takes over (both modes; ``None`` = half a chunk). ``stream_horizon``: in stream
    mode, the ticks of each chunk after which the next call's chunk is due (``None`` =
    ``n_execute``, just in time; 1 = continuous re-planning: the next call starts as soon as the
    previous one returns, as Reflex's policy stream does). ``event_times_s``: moments the
    task target changes, for the reaction latency. ``obs_delay_s``: camera latency (the
    observation a call uses is this old). ``watchdog_s``: plan freshness deadline (``None``
    = two chunk durations). ``joint_lower``/``joint_upper``: safety limits (``None`` = +-pi).
    """

    control_hz: float = 50.0
    duration_s: float = 10.0
    mode: str = "stream"
    n_execute: int | None = None
    stream_horizon: int | None = None
    stitch: StitchConfig = field(default_factory=StitchConfig)
    predictor: str = "absolute"
    latency: Latency = 0.04
    event_times_s: tuple[float, ...] = ()
    seed: int = 0
    task: str = DEFAULT_TASK
    robot_tau_s: float = 0.05
    obs_delay_s: float = 0.0
    render: bool = False
    margin_ticks: int = 1
    max_obs_age_s: float = 0.2
    latency_quantile: float = 0.9
    latency_window: int = 20
    initial_latency_s: float | None = None
    warmup_calls: int = 1
    watchdog_s: float | None = None
    joint_lower: tuple[float, ...] | None = None
    joint_upper: tuple[float, ...] | None = None
    max_velocity: tuple[float, ...] | None = None
    initial_state: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _positive(self.control_hz, "control_hz")
        _positive(self.duration_s, "duration_s")
        if self.mode not in HARNESS_MODES:
            raise ValueError(f"mode must be one of {HARNESS_MODES}, got {self.mode!r}")
        if self.n_execute is not None and (not isinstance(self.n_execute, int) or self.n_execute < 1):
            raise ValueError(f"n_execute must be an int >= 1 or None, got {self.n_execute!r}")
        if self.stream_horizon is not None and (not isinstance(self.stream_horizon, int) or self.stream_horizon < 1):
            raise ValueError(f"stream_horizon must be an int >= 1 or None, got {self.stream_horizon!r}")
        if not isinstance(self.stitch, StitchConfig):
            raise ValueError(f"stitch must be a StitchConfig, got {type(self.stitch).__name__}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {self.predictor!r}")
        _check_latency(self.latency)
        events = tuple(float(e) for e in self.event_times_s)
        if any(not math.isfinite(e) or e < 0 for e in events) or list(events) != sorted(events):
            raise ValueError(f"event_times_s must be finite, >= 0 and sorted, got {self.event_times_s!r}")
        object.__setattr__(self, "event_times_s", events)
        _positive(self.robot_tau_s, "robot_tau_s")
        if not (math.isfinite(self.obs_delay_s) and self.obs_delay_s >= 0):
            raise ValueError(f"obs_delay_s must be finite and >= 0, got {self.obs_delay_s!r}")
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError("task must be a non-empty instruction")
        if not isinstance(self.warmup_calls, int) or self.warmup_calls < 0:
            raise ValueError(f"warmup_calls must be an int >= 0, got {self.warmup_calls!r}")
        if self.watchdog_s is not None:
            _positive(self.watchdog_s, "watchdog_s")
        if (self.joint_lower is None) != (self.joint_upper is None):
            raise ValueError("give both joint_lower and joint_upper, or neither")
        # The remaining scheduler fields are validated by SchedulerConfig.
        initial = self.initial_latency_s if self.initial_latency_s is not None else 0.1
        self.controller_config(chunk_size=1, action_dim=1, n_execute=1, initial_latency_s=initial).scheduler_config()

    @property
    def dt(self) -> float:
        return 1.0 / self.control_hz

    @property
    def total_ticks(self) -> int:
        return int(round(self.duration_s * self.control_hz))

    def controller_config(self, chunk_size: int, action_dim: int, n_execute: int,
                          initial_latency_s: float) -> ControllerConfig:
        """The controller this run simulates (the policy node's, with the harness's knobs)."""
        return ControllerConfig(
            control_hz=self.control_hz, chunk_size=chunk_size, action_dim=action_dim, stitch=self.stitch,
            predictor=self.predictor, max_obs_age_s=self.max_obs_age_s,
            watchdog_s=self.watchdog_s if self.watchdog_s is not None else 2 * chunk_size * self.dt,
            stream_horizon=self.stream_horizon or n_execute, initial_latency_s=initial_latency_s,
            margin_ticks=self.margin_ticks, latency_quantile=self.latency_quantile,
            latency_window=self.latency_window)


def _check_latency(latency: Latency) -> None:
    if isinstance(latency, str):
        if latency != "measured":
            raise ValueError(f"latency must be 'measured', seconds or (mean_s, jitter_s), got {latency!r}")
    elif isinstance(latency, tuple):
        if len(latency) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in latency):
            raise ValueError(f"latency (mean_s, jitter_s) must be two finite numbers >= 0, got {latency!r}")
    elif isinstance(latency, bool) or not isinstance(latency, (int, float)) or not math.isfinite(latency) or latency < 0:
        raise ValueError(f"latency must be 'measured', seconds >= 0 or (mean_s, jitter_s), got {latency!r}")


def _latency_mean(latency: Latency) -> float:
    return float(latency[0]) if isinstance(latency, tuple) else float(latency)  # type: ignore[arg-type]


def spread_events(duration_s: float, every_s: float = 1.0, seed: int = 0, start_s: float = 1.0) -> tuple[float, ...]:
    """Target changes about every ``every_s`` at seeded random phases (so they do not lock
    onto the call cadence and the reaction latency samples the whole cycle)."""
    rng = np.random.default_rng(seed)
    out, t = [], start_s
    while t + every_s <= duration_s:
        out.append(round(t + float(rng.uniform(0.05, 0.95)) * every_s, 6))
        t += every_s
    return tuple(out)


# ------------------------------------------------------------------------------------------
# Latency, robot, observations
# ------------------------------------------------------------------------------------------


class LatencySource:
    """How long a call takes in simulated time: its measured wall time, or injected."""

    def __init__(self, latency: Latency, seed: int = 0):
        _check_latency(latency)
        self.latency = latency
        self._rng = np.random.default_rng(seed)

    @property
    def measured(self) -> bool:
        return self.latency == "measured"

    def duration(self, wall_s: float) -> float:
        """Simulated duration of a call that took ``wall_s`` of wall time to run here."""
        if self.measured:
            return float(wall_s)
        if isinstance(self.latency, tuple):
            mean, jitter = self.latency
            return max(0.0, float(self._rng.normal(mean, jitter))) if jitter > 0 else float(mean)
        return float(self.latency)  # type: ignore[arg-type]


class Robot:
    """Joint positions tracking the commanded positions with a first-order lag ``tau``:
    what a position-controlled arm's servo loop looks like from the policy's side. The
    state is what the next observation reports; the history serves delayed observations."""

    def __init__(self, initial_state: np.ndarray, dt: float, tau_s: float):
        self.state = np.asarray(initial_state, dtype=np.float64).copy()
        if self.state.ndim != 1 or not np.isfinite(self.state).all():
            raise ValueError("the robot's initial state must be a finite vector")
        self.alpha = 1.0 - math.exp(-dt / _positive(tau_s, "tau_s"))
        self.history: list[np.ndarray] = [self.state.copy()]   # history[t]: state at the start of tick t

    def step(self, command: np.ndarray) -> None:
        """Apply ``command`` for one tick."""
        target = np.asarray(command, dtype=np.float64)[: self.state.shape[0]]
        self.state = self.state + self.alpha * (target - self.state)
        self.history.append(self.state.copy())

    def state_at(self, tick: int) -> np.ndarray:
        return self.history[max(0, min(tick, len(self.history) - 1))].copy()


@dataclass(frozen=True)
class SimObservation:
    """What a call sees: taken at ``tick`` (``time_s``); ``phase`` counts the task-target
    changes before it (what a stand-in policy reacts to; the renderer shows it)."""

    tick: int
    time_s: float
    state: np.ndarray
    images: dict[str, np.ndarray]
    task: str
    phase: int


ChunkFn = Callable[[SimObservation, np.ndarray], np.ndarray]


def _standin_images(cameras: Sequence[str], state: np.ndarray, phase: int) -> dict[str, np.ndarray]:
    """Cheap deterministic frames (no rendering) that still change with state and target."""
    level = int(40 + 30 * (phase % 6))
    img = np.full((32, 32, 3), level, dtype=np.uint8)
    img[..., 1] = np.uint8(int(128 + 100 * math.tanh(float(np.sum(state)))) % 256)
    return {cam: img.copy() for cam in cameras}


# ------------------------------------------------------------------------------------------
# Result
# ------------------------------------------------------------------------------------------


@dataclass
class CallRecord:
    call_id: int
    call_tick: int          # when the call started
    obs_tick: int           # when its observation was taken (call_tick - camera delay)
    start_tick: int         # the tick its action 0 is meant for
    arrival_tick: int       # first tick its chunk was available
    latency_s: float        # simulated duration
    wall_s: float           # what running it cost here
    influence_tick: int | None = None     # first tick whose plan it changed (None: never merged)
    plan_remaining_at_arrival: int | None = None


@dataclass
class HarnessResult:
    mode: str
    stitch: str
    predictor: str
    control_hz: float
    total_ticks: int
    warmup_ticks: int             # ticks before the first planned action executed (excluded)
    ticks: int                    # measured ticks
    stall_ticks: int              # measured ticks with no planned action executed
    stall_rate: float
    reaction_latency_s: list[float]
    reaction_latency_median_s: float | None
    events_unreacted: int
    boundary_jerk: dict
    calls: int
    call_records: list[CallRecord]
    latency_s: dict               # stats of the simulated call durations
    wall_s: dict                  # stats of the wall time spent in the engine here
    max_obs_age_used_s: float
    concurrent_calls_max: int
    late_chunks: int              # arrived after the tick they were meant to start at
    chunks_ready_in_time: int     # (after the first) arrived before the plan ran out
    rejected_chunks: int          # refused by the controller, never executed (past its deadline, NaN, shape)
    commands: np.ndarray          # [total_ticks, A] executed commands
    states: np.ndarray            # [total_ticks + 1, S] robot states
    stalled: np.ndarray           # [total_ticks] bool
    safety: dict
    watchdog: dict
    scheduler: dict

    def as_dict(self) -> dict:
        """Figures for JSON (no trajectories)."""
        jerk = {k: v for k, v in self.boundary_jerk.items() if k != "per_boundary"}
        return {"mode": self.mode, "stitch": self.stitch, "predictor": self.predictor, "control_hz": self.control_hz,
                "ticks": self.ticks, "warmup_ticks": self.warmup_ticks, "stall_ticks": self.stall_ticks,
                "stall_rate": self.stall_rate, "reaction_latency_median_s": self.reaction_latency_median_s,
                "reaction_latency_s": self.reaction_latency_s, "events_unreacted": self.events_unreacted,
                "boundary_jerk": jerk, "calls": self.calls, "latency_s": self.latency_s, "wall_s": self.wall_s,
                "max_obs_age_used_s": self.max_obs_age_used_s, "concurrent_calls_max": self.concurrent_calls_max,
                "late_chunks": self.late_chunks, "chunks_ready_in_time": self.chunks_ready_in_time,
                "rejected_chunks": self.rejected_chunks,
                "safety": self.safety, "watchdog": self.watchdog, "scheduler": self.scheduler}


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


class SyncController(StreamingController):
    """The sync baseline on the streaming controller's plan, watchdog and safety filter: call
    only when the executed part of the last chunk is used up, on the observed state, and merge
    the chunk's first ``n_execute`` actions from the tick it arrives (the robot stands still
    meanwhile). A synchronous robot waits for its chunk however long it takes, so there is no
    deadline on a chunk (the watchdog still holds an empty or stale plan)."""

    def __init__(self, cfg: ControllerConfig, limits: JointLimits, n_execute: int):
        super().__init__(dataclasses.replace(cfg, stitch=StitchConfig(mode="replace"), predictor="observed"), limits)
        self.n_execute = n_execute

    def maybe_request(self, now: int, observed_state: np.ndarray, obs_age_s: float) -> CallRequest | None:
        if self.in_flight is not None or self.plan.remaining(now) > 0:
            return None
        if obs_age_s > self.cfg.max_obs_age_s + 1e-9:
            self.scheduler.counters.skipped_stale_obs += 1
            return None
        return self._start(now, observed_state, starts_on_arrival=True)

    def _past_deadline(self, req: CallRequest, now: int) -> bool:
        return False

    def _merge(self, req: CallRequest, chunk: np.ndarray, now: int) -> None:
        self.stitcher.merge(self.plan, chunk[:self.n_execute], now, now)


@dataclass
class _InFlight:
    record: CallRecord
    chunk: np.ndarray


class _Caller:
    """Runs the policy (or the stand-in) for one observation and returns a robot-unit chunk."""

    def __init__(self, cfg: HarnessConfig, policy: object | None, chunk_fn: ChunkFn | None, state_dim: int):
        self.cfg, self.policy, self.chunk_fn = cfg, policy, chunk_fn
        self.renderer = None
        cams = list(getattr(policy, "camera_names", None) or ["top", "wrist"])
        self.cameras = cams
        if cfg.render:
            from .scenes import ObservationRenderer, SceneConfig

            size = policy.engine.cfg.vision.image_size if policy is not None else 224  # type: ignore[attr-defined]
            self.renderer = ObservationRenderer(SceneConfig(image_size=size, cameras=tuple(cams), task=cfg.task,
                                                            seed=cfg.seed), episode_seed=0)
            if self.renderer.cfg.state_dim != state_dim:
                raise ValueError(f"render=True draws a {self.renderer.cfg.state_dim}-joint arm; the state has {state_dim}")

    def observe(self, tick: int, state: np.ndarray, phase: int, time_s: float) -> SimObservation:
        if self.renderer is not None:
            images = self.renderer.render(state.astype(np.float32), episode_seed=phase, noise_seed=tick)
        else:
            images = _standin_images(self.cameras, state, phase)
        return SimObservation(tick=tick, time_s=time_s, state=state, images=images, task=self.cfg.task, phase=phase)

    def __call__(self, obs: SimObservation, prompt_state: np.ndarray, call_id: int) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        if self.chunk_fn is not None:
            chunk = np.asarray(self.chunk_fn(obs, prompt_state), dtype=np.float64)
        else:
            import torch

            from ..engine.policy import Observation

            out = self.policy.predict(  # type: ignore[union-attr]
                Observation(images=obs.images, state=prompt_state.astype(np.float32), task=obs.task),
                generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + call_id))
            chunk = np.asarray(out.actions, dtype=np.float64)
        wall = time.perf_counter() - t0
        if chunk.ndim != 2 or chunk.shape[0] < 1:
            raise ValueError(f"a chunk must be [C, A], got shape {chunk.shape}")
        return chunk, wall


def run_harness(cfg: HarnessConfig, policy: object | None = None, chunk_fn: ChunkFn | None = None,
                state_dim: int | None = None, action_dim: int | None = None,
                chunk_size: int | None = None) -> HarnessResult:
    """Simulate ``cfg.duration_s`` of control against ``policy`` (a ``Pi05Policy``) or the
    stand-in ``chunk_fn(obs, prompt_state) -> [C, A]``. With ``chunk_fn`` the dimensions
    default to a 7-joint arm (state = action = 7) and are otherwise read from the first chunk."""
    if (policy is None) == (chunk_fn is None):
        raise ValueError("give exactly one of policy or chunk_fn")
    if policy is not None:
        state_dim = policy.state_dim  # type: ignore[attr-defined]
        action_dim = policy.action_norm.dim  # type: ignore[attr-defined]
        chunk_size = policy.engine.cfg.chunk_size  # type: ignore[attr-defined]
    state_dim = 7 if state_dim is None else int(state_dim)
    if cfg.initial_state is not None:
        init = np.asarray(cfg.initial_state, dtype=np.float64)
        if init.shape != (state_dim,):
            raise ValueError(f"initial_state must have {state_dim} values, got {init.shape}")
    elif state_dim == 7:
        from .arm import PlanarArm

        init = np.append(np.asarray(PlanarArm(base=(0.5, 0.97)).home), 1.0)  # the scenes' arm at home, open
    else:
        init = np.zeros(state_dim)

    caller = _Caller(cfg, policy, chunk_fn, state_dim)
    dt, total = cfg.dt, cfg.total_ticks
    robot = Robot(init, dt, cfg.robot_tau_s)

    def phase_at(time_s: float) -> int:
        return sum(1 for e in cfg.event_times_s if e <= time_s + 1e-12)

    # Warm-up calls (not simulated): first-call overheads, and with measured latency a first
    # estimate, as a real deployment would do before enabling the robot.
    warm_lat: list[float] = []
    probe = None
    for k in range(max(cfg.warmup_calls, 0 if (action_dim and chunk_size) else 1)):
        obs0 = caller.observe(0, robot.state.copy(), 0, 0.0)
        probe, wall = caller(obs0, robot.state.copy(), call_id=-1 - k)
        warm_lat.append(wall)
    if probe is not None:
        chunk_size = chunk_size or probe.shape[0]
        action_dim = action_dim or probe.shape[1]
    assert chunk_size is not None and action_dim is not None
    if action_dim < state_dim:
        raise ValueError(f"actions ({action_dim}) must cover the state ({state_dim}): absolute joint positions")
    n_execute = cfg.n_execute if cfg.n_execute is not None else max(1, chunk_size // 2)
    if n_execute > chunk_size:
        raise ValueError(f"n_execute {n_execute} exceeds the chunk size {chunk_size}")

    initial_latency = cfg.initial_latency_s
    if initial_latency is None and cfg.latency != "measured":
        initial_latency = _latency_mean(cfg.latency)
    elif initial_latency is None:            # measured: the slowest warm-up call, as a deployment would
        initial_latency = float(max(warm_lat)) if warm_lat else 0.1
    ctrl_cfg = cfg.controller_config(chunk_size, action_dim, n_execute, initial_latency)
    lower = np.asarray(cfg.joint_lower if cfg.joint_lower is not None else [-math.pi] * action_dim, dtype=np.float64)
    upper = np.asarray(cfg.joint_upper if cfg.joint_upper is not None else [math.pi] * action_dim, dtype=np.float64)
    vmax = None if cfg.max_velocity is None else np.asarray(cfg.max_velocity, dtype=np.float64)
    limits = JointLimits(lower, upper, vmax)
    stream = cfg.mode == "stream"
    controller = StreamingController(ctrl_cfg, limits) if stream else SyncController(ctrl_cfg, limits, n_execute)
    init_cmd = np.zeros(action_dim)
    init_cmd[:state_dim] = init
    controller.set_initial(init_cmd)
    plan = controller.plan
    latency_src = LatencySource(cfg.latency, seed=cfg.seed)
    obs_delay_ticks = seconds_to_ticks(cfg.obs_delay_s, cfg.control_hz)

    records: list[CallRecord] = []
    in_flight: _InFlight | None = None
    pending_sources: list[tuple[int, int]] = []   # (influence tick, call id), in merge order
    source = -1                          # call the executed action came from (-1: none yet)
    first_exec: int | None = None
    commands = np.zeros((total, action_dim))
    stalled = np.zeros(total, dtype=bool)
    exec_source = np.full(total, -1, dtype=np.int64)
    concurrent_max = 0

    def collect(now: int) -> None:
        """Hand a call whose simulated completion has come to the controller; note where (and
        whether) its chunk first takes effect, for the reaction latency and the boundary jerk."""
        nonlocal in_flight
        if in_flight is None or in_flight.record.arrival_tick > now:
            return
        rec, chunk = in_flight.record, in_flight.chunk
        in_flight = None
        rec.plan_remaining_at_arrival = plan.remaining(now)
        first = max(rec.start_tick, now, (plan.last_popped_tick + 1) if plan.last_popped_tick is not None else now)
        freeze = cfg.stitch.freeze_steps or 0
        if stream and cfg.stitch.mode == "freeze" and freeze:
            _, present = plan.read(first, first + freeze)
            first += int(np.argmin(present)) if not present.all() else len(present)
        if controller.on_chunk(rec.call_id, chunk, now, rec.latency_s) and first <= rec.start_tick + len(chunk) - 1:
            rec.influence_tick = first
            pending_sources.append((first, rec.call_id))

    def maybe_start(now: int) -> None:
        nonlocal in_flight
        obs_tick = now - obs_delay_ticks   # before tick 0 the robot stood at its initial state
        observed = robot.state_at(obs_tick)
        req = controller.maybe_request(now, observed, obs_delay_ticks * dt)
        if req is None:
            return
        obs = caller.observe(obs_tick, observed, phase_at(obs_tick * dt), obs_tick * dt)
        chunk, wall = caller(obs, req.state, req.request_seq)
        if chunk.shape[1] != action_dim:
            raise ValueError(f"chunk has {chunk.shape[1]} action values, expected {action_dim}")
        latency = latency_src.duration(wall)
        arrival = now + seconds_to_ticks(latency, cfg.control_hz)
        start_tick = req.start_tick if stream else arrival   # sync executes action 0 when it arrives
        rec = CallRecord(req.request_seq, now, obs_tick, start_tick, arrival, latency, wall)
        records.append(rec)
        in_flight = _InFlight(rec, chunk)

    for now in range(total):
        collect(now)
        maybe_start(now)
        collect(now)  # a zero-latency call is available at once
        concurrent_max = max(concurrent_max, 0 if in_flight is None else 1)
        command = controller.tick(now)
        while pending_sources and pending_sources[0][0] <= now:
            source = pending_sources.pop(0)[1]
        executed = command.status != "held"
        if executed:
            first_exec = now if first_exec is None else first_exec
            exec_source[now] = source
        stalled[now] = not executed
        commands[now] = command.action
        robot.step(command.action)

    warmup = total if first_exec is None else first_exec
    measured = stalled[warmup:]
    stall_ticks = int(measured.sum())

    # Reaction latency: event -> first executed action from a call that observed after it.
    obs_time = {r.call_id: r.obs_tick * dt for r in records}
    reactions: list[float] = []
    unreacted = 0
    for e in cfg.event_times_s:
        hit = next((t for t in range(total) if exec_source[t] >= 0 and obs_time[int(exec_source[t])] >= e - 1e-12),
                   None)
        if hit is None:
            unreacted += 1
        else:
            reactions.append(hit * dt - e)

    merged = [r for r in records if r.influence_tick is not None]
    boundaries = [r.influence_tick for r in merged[1:] if r.influence_tick < total]  # type: ignore[misc]
    jerk = boundary_jerk(commands, dt, boundaries) if total >= 4 else {}
    ready = sum(1 for r in merged[1:] if (r.plan_remaining_at_arrival or 0) > 0)
    done = [r for r in records if r.arrival_tick < total]
    wd = controller.watchdog
    return HarnessResult(
        mode=cfg.mode, stitch=cfg.stitch.mode if stream else "none", predictor=cfg.predictor if stream else "observed",
        control_hz=cfg.control_hz, total_ticks=total, warmup_ticks=warmup, ticks=len(measured),
        stall_ticks=stall_ticks, stall_rate=stall_ticks / len(measured) if len(measured) else 1.0,
        reaction_latency_s=reactions, reaction_latency_median_s=statistics.median(reactions) if reactions else None,
        events_unreacted=unreacted, boundary_jerk=jerk, calls=len(records), call_records=records,
        latency_s=summarize([r.latency_s for r in done]), wall_s=summarize([r.wall_s for r in records]),
        max_obs_age_used_s=max(((r.call_tick - r.obs_tick) * dt for r in records), default=0.0),
        concurrent_calls_max=concurrent_max, late_chunks=sum(1 for r in done if r.arrival_tick > r.start_tick),
        chunks_ready_in_time=ready, rejected_chunks=controller.rejected, commands=commands, states=np.stack(robot.history), stalled=stalled,
        safety=dict(controller.safety.counts),
        watchdog={"deadline_ticks": wd.deadline_ticks, "held_ticks": wd.held_ticks,
                  "stale_events": wd.stale_events, "max_age_ticks": wd.max_age_ticks},
        scheduler=dict(controller.scheduler.counters.__dict__))
