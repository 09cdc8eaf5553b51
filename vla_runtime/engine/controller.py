"""The policy side's per-tick decisions, in one place: execute, call, merge.

A ``StreamingController`` owns the plan (stitcher), the scheduler, the future-state predictor,
the watchdog and the safety filter. The policy node drives it from its control timer and its
"chunk ready" callback, and the simulated control loop (``sim/control_loop.py``) from its
simulated ticks; it holds no clock and no I/O, so tests drive it tick by tick.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .predictor import make_predictor
from .safety import JointLimits, SafeCommand, SafetyFilter, Watchdog
from .scheduler import SchedulerConfig, StreamingScheduler, seconds_to_ticks
from .stitching import ActionPlan, StitchConfig


@dataclass(frozen=True)
class CallRequest:
    """Ask the vision side for a prefix: condition on ``state``; the chunk starts at ``start_tick``."""

    request_seq: int
    now: int
    start_tick: int
    state: np.ndarray


@dataclass(frozen=True)
class ControllerConfig:
    control_hz: float
    chunk_size: int
    action_dim: int
    stitch: StitchConfig = StitchConfig()
    predictor: str = "absolute"
    max_obs_age_s: float = 0.2
    watchdog_s: float = 1.0
    on_stale: str = "hold"
    stream_horizon: int = 1
    initial_latency_s: float = 0.5
    margin_ticks: int = 1
    latency_quantile: float = 0.9
    latency_window: int = 20

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's share (validated there)."""
        return SchedulerConfig(control_hz=self.control_hz, chunk_size=self.chunk_size,
                               max_obs_age_s=self.max_obs_age_s, margin_ticks=self.margin_ticks,
                               latency_quantile=self.latency_quantile, latency_window=self.latency_window,
                               initial_latency_s=self.initial_latency_s)

    def plan_capacity(self) -> int:
        """Ticks the plan must hold: a chunk merged up to a deadline (or expected latency) ahead of
        the tick being executed, plus the chunk before it, with room to spare."""
        ahead = max(self.chunk_size, seconds_to_ticks(self.initial_latency_s, self.control_hz),
                    seconds_to_ticks(self.watchdog_s, self.control_hz))
        return 2 * self.chunk_size + 4 * ahead + 64


class StreamingController:
    def __init__(self, cfg: ControllerConfig, limits: JointLimits):
        self.cfg = cfg
        dt = 1.0 / cfg.control_hz
        self.plan = ActionPlan(cfg.action_dim, capacity=cfg.plan_capacity())
        self.stitcher = cfg.stitch.build()
        self.predictor = make_predictor(cfg.predictor)
        self.scheduler = StreamingScheduler(cfg.scheduler_config())
        self.watchdog = Watchdog(cfg.watchdog_s, dt, cfg.on_stale)
        self.safety = SafetyFilter(limits, dt)
        self.in_flight: CallRequest | None = None
        self.horizon_end = 0
        self._seq = 0
        self.rejected = 0            # chunks of the call in flight refused (NaN/Inf, shape, too late)
        self.last_rejection = ""

    def set_initial(self, state: np.ndarray) -> None:
        self.safety.set_initial(np.asarray(state, dtype=np.float64))

    def tick(self, now: int) -> SafeCommand:
        """The command for tick ``now`` (held when nothing fresh is planned)."""
        action = self.plan.pop(now)
        if not self.watchdog.check(now):
            action = None
        return self.safety.filter(action, now)

    def maybe_request(self, now: int, observed_state: np.ndarray, obs_age_s: float) -> CallRequest | None:
        remaining = max(0, min(self.plan.remaining(now), self.horizon_end - now))
        if not self.scheduler.should_start(now, remaining, self.in_flight is not None, obs_age_s):
            return None
        return self._start(now, observed_state)

    def _start(self, now: int, observed_state: np.ndarray, starts_on_arrival: bool = False) -> CallRequest:
        start = self.scheduler.start_tick(now)
        state = self.predictor.predict(np.asarray(observed_state, dtype=np.float64), self.plan, now, start)
        req = CallRequest(self._seq, now, start, np.asarray(state, dtype=np.float64))
        self._seq += 1
        self.scheduler.on_started(now, start, starts_on_arrival=starts_on_arrival)
        self.in_flight = req
        return req

    def on_chunk(self, request_seq: int, chunk: np.ndarray, now: int, latency_s: float) -> bool:
        """Merge the chunk of the call in flight; False, and nothing merged, for an unknown call.

        A chunk of the call in flight that must not be executed is refused too (False, the call
        is over, the plan unchanged, ``rejected`` counts it and ``last_rejection`` says why): one
        with NaN/Inf or of the wrong shape, and one that arrives later than the watchdog
        deadline after its call started (a stalled engine's plan was made for a world that has
        moved on: executing what is left of it would be executing stale actions).
        """
        req = self.in_flight
        if req is None or req.request_seq != request_seq:
            return False
        arr = np.asarray(chunk, dtype=np.float64)
        why = ""
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != self.cfg.action_dim:
            why = f"chunk of call {request_seq} has shape {arr.shape}, expected [C, {self.cfg.action_dim}]"
        elif not np.isfinite(arr).all():
            why = f"chunk of call {request_seq} contains NaN/Inf"
        elif self._past_deadline(req, now):
            why = (f"chunk of call {request_seq} arrived {(now - req.now) / self.cfg.control_hz:.3f} s after its call "
                   f"started, past the {self.cfg.watchdog_s} s deadline: not executed")
        self.in_flight = None
        self.scheduler.on_finished(now, latency_s if np.isfinite(latency_s) and latency_s >= 0
                                   else self.scheduler.expected_latency_s())
        if why:
            self.rejected += 1
            self.last_rejection = why
            return False
        self._merge(req, arr, now)
        self.watchdog.on_chunk(now)
        return True

    def _past_deadline(self, req: CallRequest, now: int) -> bool:
        return (now - req.now) / self.cfg.control_hz > self.cfg.watchdog_s

    def _merge(self, req: CallRequest, chunk: np.ndarray, now: int) -> None:
        self.stitcher.merge(self.plan, chunk, req.start_tick, now, freeze=self.cfg.stitch.freeze_steps or 0)
        self.horizon_end = req.start_tick + self.cfg.stream_horizon

    def abandon(self, now: int) -> None:
        """The call in flight will never return (vision restarted, slot overwritten): forget it."""
        if self.in_flight is not None:
            self.in_flight = None
            self.scheduler.on_finished(now, self.scheduler.expected_latency_s())

    def upcoming(self, now: int) -> tuple[int, np.ndarray]:
        """(first tick, actions) planned from ``now`` on, contiguous (what a trajectory message
        carries), clamped to the joint limits like every command."""
        n = self.plan.remaining(now)
        rows = [self.plan.action_at(now + i) for i in range(n)]
        return now, (self.within_limits(np.stack(rows)) if rows else np.zeros((0, self.cfg.action_dim)))

    def within_limits(self, actions: np.ndarray) -> np.ndarray:
        """``actions`` [..., action_dim] clamped to the joint limits (what may be published)."""
        return self.safety.limits.clamp(actions)
