"""Reference selection for one call: retrieval plus the episode state it needs (DESIGN §2, §7).

Why its own piece: selection must run in the process that needs the answer (the vision process,
between the vision tower and the prefill), never behind another process. It needs only the
prepared candidates' retrieval features and joint histories (a ``CandidateSource``), the robot's
recent states and the reference episodes' lengths; the cache manager, which rebuilds entries,
only needs to hear afterwards what was chosen (``Selection``) to slide its window.

The same class serves the in-process ``CacheManager`` (its own candidate matrix) and the vision
process (the window the cache manager publishes in shared memory, read in place).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .retrieval import CandidateSource, Match, RetrievalConfig, Retriever


@dataclass(frozen=True)
class Selection:
    """What one call chose, as the window planner needs it (the note the vision side sends on).

    ``match`` None means dense (``reason`` says why); ``candidates`` are the episode's top-T
    reference episodes the window follows; ``restart`` says the episode's retrieval started over
    (a stall), so the window must restart too.
    """

    request_seq: int
    task: str
    episode: int
    match: Match | None
    candidates: tuple[str, ...] = ()
    reason: str = ""
    restart: bool = False
    dense_for_episode: bool = False   # fallback or stall latched: nothing to prepare until the next episode


class ReferenceSelector:
    """Retrieval over a candidate source with the per-episode state it keeps.

    ``episode_lengths`` maps each task to its reference episodes' call counts (from the
    repository's index): they bound repeats of one reference (stall) and say which entries are a
    reference's last call (past-the-references fallback).
    """

    def __init__(self, cfg: RetrievalConfig, source: CandidateSource, episode_lengths: Mapping[str, Mapping[str, int]],
                 state_dim: int):
        self.cfg = cfg
        self.lengths = {t: dict(v) for t, v in episode_lengths.items()}
        self.state_dim = state_dim
        self.restarted = False
        self.retriever = Retriever(cfg, source, on_stall=self._on_stall)
        self.task: str | None = None
        # the states at the last L calls, oldest first: kept as the array retrieval reads, so
        # a call adds its state with two copies instead of stacking the history anew
        self._states = np.zeros((cfg.history_len, state_dim), dtype=np.float32)
        self.observed = 0   # states observed since the episode started
        self.last_match: Match | None = None

    def start_episode(self, task: str) -> None:
        """Fresh retrieval state and joint history for an episode of ``task``."""
        self.task = task
        lengths = self.lengths.get(task, {})
        self.retriever.start_episode(task, max(lengths.values(), default=1), lengths)
        self.observed = 0
        self.last_match = None
        self.restarted = False

    def observe_state(self, state: Tensor | np.ndarray) -> None:
        """The robot state at the coming call (joint-history rerank)."""
        # copied into the history: callers pass views of buffers they reuse, the history must not
        # follow them; numpy, not torch: these few values cost a microsecond per operation there, ten in torch
        if isinstance(state, Tensor):   # any dtype or device (numpy has no bfloat16)
            state = state.detach().to("cpu", torch.float32).numpy()
        state = np.asarray(state, dtype=np.float32).reshape(-1)
        if state.size != self.state_dim:
            raise ValueError(f"state has {state.size} values, the repository's {self.state_dim}")
        if self.observed:
            self._states[:-1] = self._states[1:]
            self._states[-1] = state
        else:   # the episode's first state fills the history, as recorded
            self._states[:] = state
        self.observed += 1

    def state_history(self) -> np.ndarray:
        """[L, D]: the states at the last L calls, the oldest repeated to fill (as recorded). The
        selector's own array: valid until the next ``observe_state``."""
        if not self.observed:
            raise RuntimeError("observe_state() must be called before each call")
        return self._states

    def select(self, features: Tensor) -> Match | None:
        """The reference for this call, or None (dense, ``reason`` says why)."""
        if self.task is None:
            raise RuntimeError("ReferenceSelector.select before start_episode")
        self.restarted = False
        self.last_match = self.retriever.query(features, self.state_history())
        return self.last_match

    @property
    def reason(self) -> str:
        return self.retriever.reason

    @property
    def dense_for_episode(self) -> bool:
        return self.retriever.fallback or self.retriever.stalled

    def candidate_episodes(self) -> list[str]:
        return self.retriever.candidate_episodes()

    def selection(self, request_seq: int, episode: int) -> Selection:
        """The last ``select`` as a note for the window planner."""
        return Selection(request_seq, self.task or "", episode, self.last_match, tuple(self.candidate_episodes()),
                         self.reason, self.restarted, self.dense_for_episode)

    def _on_stall(self, match: Match) -> None:
        """The same reference keeps coming back: the robot is not progressing. The episode's
        retrieval starts afresh (this call runs dense, with the stall as its reason)."""
        reason, task = self.retriever.reason, self.task
        if task is not None:
            self.start_episode(task)
            self.retriever.reason = reason
        self.restarted = True
