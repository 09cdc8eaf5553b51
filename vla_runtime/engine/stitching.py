"""Stitching action chunks into one executable plan, indexed by absolute control tick.

A flow-matching policy returns a chunk of C actions per call; the next call starts before the
current chunk runs out (DESIGN.md §8), so chunks overlap and the controller needs one action
per tick. How the overlap is resolved decides how smooth the robot's motion is at chunk
boundaries, and how much of a new chunk's reaction actually reaches the robot. This module
keeps the plan (:class:`ActionPlan`) and the resolution strategies (:class:`Stitcher`):

``replace``
    The newest chunk wins from the first usable tick on. Most reactive, jumps at boundaries.
``blend``
    Linear crossfade from the old plan to the new chunk over ``blend_steps`` ticks.
``ensemble``
    ACT-style temporal ensembling: every tick is the exponentially weighted average of all
    predictions made for it, oldest weighted most.
``freeze``
    Real-time-chunking style: the ticks that execute while inference runs are already
    committed to the robot, so they keep the old plan bit-exactly and the new chunk takes
    over after them (optionally crossfaded over ``post_freeze_blend`` ticks).

Time model shared by every mode
-------------------------------
Chunk action ``i`` is meant for tick ``start_tick + i``. ``now`` passed to ``merge`` is the
first tick that has *not* been executed yet (the next tick the controller will ``pop``).
The first *usable* tick of a merge is ``max(start_tick, now, last_popped_tick + 1)``: actions
for earlier ticks are stale (the chunk arrived late) or already executed, and are dropped.
A chunk whose every tick is stale is a no-op. After a merge the plan ends at the new chunk's
last action (the newest chunk is authoritative; nothing is ever extrapolated past it), except
that ``freeze`` never erases ticks it was told are committed. Merging also forgets the ticks
before ``now``: time only moves forward, which is what keeps the ring bounded.

A chunk containing NaN/Inf, of the wrong shape, or that would not fit the ring raises
``ValueError`` and leaves the plan exactly as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

STITCH_MODES = ("replace", "blend", "ensemble", "freeze")


def _as_tick(value: object, name: str) -> int:
    """Ticks are exact integers; a float tick almost always means a seconds/ticks mix-up."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer control tick, got {value!r}")
    return int(value)


def _as_count(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class ActionPlan:
    """Planned actions indexed by absolute control tick, in a preallocated ring (no growth).

    Slot ``tick % capacity`` holds the action for ``tick``; a tag array records which tick a
    slot belongs to, so a slot left over from an earlier lap is never mistaken for a planned
    one. The retained window is ``[floor, floor + capacity)`` where ``floor`` is the newest of
    the last popped tick and the last merge's ``now``; a merge that would need ticks beyond it
    is refused rather than silently overwriting planned actions. Pick ``capacity`` of at least
    two chunks plus the worst latency in ticks.

    Actions are stored and returned as float64 copies, so callers can never alias the ring.
    """

    def __init__(self, action_dim: int, capacity: int):
        if isinstance(action_dim, bool) or not isinstance(action_dim, (int, np.integer)) or action_dim < 1:
            raise ValueError(f"action_dim must be a positive integer, got {action_dim!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.action_dim = int(action_dim)
        self.capacity = int(capacity)
        self._actions = np.zeros((self.capacity, self.action_dim), dtype=np.float64)
        self._tags = np.zeros(self.capacity, dtype=np.int64)
        self._valid = np.zeros(self.capacity, dtype=bool)
        self._floor: int | None = None         # ticks below are forgotten
        self._last: int | None = None          # newest planned tick (an upper bound before pruning)
        self._last_popped: int | None = None   # ticks up to here were executed and are immutable
        self._last_popped_action: tuple[int, np.ndarray] | None = None

    # ---------------------------------------------------------------- reading
    def _present(self, ticks: np.ndarray) -> np.ndarray:
        slots = ticks % self.capacity
        ok = self._valid[slots] & (self._tags[slots] == ticks)
        if self._floor is not None:
            ok &= ticks >= self._floor
        return ok

    def action_at(self, tick: int) -> np.ndarray | None:
        """The action planned for ``tick`` (a copy), or None when nothing is planned there."""
        tick = _as_tick(tick, "tick")
        if not self._present(np.array([tick], dtype=np.int64))[0]:
            return None
        return self._actions[tick % self.capacity].copy()

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Actions for ticks ``[start, stop)`` and a mask of which are planned.

        Rows whose mask is False are zeros and carry no meaning; the mask is the contract.
        Useful for the future-state predictor, which needs the commanded action at a tick.
        """
        start, stop = _as_tick(start, "start"), _as_tick(stop, "stop")
        if stop < start:
            raise ValueError(f"read range [{start}, {stop}) is reversed")
        ticks = np.arange(start, stop, dtype=np.int64)
        mask = self._present(ticks)
        out = np.zeros((len(ticks), self.action_dim), dtype=np.float64)
        out[mask] = self._actions[ticks[mask] % self.capacity]
        return out, mask

    def last_planned_tick(self) -> int | None:
        """The newest tick with a planned action, or None when the plan is empty."""
        if self._last is None:
            return None
        lo = self._last - self.capacity + 1
        if self._floor is not None:
            lo = max(lo, self._floor)
        if lo > self._last:
            return None
        ticks = np.arange(lo, self._last + 1, dtype=np.int64)
        hit = np.flatnonzero(self._present(ticks))
        return None if len(hit) == 0 else int(ticks[hit[-1]])

    def remaining(self, now: int) -> int:
        """How many ticks from ``now`` on are planned without a gap (0 if ``now`` is not)."""
        now = _as_tick(now, "now")
        last = self.last_planned_tick()
        if last is None or last < now:
            return 0
        mask = self._present(np.arange(now, last + 1, dtype=np.int64))
        gaps = np.flatnonzero(~mask)
        return int(len(mask) if len(gaps) == 0 else gaps[0])

    @property
    def last_popped_tick(self) -> int | None:
        """The newest executed tick; merges never change it or anything before it."""
        return self._last_popped

    def executed(self) -> tuple[int, np.ndarray] | None:
        """``(tick, action)`` of the last pop that found a planned action, for diagnostics."""
        if self._last_popped_action is None:
            return None
        tick, action = self._last_popped_action
        return int(tick), action.copy()

    # ---------------------------------------------------------------- committing
    def pop(self, tick: int) -> np.ndarray | None:
        """The action to execute at ``tick``; commits it and forgets every earlier tick.

        Returns None when nothing is planned there (the safety filter then holds). Popping
        the same tick twice returns the same action; going back in time is an error because
        earlier ticks are already forgotten.
        """
        tick = _as_tick(tick, "tick")
        if self._last_popped is not None and tick < self._last_popped:
            raise ValueError(f"pop({tick}) goes back in time: tick {self._last_popped} was already popped")
        action = self.action_at(tick)
        self._last_popped = tick
        self._floor = tick if self._floor is None else max(self._floor, tick)
        if action is not None:
            self._last_popped_action = (tick, action.copy())
        return action

    def clear(self) -> None:
        """Drop every planned action (e.g. after an emergency stop); the commit point stays."""
        self._valid[:] = False
        self._last = None

    # ---------------------------------------------------------------- writing (stitchers only)
    def _first_usable(self, start_tick: int, now: int) -> int:
        u0 = max(start_tick, now)
        if self._last_popped is not None:
            u0 = max(u0, self._last_popped + 1)
        return u0

    def _new_floor(self, now: int) -> int:
        return now if self._floor is None else max(self._floor, now)

    def _check_fits(self, now: int, last_tick: int) -> None:
        floor = self._new_floor(now)
        if last_tick - floor + 1 > self.capacity:
            raise ValueError(
                f"merge needs ticks {floor}..{last_tick} ({last_tick - floor + 1} ticks) but the plan "
                f"holds {self.capacity}; raise ActionPlan capacity or pop executed ticks")

    def _write(self, now: int, first: int, values: np.ndarray) -> None:
        """Write ``values`` at ticks ``first..end`` and erase planned ticks after ``end``.

        Callers (the stitchers) have validated shape, finiteness and ticks beforehand, so
        the capacity check below is the only failure left and it comes before any change.
        """
        end = first + len(values) - 1
        self._check_fits(now, end)
        self._floor = self._new_floor(now)
        if self._last is not None and self._last > end:
            stale = np.arange(end + 1, self._last + 1, dtype=np.int64)
            stale = stale[self._present(stale)]
            self._valid[stale % self.capacity] = False
        ticks = np.arange(first, end + 1, dtype=np.int64)
        slots = ticks % self.capacity
        self._actions[slots] = values
        self._tags[slots] = ticks
        self._valid[slots] = True
        self._last = end


@runtime_checkable
class Stitcher(Protocol):
    """Merges a new chunk into a plan. Every mode accepts ``freeze=`` (only freeze uses it),
    so a control loop can call all of them the same way."""

    name: str

    def merge(self, plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int, *,
              freeze: int | None = None) -> None: ...


@dataclass(frozen=True)
class _Prepared:
    chunk: np.ndarray       # float64 [C, A], finite
    start_tick: int
    now: int
    first: int              # first usable tick
    offset: int             # chunk row of ``first``

    @property
    def usable(self) -> np.ndarray:
        return self.chunk[self.offset:]

    @property
    def end(self) -> int:
        return self.start_tick + len(self.chunk) - 1


def _prepare(plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int) -> _Prepared | None:
    """Validate a merge; None when the chunk is entirely stale (nothing to do)."""
    if not isinstance(plan, ActionPlan):
        raise ValueError(f"plan must be an ActionPlan, got {type(plan).__name__}")
    start_tick, now = _as_tick(start_tick, "start_tick"), _as_tick(now, "now")
    arr = np.asarray(chunk)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != plan.action_dim:
        raise ValueError(f"chunk must have shape [C >= 1, {plan.action_dim}], got {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
        raise ValueError(f"chunk must be real-valued, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=True)
    if not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"chunk contains NaN/Inf (first at action {bad[0]}, joint {bad[1]}); plan left unchanged")
    first = plan._first_usable(start_tick, now)
    end = start_tick + len(arr) - 1
    if first > end:
        return None
    return _Prepared(arr, start_tick, now, first, first - start_tick)


def _crossfade(old: np.ndarray, present: np.ndarray, new: np.ndarray, steps: int) -> np.ndarray:
    """Blend ``new`` in over its first ``steps`` rows: row i = (1-w) old + w new with
    w = (i+1)/(steps+1), so neither end is a pure copy and row ``steps`` is the new chunk.
    Rows where the old plan has nothing are the new chunk as is."""
    out = new.copy()
    n = min(steps, len(new))
    if n == 0:
        return out
    w = (np.arange(1, n + 1, dtype=np.float64) / (steps + 1))[:, None]
    mixed = (1.0 - w) * old[:n] + w * new[:n]
    out[:n] = np.where(present[:n, None], mixed, new[:n])
    return out


class ReplaceStitcher:
    """From the first usable tick on, the plan is the new chunk; earlier ticks stay."""

    name = "replace"

    def merge(self, plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int, *,
              freeze: int | None = None) -> None:
        p = _prepare(plan, chunk, start_tick, now)
        if p is not None:
            plan._write(p.now, p.first, p.usable)


class BlendStitcher:
    """Linear crossfade from the old plan to the new chunk over ``blend_steps`` usable ticks.

    Step i (0-based, counted from the first usable tick) executes
    ``(1 - w_i) * old + w_i * new`` with ``w_i = (i + 1) / (blend_steps + 1)``: the first
    blended tick already moves towards the new chunk (it is the reason we called the policy)
    and the tick after the window is the new chunk exactly. ``blend_steps = 0`` is replace.
    """

    name = "blend"

    def __init__(self, blend_steps: int = 8):
        self.blend_steps = _as_count(blend_steps, "blend_steps")

    def merge(self, plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int, *,
              freeze: int | None = None) -> None:
        p = _prepare(plan, chunk, start_tick, now)
        if p is None:
            return
        old, present = plan.read(p.first, p.end + 1)
        plan._write(p.now, p.first, _crossfade(old, present, p.usable, self.blend_steps))


class EnsembleStitcher:
    """ACT-style temporal ensembling with weights ``exp(-m * k)``, k = 0 for the oldest.

    ACT keeps every prediction for every tick and recomputes the average each step. Because
    the k-th prediction for a tick always gets weight ``exp(-m * k)`` whatever comes later,
    the average can be kept as running sums (weighted sum, weight sum, count) per tick, which
    is exactly ACT's result with memory ``O(capacity * action_dim)`` however many chunks
    overlap, in a ring that mirrors the plan's. Stale predictions (ticks before the first
    usable one) are not added, as in ACT with inference latency.

    A planned action with no ensemble record (the plan was seeded by someone else, or this
    stitcher was switched in) counts as one earlier prediction. The stitcher follows one
    plan; handing it a different plan object starts its records afresh.
    """

    name = "ensemble"

    def __init__(self, ensemble_decay: float = 0.01):
        m = float(ensemble_decay)
        if not math.isfinite(m) or m < 0:
            raise ValueError(f"ensemble_decay (ACT's m) must be finite and >= 0, got {ensemble_decay!r}")
        self.ensemble_decay = m
        self._plan: ActionPlan | None = None
        self._tags = np.zeros(0, dtype=np.int64)
        self._count = np.zeros(0, dtype=np.int64)
        self._wsum = np.zeros(0, dtype=np.float64)
        self._sum = np.zeros((0, 0), dtype=np.float64)

    def _bind(self, plan: ActionPlan) -> None:
        if self._plan is plan:
            return
        self._plan = plan
        self._tags = np.full(plan.capacity, np.iinfo(np.int64).min, dtype=np.int64)
        self._count = np.zeros(plan.capacity, dtype=np.int64)
        self._wsum = np.zeros(plan.capacity, dtype=np.float64)
        self._sum = np.zeros((plan.capacity, plan.action_dim), dtype=np.float64)

    def predictions_at(self, tick: int) -> int:
        """How many predictions the ensemble holds for ``tick`` (diagnostics, tests)."""
        if self._plan is None or self._plan.action_at(tick) is None:
            return 0
        slot = tick % self._plan.capacity
        return int(self._count[slot]) if self._tags[slot] == tick else 1

    def merge(self, plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int, *,
              freeze: int | None = None) -> None:
        p = _prepare(plan, chunk, start_tick, now)
        if p is None:
            return
        plan._check_fits(p.now, p.end)   # fail before touching the ensemble records
        self._bind(plan)
        ticks = np.arange(p.first, p.end + 1, dtype=np.int64)
        slots = ticks % plan.capacity
        old, present = plan.read(p.first, p.end + 1)
        known = present & (self._tags[slots] == ticks)
        count = np.where(known, self._count[slots], np.where(present, 1, 0))
        wsum = np.where(known, self._wsum[slots], np.where(present, 1.0, 0.0))
        total = np.where(known[:, None], self._sum[slots], np.where(present[:, None], old, 0.0))
        w = np.exp(-self.ensemble_decay * count.astype(np.float64))
        total = total + w[:, None] * p.usable
        wsum = wsum + w
        self._tags[slots], self._count[slots], self._wsum[slots], self._sum[slots] = ticks, count + 1, wsum, total
        plan._write(p.now, p.first, total / wsum[:, None])


class FreezeStitcher:
    """Real-time-chunking style: keep the committed prefix, hand over after it.

    The first ``freeze`` usable ticks execute while the next inference runs and have already
    been sent to the robot, so they keep the old plan's actions bit-exactly (carried into the
    new plan, never averaged); where the old plan has nothing there, the new chunk fills in
    rather than leaving a hole. After the frozen prefix the new chunk takes over, crossfaded
    over ``post_freeze_blend`` ticks with the same weights as :class:`BlendStitcher`.
    Committed ticks beyond the new chunk's end are kept too.

    ``freeze`` comes per merge (``merge(..., freeze=n)``) because the scheduler knows the
    expected latency in ticks; otherwise ``freeze_steps`` (constructor or attribute) is used.
    When both are None ("auto") the merge raises: silently freezing nothing would turn this
    mode into replace without anyone noticing.
    """

    name = "freeze"

    def __init__(self, freeze_steps: int | None = None, post_freeze_blend: int = 0):
        self.freeze_steps = None if freeze_steps is None else _as_count(freeze_steps, "freeze_steps")
        self.post_freeze_blend = _as_count(post_freeze_blend, "post_freeze_blend")

    def merge(self, plan: ActionPlan, chunk: np.ndarray, start_tick: int, now: int, *,
              freeze: int | None = None) -> None:
        n = self.freeze_steps if freeze is None else freeze
        if n is None:
            raise ValueError("freeze stitcher needs the number of frozen ticks: pass merge(..., freeze=n) "
                             "or set freeze_steps (None means the caller supplies it each merge)")
        n = _as_count(n, "freeze")
        p = _prepare(plan, chunk, start_tick, now)
        if p is None:
            return
        frozen_end = p.first + n - 1
        last = max(p.end, frozen_end)
        old, present = plan.read(p.first, last + 1)
        new = np.zeros_like(old)
        new[: len(p.usable)] = p.usable
        out = new.copy()
        nf = min(n, len(out))
        out[:nf] = np.where(present[:nf, None], old[:nf], new[:nf])
        if nf < len(p.usable):
            tail = slice(nf, len(p.usable))
            out[tail] = _crossfade(old[tail], present[tail], new[tail], self.post_freeze_blend)
        # committed ticks past the chunk's end: keep the planned prefix without gaps
        keep = len(p.usable)
        while keep < len(out) and present[keep]:
            keep += 1
        plan._write(p.now, p.first, out[:keep])


def make_stitcher(mode: str, **params: object) -> Stitcher:
    """Build a stitcher by name.

    Accepts any of :class:`StitchConfig`'s parameter names so a whole config can be passed;
    the ones a mode does not use are ignored. Unknown names are an error (typos).
    """
    known = {"blend_steps", "ensemble_decay", "freeze_steps", "post_freeze_blend"}
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"unknown stitcher parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    if mode == "replace":
        return ReplaceStitcher()
    if mode == "blend":
        return BlendStitcher(params.get("blend_steps", 8))  # type: ignore[arg-type]
    if mode == "ensemble":
        return EnsembleStitcher(params.get("ensemble_decay", 0.01))  # type: ignore[arg-type]
    if mode == "freeze":
        return FreezeStitcher(params.get("freeze_steps"), params.get("post_freeze_blend", 0))  # type: ignore[arg-type]
    raise ValueError(f"unknown stitching mode {mode!r}; expected one of {STITCH_MODES}")


@dataclass(frozen=True)
class StitchConfig:
    """How chunks are stitched at their boundaries (DESIGN.md §8)."""

    mode: str = "freeze"
    blend_steps: int = 8
    ensemble_decay: float = 0.01        # ACT's m
    freeze_steps: int | None = None     # None: the caller passes freeze=n each merge
    post_freeze_blend: int = 0

    def __post_init__(self) -> None:
        if self.mode not in STITCH_MODES:
            raise ValueError(f"stitch mode must be one of {STITCH_MODES}, got {self.mode!r}")
        _as_count(self.blend_steps, "blend_steps")
        if self.freeze_steps is not None:
            _as_count(self.freeze_steps, "freeze_steps")
        _as_count(self.post_freeze_blend, "post_freeze_blend")
        m = self.ensemble_decay
        if isinstance(m, bool) or not isinstance(m, (int, float, np.floating)) or not math.isfinite(m) or m < 0:
            raise ValueError(f"ensemble_decay must be a finite number >= 0, got {m!r}")

    def build(self) -> Stitcher:
        return make_stitcher(self.mode, blend_steps=self.blend_steps, ensemble_decay=self.ensemble_decay,
                             freeze_steps=self.freeze_steps, post_freeze_blend=self.post_freeze_blend)


def boundary_jerk(actions: np.ndarray, dt: float, boundaries: list[int], window: int = 2) -> dict:
    """RMS jerk near chunk boundaries and over the whole trajectory.

    Jerk is the third finite difference divided by ``dt**3``; difference ``j[t]`` spans ticks
    ``t..t+3``. A boundary ``b`` (first tick executed from a new chunk) is a step between
    ticks ``b-1`` and ``b``, which enters ``j[b-3..b-1]``; the boundary window adds ``window``
    differences on each side. Boundaries whose step lies outside the trajectory (``b < 1`` or
    ``b > T-1``) are skipped and counted, since a run often ends just after a merge.

    Returns ``rms_jerk`` (all differences, all joints), ``boundary_rms_jerk`` (the union of
    the windows; 0.0 when there are none), ``per_boundary`` (RMS per used boundary, in order),
    ``max_abs_jerk``, ``boundaries_used`` and ``boundaries_skipped``. Units: action units/s^3.
    """
    a = np.asarray(actions, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 4:
        raise ValueError(f"actions must have shape [T >= 4, A], got {tuple(a.shape)}")
    if not np.isfinite(a).all():
        raise ValueError("actions contain NaN/Inf; log held commands, not missing ones")
    dt = float(dt)
    if not math.isfinite(dt) or dt <= 0:
        raise ValueError(f"dt must be a positive number of seconds, got {dt!r}")
    window = _as_count(window, "window")
    jerk = np.diff(a, n=3, axis=0) / dt**3          # [T-3, A]
    sq = jerk**2
    in_window = np.zeros(len(jerk), dtype=bool)
    per: list[float] = []
    skipped = 0
    for b in boundaries:
        b = _as_tick(b, "boundary")
        if b < 1 or b > len(a) - 1:
            skipped += 1
            continue
        lo, hi = max(0, b - 3 - window), min(len(jerk) - 1, b - 1 + window)
        in_window[lo:hi + 1] = True
        per.append(float(np.sqrt(sq[lo:hi + 1].mean())))
    return {
        "rms_jerk": float(np.sqrt(sq.mean())),
        "boundary_rms_jerk": float(np.sqrt(sq[in_window].mean())) if in_window.any() else 0.0,
        "per_boundary": per,
        "max_abs_jerk": float(np.abs(jerk).max()),
        "boundaries_used": len(per),
        "boundaries_skipped": skipped,
    }
