"""When to start the next policy call: adaptive overlap of inference with execution.

A synchronous controller executes part of a chunk, then observes and waits for the next one,
so every call costs the robot a full inference latency of standing still. Streaming instead
starts the next call while the current plan is still executing, early enough that its chunk
is ready when the plan (or its execution horizon) runs out. "Early enough" is the expected
latency, which drifts with load, thermal state and what else the accelerator is doing, so it
is estimated from the latencies actually measured: a high quantile over a rolling window (a
mean would be late half of the time; the maximum would let one hiccup stretch every overlap).

Invariants the scheduler enforces, whatever the caller asks:

* at most one call in flight (a second one would only compete for the same accelerator and
  make both late);
* never a call on an observation older than ``max_obs_age_s`` (acting on a stale view of the
  world is worse than waiting for a fresh frame);
* at least ``min_execute_ticks`` ticks between a chunk's arrival and the next call, so every
  chunk gets to act before it is superseded.

The scheduler keeps time in controller ticks and holds no clock of its own, so it runs the
same against wall time on a robot and against simulated time in tests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

_EPS = 1e-9  # 0.04 s * 50 Hz is 2.0000000000000004 in floating point; that is 2 ticks


def seconds_to_ticks(seconds: float, control_hz: float) -> int:
    """Whole ticks needed to cover ``seconds`` (ceil, robust to float noise)."""
    return max(0, math.ceil(seconds * control_hz - _EPS))


@dataclass(frozen=True)
class SchedulerConfig:
    control_hz: float
    chunk_size: int
    max_obs_age_s: float = 0.2
    margin_ticks: int = 1
    latency_quantile: float = 0.9
    latency_window: int = 20
    initial_latency_s: float = 0.1
    min_execute_ticks: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.control_hz, (int, float)) and math.isfinite(self.control_hz) and self.control_hz > 0):
            raise ValueError(f"control_hz must be a positive number, got {self.control_hz!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if not self.max_obs_age_s >= 0:
            raise ValueError(f"max_obs_age_s must be >= 0, got {self.max_obs_age_s!r}")
        if not isinstance(self.margin_ticks, int) or self.margin_ticks < 0:
            raise ValueError(f"margin_ticks must be an int >= 0, got {self.margin_ticks!r}")
        if not 0.0 < self.latency_quantile <= 1.0:
            raise ValueError(f"latency_quantile must be in (0, 1], got {self.latency_quantile!r}")
        if not isinstance(self.latency_window, int) or self.latency_window < 1:
            raise ValueError(f"latency_window must be an int >= 1, got {self.latency_window!r}")
        if not (math.isfinite(self.initial_latency_s) and self.initial_latency_s >= 0):
            raise ValueError(f"initial_latency_s must be finite and >= 0, got {self.initial_latency_s!r}")
        if not isinstance(self.min_execute_ticks, int) or self.min_execute_ticks < 0:
            raise ValueError(f"min_execute_ticks must be an int >= 0, got {self.min_execute_ticks!r}")

    @property
    def dt(self) -> float:
        return 1.0 / self.control_hz


@dataclass
class SchedulerCounters:
    started: int = 0
    finished: int = 0
    skipped_stale_obs: int = 0     # a call was due but the observation was too old
    blocked_in_flight: int = 0     # ticks a call was due but another one was still running
    late: int = 0                  # chunks that arrived after the tick they were meant to start at


@dataclass
class StreamingScheduler:
    """Adaptive overlap (Reflex): start the next call ``expected latency + margin`` ticks
    before the current plan runs out, so the next chunk is ready when the current one ends;
    never two calls in flight; never with an observation older than ``max_obs_age_s``.

    ``plan_remaining`` is whatever the caller wants covered: the actions left in the plan, or
    the ticks left of the current chunk's execution horizon when chunks are deliberately
    replaced before they run out.
    """

    cfg: SchedulerConfig
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)

    def __post_init__(self) -> None:
        if not isinstance(self.cfg, SchedulerConfig):
            raise ValueError(f"cfg must be a SchedulerConfig, got {type(self.cfg).__name__}")
        self._latencies: deque[float] = deque(maxlen=self.cfg.latency_window)
        self._in_flight_since: int | None = None
        self._pending_start_tick: int | None = None
        self._last_finished: int | None = None

    # -- queries ----------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        return self._in_flight_since is not None

    def expected_latency_s(self) -> float:
        """The configured quantile of the recent latencies (``initial_latency_s`` before any)."""
        if not self._latencies:
            return self.cfg.initial_latency_s
        return float(np.quantile(np.asarray(self._latencies), self.cfg.latency_quantile, method="higher"))

    def expected_latency_ticks(self) -> int:
        return seconds_to_ticks(self.expected_latency_s(), self.cfg.control_hz)

    def lead_ticks(self) -> int:
        """How many ticks before the plan runs out the next call is started."""
        return self.expected_latency_ticks() + self.cfg.margin_ticks

    def start_tick(self, now: int) -> int:
        """The tick the new chunk's action 0 will execute at: ``now`` + expected latency."""
        return int(now) + self.expected_latency_ticks()

    def should_start(self, now: int, plan_remaining: int, in_flight: bool, obs_age_s: float) -> bool:
        """Whether to start a call at tick ``now``. ``in_flight`` is the caller's view; the
        scheduler's own (a call started and not yet finished) is honoured as well."""
        if plan_remaining < 0:
            raise ValueError(f"plan_remaining must be >= 0, got {plan_remaining}")
        if not math.isfinite(obs_age_s) or obs_age_s < 0:
            raise ValueError(f"obs_age_s must be finite and >= 0, got {obs_age_s!r}")
        if plan_remaining > self.lead_ticks():
            return False
        if in_flight or self.in_flight:
            self.counters.blocked_in_flight += 1
            return False
        if self._last_finished is not None and now - self._last_finished < self.cfg.min_execute_ticks:
            return False
        if obs_age_s > self.cfg.max_obs_age_s + _EPS:
            self.counters.skipped_stale_obs += 1
            return False
        return True

    # -- events -----------------------------------------------------------------------------

    def on_started(self, now: int, start_tick: int | None = None, *, starts_on_arrival: bool = False) -> None:
        """A call began at ``now`` (its chunk is meant to start at ``start_tick``, by default the
        expected latency ahead). ``starts_on_arrival``: a synchronous caller's chunk starts
        whenever it arrives, so it is never late."""
        if self.in_flight:
            raise RuntimeError(f"a call started at tick {self._in_flight_since} is still in flight")
        self._in_flight_since = int(now)
        self._pending_start_tick = None if starts_on_arrival else \
            self.start_tick(now) if start_tick is None else int(start_tick)
        self.counters.started += 1

    def on_finished(self, now: int, latency_s: float) -> None:
        """The call in flight returned at ``now`` after ``latency_s`` (feeds the estimate)."""
        if not self.in_flight:
            raise RuntimeError("on_finished without a call in flight")
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {latency_s!r}")
        if self._pending_start_tick is not None and now > self._pending_start_tick:
            self.counters.late += 1
        self._latencies.append(float(latency_s))
        self._in_flight_since = None
        self._pending_start_tick = None
        self._last_finished = int(now)
        self.counters.finished += 1
