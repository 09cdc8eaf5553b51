"""The cache manager: repository, retrieval and the sliding working set, around one model.

It decides; the cached engine computes. Per episode it selects the task pack, keeps a window of
prepared entries (reconstructed from the repository's compact inputs while the robot executes),
picks a reference for each call from the call's ViT features and joint history, and falls back
to dense when nothing similar is known (or the robot stalls).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..models.pi05 import Pi05Model
from .entry import EntryKey, PreparedEntry, reconstruct_entry
from .repository import ReferenceCall, ReferenceRepository, RepositoryError
from .retrieval import CandidateMatrix, Match, RetrievalConfig
from .selector import ReferenceSelector, Selection
from .window import SlidingWindow, WindowConfig, WindowPlan, reconstruction_budget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerConfig:
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    memory_budget_bytes: int = 4 << 30     # M_free: memory the prepared entries may take
    default_time_available_s: float = 1.0  # T_avl when the caller does not say (a chunk's execution time)
    # entries rebuilt earlier, kept (least recently used out first) so that a window entering them
    # again takes them instead of rebuilding: 0 keeps none
    reuse_budget_bytes: int = 1 << 30

    def __post_init__(self):
        for name in ("memory_budget_bytes", "reuse_budget_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")


@dataclass
class PrepareReport:
    added: int = 0
    dropped: int = 0
    deferred: int = 0
    budget: int = 0
    seconds: float = 0.0
    reused: int = 0      # of ``added``: taken from the rebuilt entries kept, not rebuilt


def stored_images_to_model(images: Tensor) -> Tensor:
    """uint8 [N, S, S, 3] as stored -> float [N, 3, S, S] in [-1, 1] (the model's input)."""
    return images.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


def model_images_to_stored(images: Tensor) -> Tensor:
    """float [N, 3, S, S] in [-1, 1] -> uint8 [N, S, S, 3] (compact, as the repository keeps them)."""
    return images.add(1.0).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class CacheManager:
    """Owns the prepared entries of one model; its ``select`` is the engine's ReferenceSelector."""

    def __init__(self, model: Pi05Model, repository: ReferenceRepository, cfg: ManagerConfig = ManagerConfig(),
                 entries: MutableMapping[EntryKey, Any] | None = None):
        """``entries`` is where prepared entries live: a dict in one process, or a store that writes
        them into shared memory for other processes (``nodes.working_set.SharedEntryStore``), whose
        values are then handles with ``nbytes()`` rather than tensors."""
        self.model = model
        self.repo = repository
        self.cfg = cfg
        layout = repository.call_layout or {}
        if "retrieval" not in layout or "state_history" not in layout:
            raise ValueError(f"repository {repository.root} holds no episodes yet")
        feat_dim = layout["retrieval"][0] * layout["retrieval"][1]
        hist_len, state_dim = layout["state_history"]
        if hist_len < cfg.retrieval.history_len:
            raise ValueError(f"repository histories cover {hist_len} calls, retrieval needs {cfg.retrieval.history_len}")
        capacity = cfg.window.capacity + max((len(repository.episodes(t)) for t in repository.tasks()), default=0)
        self.matrix = CandidateMatrix(capacity, feat_dim, hist_len, state_dim)
        lengths = {t: {r.episode_id: r.num_calls for r in repository.episodes(t)} for t in repository.tasks()}
        self.selector = ReferenceSelector(cfg.retrieval, self, lengths, state_dim)
        self.window = SlidingWindow(cfg.window)
        self.entries: MutableMapping[EntryKey, Any] = {} if entries is None else entries
        self.task: str | None = None
        self.last_selection: Selection | None = None
        self.stalls = 0
        # recent load / rebuild times per entry (the budget of Eq. 5 uses their means): bounded
        self._rebuild_s: deque[float] = deque(maxlen=256)
        self._load_s: deque[float] = deque(maxlen=256)
        # every entry rebuilt, least recently used first, within cfg.reuse_budget_bytes: an entry is
        # a function of its stored call and this model's weights, so one rebuilt before is exact
        self._rebuilt: OrderedDict[EntryKey, PreparedEntry] = OrderedDict()
        self._rebuilt_bytes = 0
        self.reused = 0       # entries taken from ``_rebuilt`` instead of rebuilt, since start

    @classmethod
    def open(cls, model: Pi05Model, root, checkpoint_hash: str, cfg: ManagerConfig = ManagerConfig(),
             expect_model: dict | None = None,
             entries: MutableMapping[EntryKey, Any] | None = None) -> "CacheManager | None":
        """The manager for a repository, or None (run dense) when the repository is refused.

        A damaged, mismatched or empty repository must never stop the robot: the reason is
        logged and the runtime carries on without the cache.
        """
        try:
            repo = ReferenceRepository.open(root, expect_checkpoint_hash=checkpoint_hash, expect_model=expect_model)
            return cls(model, repo, cfg, entries)
        except (RepositoryError, ValueError, OSError) as e:
            log.warning("muscle-memory cache disabled, running dense: %s", e)
            return None

    # ------------------------------------------------------------ CandidateSource
    def candidates(self, task: str) -> CandidateMatrix | None:
        """The prepared entries of the current episode's task (retrieval searches only these)."""
        return self.matrix if task == self.task and task in self.repo.tasks() else None

    # ------------------------------------------------------------ episodes
    def start_episode(self, task: str) -> PrepareReport:
        """New episode: task pack, fresh window; prepares the initial window (before the robot moves)."""
        self._clear()
        self.task = task
        self.selector.start_episode(task)
        records = self.repo.episodes(task)
        if not records:
            log.warning("no reference episodes for task %r: running dense", task)
            return PrepareReport()
        self.window.set_episode_lengths({r.episode_id: r.num_calls for r in records})
        plan = self.window.initial_plan([r.episode_id for r in records], budget=self.cfg.window.capacity + len(records))
        return self._apply(plan, budget=len(plan.add))

    # ------------------------------------------------------------ in-process selection
    def observe_state(self, state: Tensor) -> None:
        """The robot state at the coming call (joint-history rerank), for ``select``."""
        self.selector.observe_state(state)

    def select(self, features: Tensor, inputs=None) -> Any:
        """Reference for this call from its retrieval features (the engine's ReferenceSelector):
        selection in this process over the manager's own candidates, then ``follow``."""
        if self.task is None:
            return None
        match = self.selector.select(features)
        self.follow(self.selector.selection(-1, 0))
        if match is None:
            if self.selector.reason:
                log.debug("dense call: %s", self.selector.reason)
            return None
        return self.entries.get(match.key)

    @property
    def retriever(self):
        """The in-process selector's retriever (its statistics, reason, episode state)."""
        return self.selector.retriever

    @property
    def last_match(self) -> Match | None:
        return None if self.last_selection is None else self.last_selection.match

    # ------------------------------------------------------------ window upkeep
    def follow(self, selection: Selection) -> None:
        """Where the call that just ran was (chosen wherever selection runs): ``prepare`` slides the
        window after it. A stall restarts the episode's window (its retrieval restarted)."""
        if selection.restart and self.task is not None:
            log.warning("stall detected for task %r: %s; the episode's window restarts", self.task, selection.reason)
            self.stalls += 1
            self._restart_window()
        self.last_selection = selection

    def prepare(self, time_available_s: float | None = None,
                before_rebuild: Callable[[], object] | None = None) -> PrepareReport:
        """Slide the window after a call and rebuild newly entering entries within the budget (Eq. 5).

        Meant to run while the robot executes the chunk; ``time_available_s`` is that time.
        ``before_rebuild`` runs before each entry's dense prefill (a process beside the calls
        waits there for the gap between two: ``nodes.call_gate``).
        """
        sel = self.last_selection
        if sel is None or sel.match is None or sel.dense_for_episode or sel.task != self.task:
            return PrepareReport()
        m = sel.match
        matches = self._aligned_positions(m)
        missing = self.window.missing(matches)
        entry_bytes = self._entry_bytes()
        used = sum(e.nbytes() for e in self.entries.values())
        free = max(0, self.cfg.memory_budget_bytes - used)
        t_avl = self.cfg.default_time_available_s if time_available_s is None else time_available_s
        mean_load = sum(self._load_s) / len(self._load_s) if self._load_s else 0.0
        mean_rebuild = sum(self._rebuild_s) / len(self._rebuild_s) if self._rebuild_s else 1e-3
        dropped = set(self.window.prepared) - set(self.window.target(matches))
        free += entry_bytes * len(dropped)
        # entries kept from an earlier rebuild cost no time, only memory (still an estimate: the
        # window adds nearest first, kept or not)
        kept = sum(k in self._rebuilt for k in missing)
        rebuild = len(missing) - kept
        budget = min(free // entry_bytes, kept + reconstruction_budget(
            rebuild, free, entry_bytes, t_avl, mean_load * rebuild, mean_rebuild))
        return self._apply(self.window.plan(matches, budget), budget, before_rebuild)

    # ------------------------------------------------------------ internals
    def _restart_window(self) -> None:
        """The initial window of the current task again (its selection state is the selector's)."""
        task = self.task
        self._clear()
        self.task = task
        records = self.repo.episodes(task) if task is not None else []
        if records:
            plan = self.window.initial_plan([r.episode_id for r in records],
                                            budget=self.cfg.window.capacity + len(records))
            self._apply(plan, budget=len(plan.add))

    def _aligned_positions(self, m: Match) -> dict[str, int]:
        """Current position in every candidate episode: the match itself, and the same progress
        (fraction of the episode) in the others, which is where retrieval tends to go next."""
        lengths = self.window.lengths
        progress = m.index / max(lengths[m.episode_id] - 1, 1)
        eps = [e for e in self.last_selection.candidates if e in lengths] or [m.episode_id]
        out = {m.episode_id: m.index}
        for e in eps[: self.cfg.window.episodes]:
            if e not in out:
                out[e] = min(lengths[e] - 1, round(progress * (lengths[e] - 1)))
        while len(out) > self.cfg.window.episodes:
            out.pop(next(k for k in reversed(list(out)) if k != m.episode_id))
        return out

    def _entry_bytes(self) -> int:
        if self.entries:
            return next(iter(self.entries.values())).nbytes()
        cfg = self.model.cfg
        layout = self.repo.call_layout or {}
        n_cams = layout.get("images", [cfg.num_cameras])[0]
        el = next(self.model.parameters()).element_size()
        return 2 * (cfg.vlm.depth - 1) * n_cams * cfg.num_image_tokens * cfg.vlm.width * el

    def _apply(self, plan: WindowPlan, budget: int,
               before_rebuild: Callable[[], object] | None = None) -> PrepareReport:
        t0 = time.perf_counter()
        for key in plan.drop:
            self.entries.pop(key, None)
            if key in self.matrix:
                self.matrix.remove(key)
        # the kept entries this plan wants leave the pool first: rebuilding the others must not
        # push them out before their turn
        taken = {key: self._rebuilt.pop(key) for key in plan.add if key in self._rebuilt}
        self._rebuilt_bytes -= sum(e.nbytes() for e in taken.values())
        for key in plan.add:
            entry = taken.get(key)
            if entry is None:
                if before_rebuild is not None:
                    before_rebuild()
                t1 = time.perf_counter()
                call = self.repo.load_call(*key)
                t2 = time.perf_counter()
                entry = self._reconstruct(key, call)
                entry.retrieval, entry.state_history = call.retrieval, call.state_history   # published for selection
                self._load_s.append(t2 - t1)
                self._rebuild_s.append(time.perf_counter() - t2)
            self._keep_rebuilt(entry)
            self.entries[key] = entry
            self.matrix.put(key, entry.retrieval, entry.state_history)
        self.window.commit(plan)
        self.reused += len(taken)
        return PrepareReport(len(plan.add), len(plan.drop), len(plan.deferred), budget, time.perf_counter() - t0,
                             len(taken))

    def _keep_rebuilt(self, entry: PreparedEntry) -> None:
        """Keep ``entry`` as the most recently used, dropping the least recently used ones while
        the kept entries exceed ``cfg.reuse_budget_bytes`` (one larger than it is not kept)."""
        size = entry.nbytes()
        if size > self.cfg.reuse_budget_bytes:
            return
        self._rebuilt[entry.key] = entry
        self._rebuilt_bytes += size
        while self._rebuilt_bytes > self.cfg.reuse_budget_bytes:
            _, old = self._rebuilt.popitem(last=False)
            self._rebuilt_bytes -= old.nbytes()

    def _reconstruct(self, key: EntryKey, call: ReferenceCall) -> PreparedEntry:
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        return reconstruct_entry(self.model, key, stored_images_to_model(call.images).to(device, dtype),
                                 call.image_mask.to(device), call.tokens.to(device), call.token_mask.to(device),
                                 call.masks)

    def _clear(self) -> None:
        self.entries.clear()
        self.matrix.clear()
        self.window.reset()
        self.last_selection = None

    def memory_report(self) -> dict[str, int]:
        per_entry = self._entry_bytes()
        return {"bytes_per_stored_call": int(self.repo.nbytes_per_call().get("total", 0)),
                "bytes_per_prepared_entry": per_entry,
                "prepared_entries": len(self.entries),
                "working_set_bytes": sum(e.nbytes() for e in self.entries.values()),
                "window_capacity_entries": self.cfg.window.capacity,
                "kept_rebuilt_entries": len(self._rebuilt), "kept_rebuilt_bytes": self._rebuilt_bytes}
