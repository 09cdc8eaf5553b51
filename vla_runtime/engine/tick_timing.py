"""How regular the control tick is: a bounded record of tick start times and its statistics.

Why: the robot is commanded once per control period; a tick that starts late moves every
command after it, and a tick that never runs is a command the robot never gets. The policy node
records the monotonic time at which each tick callback starts (where the tick happens, not
when a subscriber receives something), reports the figures in its diagnostics and publishes the
raw start times for benchmarks (``bench/control_tick.py``).

Rule for a missed tick: consecutive starts more than ``MISSED_FACTOR`` periods apart mean the
ticks due in between did not run; a gap of ``g`` periods counts ``max(1, round(g) - 1)`` of them
(1.6 periods: one tick missed; 3 periods: two). A gap up to 1.5 periods is a late tick, not a
missed one (the timer keeps its schedule, so the next gap is short again).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

MISSED_FACTOR = 1.5


@dataclass(frozen=True)
class TickStats:
    """Figures of a run of ticks. Periods are the gaps between consecutive tick starts (ms)."""

    ticks: int               # tick starts seen
    period_ms: float         # the nominal period
    p50_ms: float
    p99_ms: float
    max_ms: float
    missed: int              # ticks that did not run (the rule in the module docstring)
    late: int                # gaps over period + late_ms that are not missed ticks
    late_ms: float           # the tolerance ``late`` counts against

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def missed_in_gap(gap_s: float, period_s: float) -> int:
    """Ticks that did not run between two starts ``gap_s`` apart (0 up to ``MISSED_FACTOR`` periods)."""
    g = gap_s / period_s
    return max(1, round(g) - 1) if g > MISSED_FACTOR else 0


def tick_statistics(starts_ns: Sequence[int] | np.ndarray, period_s: float, late_ms: float = 5.0) -> TickStats:
    """Statistics of the tick start times ``starts_ns`` (monotonic ns, in order) against the
    nominal ``period_s``. With fewer than two starts there is no gap: the figures are NaN."""
    if not (math.isfinite(period_s) and period_s > 0):
        raise ValueError(f"period_s must be a positive number, got {period_s!r}")
    t = np.asarray(starts_ns, dtype=np.int64)
    if t.ndim != 1:
        raise ValueError(f"starts_ns must be one-dimensional, got shape {t.shape}")
    gaps = np.diff(t) * 1e-9
    if np.any(gaps < 0):
        raise ValueError("starts_ns must be in increasing order (monotonic clock)")
    if gaps.size == 0:
        nan = float("nan")
        return TickStats(int(t.size), period_s * 1e3, nan, nan, nan, 0, 0, late_ms)
    missed_each = np.array([missed_in_gap(float(g), period_s) for g in gaps])
    late = int(np.sum((gaps > period_s + late_ms * 1e-3) & (missed_each == 0)))
    p50, p99 = np.percentile(gaps * 1e3, [50, 99])
    return TickStats(int(t.size), period_s * 1e3, float(p50), float(p99), float(gaps.max() * 1e3),
                     int(missed_each.sum()), late, late_ms)


def long_gaps(starts_ns: Sequence[int] | np.ndarray, period_s: float) -> list[tuple[int, float]]:
    """The gaps that count as missed ticks (over ``MISSED_FACTOR`` periods), each as (start of the
    tick after it, monotonic ns; gap ms): where they fall, to line them up with other traces."""
    t = np.asarray(starts_ns, dtype=np.int64)
    return [(int(s), float(g) * 1e-6) for s, g in zip(t[1:], np.diff(t))
            if missed_in_gap(float(g) * 1e-9, period_s)]


class TickRecord:
    """The start times of the last ``capacity`` ticks (bounded: a node runs for days), plus the
    ones not yet handed out by ``drain`` (for a trace topic; bounded the same way). The tick
    adds from one executor thread while the diagnostics read from another: a lock keeps each
    read whole."""

    def __init__(self, capacity: int, period_s: float) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2 ticks, got {capacity}")
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"period_s must be a positive number, got {period_s!r}")
        self.period_s = period_s
        self._lock = threading.Lock()
        self._recent: deque[int] = deque(maxlen=capacity)
        self._pending: deque[int] = deque(maxlen=capacity)
        self.total = 0
        self.missed = 0    # since the start, by the module's rule

    def add(self, start_ns: int) -> None:
        with self._lock:
            if self._recent:
                self.missed += missed_in_gap((start_ns - self._recent[-1]) * 1e-9, self.period_s)
            self._recent.append(start_ns)
            self._pending.append(start_ns)
            self.total += 1

    def statistics(self) -> TickStats:
        """``tick_statistics`` of the recorded window."""
        return tick_statistics(self.recent(), self.period_s)

    def recent(self) -> list[int]:
        with self._lock:
            return list(self._recent)

    def drain(self) -> list[int]:
        """The starts added since the last drain (at most ``capacity`` of them), oldest first."""
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out
