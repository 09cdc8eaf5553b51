"""The last line before the robot: joint limits, hold-on-failure, and plan freshness.

Nothing the policy, the stitcher or the scheduler does may put NaN, an out-of-limit joint or
an unbounded jump on the wire (DESIGN.md §8). :class:`SafetyFilter` enforces that on every
command, whatever it is given; :class:`Watchdog` decides whether the plan is fresh enough
to execute at all. A control loop uses them like this::

    action = plan.pop(tick)                     # always pop, so the plan's clock advances
    if not watchdog.check(tick):
        action = None                           # stale: hold
    command = safety.filter(action, tick)       # never NaN, never beyond a limit

Holding means repeating the last command that went out (or the initial state before any
did): for a position-controlled arm that is standing still, the one thing that is always
safe to do without fresh information. Nothing here ever extrapolates a trajectory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SAFE_STATUSES = ("ok", "clamped", "held", "rate_limited")
ON_STALE = ("hold", "finish_chunk")


def _vector(value: object, name: str) -> np.ndarray:
    arr = np.array(value, dtype=np.float64, copy=True)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {arr.shape}")
    return arr


def _positive_seconds(value: object, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return v


def _tick(value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"tick must be an integer control tick, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class JointLimits:
    """Per-joint position limits and an optional per-joint speed limit (units/s).

    Arrays are copied to read-only float64 so a limit cannot be changed behind the filter's
    back. A ``max_velocity`` entry may be ``inf`` (that joint is not rate limited, e.g. a
    gripper that is commanded open/closed); it may not be zero, negative or NaN.
    """

    lower: np.ndarray
    upper: np.ndarray
    max_velocity: np.ndarray | None = None

    def __post_init__(self) -> None:
        lower, upper = _vector(self.lower, "lower"), _vector(self.upper, "upper")
        if lower.shape != upper.shape:
            raise ValueError(f"lower {lower.shape} and upper {upper.shape} limits differ in shape")
        if not (np.isfinite(lower).all() and np.isfinite(upper).all()):
            raise ValueError("joint limits must be finite")
        if not (lower < upper).all():
            bad = np.flatnonzero(~(lower < upper)).tolist()
            raise ValueError(f"lower must be < upper for every joint; not so for joints {bad}")
        lower.setflags(write=False)
        upper.setflags(write=False)
        object.__setattr__(self, "lower", lower)
        object.__setattr__(self, "upper", upper)
        if self.max_velocity is not None:
            vmax = _vector(self.max_velocity, "max_velocity")
            if vmax.shape != lower.shape:
                raise ValueError(f"max_velocity {vmax.shape} does not match the limits' shape {lower.shape}")
            if np.isnan(vmax).any() or not (vmax > 0).all():
                raise ValueError("max_velocity must be > 0 for every joint (inf = not limited)")
            vmax.setflags(write=False)
            object.__setattr__(self, "max_velocity", vmax)

    @classmethod
    def from_lists(cls, lower: list[float], upper: list[float],
                   max_velocity: list[float] | None = None) -> "JointLimits":
        """From plain lists, as they come out of a YAML/JSON robot config."""
        return cls(np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64),
                   None if max_velocity is None else np.asarray(max_velocity, dtype=np.float64))

    @property
    def dim(self) -> int:
        return int(self.lower.shape[0])

    def clamp(self, actions: np.ndarray) -> np.ndarray:
        """``actions`` [..., dim] clamped into the position limits (what may be published)."""
        return np.clip(np.asarray(actions, dtype=np.float64), self.lower, self.upper)

    def contains(self, action: np.ndarray) -> bool:
        a = np.asarray(action, dtype=np.float64)
        return bool(a.shape == self.lower.shape and np.isfinite(a).all()
                    and (a >= self.lower).all() and (a <= self.upper).all())


@dataclass(frozen=True)
class SafeCommand:
    """What goes to the robot at one tick, and why it is what it is."""

    action: np.ndarray   # float64 [A], finite, within limits
    status: str          # one of SAFE_STATUSES
    reason: str          # empty when status is "ok"
    tick: int

    def __post_init__(self) -> None:
        if self.status not in SAFE_STATUSES:
            raise ValueError(f"status must be one of {SAFE_STATUSES}, got {self.status!r}")
        a = np.array(self.action, dtype=np.float64, copy=True)
        if a.ndim != 1 or not np.isfinite(a).all():
            raise ValueError("a SafeCommand's action must be a finite 1-D array")
        a.setflags(write=False)
        object.__setattr__(self, "action", a)


class SafetyFilter:
    """Last line before the robot: never NaN, never beyond a joint limit, optional speed limit.

    Per tick, in order: no action (None) or any non-finite joint -> hold the last safe command
    (status "held"); otherwise clamp to ``[lower, upper]`` ("clamped"); then, with
    ``max_velocity``, limit each joint's step from the last command to
    ``max_velocity * dt * ticks_elapsed`` ("rate_limited", which wins over "clamped"; the
    reason names both). Clamping before rate limiting keeps the result inside the limits,
    since it lies between two in-limit points.

    Before the first command the reference is the state given to :meth:`set_initial`
    (clamped into the limits, so even holding it never publishes an out-of-limit joint).
    A wrong-shaped action is a wiring bug, not a runtime event, and raises ``ValueError``.
    """

    def __init__(self, limits: JointLimits, dt: float):
        if not isinstance(limits, JointLimits):
            raise ValueError(f"limits must be a JointLimits, got {type(limits).__name__}")
        self.limits = limits
        self.dt = _positive_seconds(dt, "dt")
        self._last: np.ndarray | None = None
        self._last_tick: int | None = None
        self.counts: dict[str, int] = {s: 0 for s in SAFE_STATUSES}

    def set_initial(self, state: np.ndarray) -> None:
        """The robot's current joint positions: what is held until the first good command."""
        s = np.array(state, dtype=np.float64, copy=True)
        if s.shape != self.limits.lower.shape:
            raise ValueError(f"initial state has shape {s.shape}, the limits have {self.limits.lower.shape}")
        if not np.isfinite(s).all():
            raise ValueError("initial state contains NaN/Inf; cannot hold a non-finite position")
        self._last = np.clip(s, self.limits.lower, self.limits.upper)
        self._last_tick = None

    @property
    def last_command(self) -> np.ndarray | None:
        return None if self._last is None else self._last.copy()

    def _hold(self, tick: int, reason: str) -> "SafeCommand":
        assert self._last is not None
        self._last_tick = tick
        self.counts["held"] += 1
        return SafeCommand(self._last.copy(), "held", reason, tick)

    def filter(self, action: np.ndarray | None, tick: int) -> SafeCommand:
        """The command to send at ``tick`` (ticks must strictly increase between calls)."""
        tick = _tick(tick)
        if self._last is None:
            raise RuntimeError("SafetyFilter has no reference state: call set_initial(robot_state) "
                               "before the first filter() so there is something safe to hold")
        if self._last_tick is not None and tick <= self._last_tick:
            raise ValueError(f"tick {tick} does not come after the last filtered tick {self._last_tick}")
        if action is None:
            return self._hold(tick, "no planned action")
        a = np.array(action, dtype=np.float64, copy=True)
        if a.shape != self.limits.lower.shape:
            raise ValueError(f"action has shape {a.shape}, the joint limits have {self.limits.lower.shape}")
        if not np.isfinite(a).all():
            bad = np.flatnonzero(~np.isfinite(a)).tolist()
            return self._hold(tick, f"non-finite action in joints {bad}")
        reasons: list[str] = []
        status = "ok"
        clamped = np.clip(a, self.limits.lower, self.limits.upper)
        if not np.array_equal(clamped, a):
            joints = np.flatnonzero(clamped != a).tolist()
            reasons.append(f"clamped to joint limits in joints {joints}")
            status = "clamped"
        out = clamped
        if self.limits.max_velocity is not None:
            elapsed = 1 if self._last_tick is None else tick - self._last_tick
            max_step = self.limits.max_velocity * self.dt * elapsed
            step = np.clip(out - self._last, -max_step, max_step)
            limited = self._last + step
            # joints not limited this tick keep their exact target (no float round trip)
            limited = np.where(np.abs(out - self._last) > max_step, limited, out)
            if not np.array_equal(limited, out):
                joints = np.flatnonzero(limited != out).tolist()
                reasons.append(f"step limited to max_velocity in joints {joints}")
                status = "rate_limited"
                out = np.clip(limited, self.limits.lower, self.limits.upper)
        self._last = out
        self._last_tick = tick
        self.counts[status] += 1
        return SafeCommand(out.copy(), status, "; ".join(reasons), tick)


class Watchdog:
    """Freshness of the plan: no fresh chunk by the deadline -> stop executing it.

    A chunk is fresh while ``(tick - last_chunk_tick) * dt <= deadline_s``, i.e. for
    ``floor(deadline_s / dt)`` ticks after the tick it was merged at. Once it is older:

    ``on_stale="hold"``
        :meth:`check` returns False and the loop holds the last safe command: a stalled
        engine means the plan was made for a world that has moved on.
    ``on_stale="finish_chunk"``
        :meth:`check` keeps returning True, so what is already planned is executed; the plan
        ends at the last chunk's last action and the safety filter holds after it. Nothing is
        extrapolated in either mode.

    Before any chunk :meth:`check` is False in both modes. Counters are for diagnostics:
    ``stale_ticks`` (checks made while stale, including before the first chunk),
    ``held_ticks`` (checks that returned False), ``stale_events`` (fresh -> stale
    transitions), ``chunks`` and ``max_age_ticks``.
    """

    def __init__(self, deadline_s: float, dt: float, on_stale: str = "hold"):
        self.deadline_s = _positive_seconds(deadline_s, "deadline_s")
        self.dt = _positive_seconds(dt, "dt")
        if on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {ON_STALE}, got {on_stale!r}")
        self.on_stale = on_stale
        # tolerance so 0.1 s / 0.02 s is 5 ticks, not 4.999...
        self.deadline_ticks = int(math.floor(self.deadline_s / self.dt + 1e-9))
        self.last_chunk_tick: int | None = None
        self.stale_ticks = 0
        self.held_ticks = 0
        self.stale_events = 0
        self.chunks = 0
        self.max_age_ticks = 0
        self._was_stale = False

    def on_chunk(self, tick: int) -> None:
        """A fresh chunk was merged into the plan at ``tick``."""
        tick = _tick(tick)
        if self.last_chunk_tick is not None and tick < self.last_chunk_tick:
            raise ValueError(f"chunk tick {tick} is before the previous chunk's {self.last_chunk_tick}")
        self.last_chunk_tick = tick
        self.chunks += 1
        self._was_stale = False

    def age_ticks(self, tick: int) -> int | None:
        """Ticks since the newest chunk, or None before the first one."""
        tick = _tick(tick)
        if self.last_chunk_tick is None:
            return None
        if tick < self.last_chunk_tick:
            raise ValueError(f"tick {tick} is before the newest chunk's tick {self.last_chunk_tick}")
        return tick - self.last_chunk_tick

    def is_stale(self, tick: int) -> bool:
        age = self.age_ticks(tick)
        return age is None or age > self.deadline_ticks

    def check(self, tick: int) -> bool:
        """True when the plan may be executed at ``tick``; updates the counters."""
        age = self.age_ticks(tick)
        if age is not None:
            self.max_age_ticks = max(self.max_age_ticks, age)
        stale = age is None or age > self.deadline_ticks
        if stale:
            self.stale_ticks += 1
            if age is not None and not self._was_stale:
                self.stale_events += 1
            self._was_stale = age is not None
        ok = age is not None and (not stale or self.on_stale == "finish_chunk")
        if not ok:
            self.held_ticks += 1
        return ok
