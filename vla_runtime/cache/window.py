"""The sliding working set of prepared references and its reconstruction budget (rMuscle §4.2).

Why a window: matches track episode progress (current call k of the live episode matches
roughly call k of a reference), so the next matches lie just ahead of the current ones. Keeping
expanded states only for T candidate episodes x (current + L next positions) bounds GPU memory
independently of the repository size, and sliding it forward means only the few newly entering
positions must be rebuilt during the robot's action execution.

This module only does the bookkeeping (which entries to keep, build, release, within a budget);
the caller rebuilds and frees the states and then ``commit``s the plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Entry = tuple[str, int]   # (episode_id, call index)


@dataclass(frozen=True)
class WindowConfig:
    """``episodes`` = T candidate episodes, ``lookahead`` = L positions after the current one."""

    episodes: int = 4
    lookahead: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.episodes, int) or self.episodes < 1:
            raise ValueError(f"WindowConfig.episodes must be a positive int, got {self.episodes!r}")
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"WindowConfig.lookahead must be a non-negative int, got {self.lookahead!r}")

    @property
    def capacity(self) -> int:
        """Entries in a full window: T x (L + 1)."""
        return self.episodes * (self.lookahead + 1)


def reconstruction_budget(n_candidates: int, mem_free_bytes: int, entry_bytes: int, time_available_s: float,
                          transfer_s: float, mean_reconstruct_s: float) -> int:
    """How many new entries to rebuild before the next call (rMuscle Eq. 5).

    ``min(n_candidates, floor(mem_free / entry_bytes), floor((t_available - t_transfer) / t_rec))``,
    never negative. An estimate from the *mean* rebuild time, not a per-entry deadline. The time
    ratio is floored with a 1e-9 tolerance so exact ratios such as 0.3 / 0.1 give 3, not 2.
    """
    if not isinstance(n_candidates, int) or n_candidates < 0:
        raise ValueError(f"n_candidates must be a non-negative int, got {n_candidates!r}")
    if not isinstance(mem_free_bytes, int) or mem_free_bytes < 0:
        raise ValueError(f"mem_free_bytes must be a non-negative int, got {mem_free_bytes!r}")
    if not isinstance(entry_bytes, int) or entry_bytes <= 0:
        raise ValueError(f"entry_bytes must be a positive int, got {entry_bytes!r}")
    for name, v in (("time_available_s", time_available_s), ("transfer_s", transfer_s)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    t_rec = mean_reconstruct_s
    if not isinstance(t_rec, (int, float)) or not (math.isfinite(t_rec) and t_rec > 0):
        raise ValueError(f"mean_reconstruct_s must be a positive finite number, got {mean_reconstruct_s!r}")
    by_memory = mem_free_bytes // entry_bytes
    by_time = math.floor((time_available_s - transfer_s) / mean_reconstruct_s + 1e-9)
    return max(0, min(n_candidates, by_memory, by_time))


@dataclass(frozen=True)
class WindowPlan:
    """One window step: ``add`` = rebuild these (nearest first), ``drop`` = release these.

    ``deferred`` lists wanted entries left out by the budget (they are retried next step).
    """

    keep: list[Entry]
    add: list[Entry]
    drop: list[Entry]
    deferred: list[Entry] = field(default_factory=list)


class SlidingWindow:
    """Which reference entries should be prepared, given the current matches.

    ``matches`` maps each candidate episode (at most T, in priority order) to its currently
    matched call index; the wanted entries are ``index .. index + L`` clipped to the episode.
    Episode lengths are needed for the clipping: pass them at construction or ``set_episode_lengths``.
    """

    def __init__(self, cfg: WindowConfig, episode_lengths: Mapping[str, int] | None = None):
        self.cfg = cfg
        self.lengths: dict[str, int] = {}
        self.prepared: set[Entry] = set()
        if episode_lengths is not None:
            self.set_episode_lengths(episode_lengths)

    def set_episode_lengths(self, lengths: Mapping[str, int]) -> None:
        for eid, n in lengths.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"episode {eid!r}: length must be a positive int, got {n!r}")
        self.lengths = dict(lengths)

    def reset(self) -> None:
        """Forget all prepared entries (the caller frees their states)."""
        self.prepared = set()

    def target(self, matches: Mapping[str, int]) -> list[Entry]:
        """Wanted entries, nearest first: every episode's current index, then +1, ... then +L."""
        if len(matches) > self.cfg.episodes:
            raise ValueError(f"{len(matches)} episodes given, the window holds {self.cfg.episodes}")
        spans = []
        for eid, index in matches.items():
            n = self._length(eid)
            if not isinstance(index, int) or not 0 <= index < n:
                raise ValueError(f"episode {eid!r}: index {index!r} outside its {n} calls")
            spans.append((eid, index, min(index + self.cfg.lookahead, n - 1)))
        return [(eid, i + off) for off in range(self.cfg.lookahead + 1) for eid, i, last in spans if i + off <= last]

    def initial_target(self, episodes: Sequence[str]) -> list[Entry]:
        """Wanted entries before call 0 of an episode, nearest first.

        The first L+1 positions of the first T ``episodes`` (pass them in priority order, e.g.
        the repository's or the previous episode's ranking; all of them when there are fewer).
        Call 0 must be able to choose among *all* the task's episodes, so position 0 of every
        further episode is wanted too (it is released once call 0 has picked the top T).
        """
        head = list(dict.fromkeys(episodes))
        first = self.target({eid: 0 for eid in head[: self.cfg.episodes]})
        return [(eid, 0) for eid in head] + [e for e in first if e[1] > 0]

    def plan(self, matches: Mapping[str, int], budget: int) -> WindowPlan:
        """Diff the wanted window against what is prepared, adding at most ``budget`` entries."""
        return self._plan(self.target(matches), budget)

    def initial_plan(self, episodes: Sequence[str], budget: int) -> WindowPlan:
        return self._plan(self.initial_target(episodes), budget)

    def missing(self, matches: Mapping[str, int]) -> list[Entry]:
        """Wanted entries not yet prepared, nearest first (``n_candidates`` for the budget)."""
        return [e for e in self.target(matches) if e not in self.prepared]

    def commit(self, plan: WindowPlan) -> None:
        """Record that ``plan.add`` was rebuilt and ``plan.drop`` released."""
        stale = [e for e in plan.drop if e not in self.prepared] + [e for e in plan.add if e in self.prepared]
        if stale:
            raise ValueError(f"plan does not match the prepared set (stale plan?): {stale[:4]}")
        self.prepared.difference_update(plan.drop)
        self.prepared.update(plan.add)

    def _plan(self, wanted: list[Entry], budget: int) -> WindowPlan:
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget must be a non-negative int, got {budget!r}")
        wanted_set = set(wanted)
        new = [e for e in wanted if e not in self.prepared]
        return WindowPlan(
            keep=[e for e in wanted if e in self.prepared],
            add=new[:budget],
            drop=sorted(self.prepared - wanted_set),
            deferred=new[budget:],
        )

    def _length(self, eid: str) -> int:
        try:
            return self.lengths[eid]
        except KeyError:
            raise ValueError(f"episode {eid!r}: length unknown (set_episode_lengths)") from None
