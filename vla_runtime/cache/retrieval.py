"""Choosing a reference for the current policy call (rMuscle §4.2, §5; DESIGN.md §7).

Two stages, because each signal alone is ambiguous: intermediate ViT features say *where* the
robot is in the scene (cosine similarity, top T), the recent joint trajectory says *which way*
it is moving through it (RMS joint-angle distance over the aligned history; with several arms
the worst arm decides). Search runs only over *prepared* entries (those whose expanded states
the sliding window has already rebuilt), held in a preallocated ``CandidateMatrix`` (or read in
place where the vision process finds them, ``Candidates``) so that a query is one matrix-vector
product and a few small reductions.

Episode-level policy: the first query of an episode picks the top-T reference *episodes* that
later queries are restricted to (and the sliding window follows). A best similarity below the
threshold switches the rest of the episode to dense; the same reference returned more than the
task's maximum number of calls means the robot is stuck, which is reported (``stalled``,
optional ``on_stall`` callback) and left to the caller to act on (reset the episode).

Beyond the paper, *past the references*: references are successful episodes, recorded up to the
call that finished the task, so a reference's last call is the robot's last step of a success.
An episode that keeps matching last calls (more than ``max_end_matches`` times) is where no
reference has been: near the goal but not done. Reused from that finished scene, the cached
computation carries the reference's "done" into the call and the robot hovers there (measured
in closed loop: the cached failures spent most of their calls on last calls). The rest of the
episode runs dense, so the policy itself finishes or fails as it would without the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from .repository import ReferenceRepository

Key = tuple[str, int]   # (episode_id, call index)


@dataclass
class RetrievalConfig:
    """Retrieval parameters. ``arm_slices`` = joint ranges per arm; () means one arm (all of D).

    ``min_similarity`` applies to every query. ``first_call_floor`` (per task, from
    ``first_call_floors``) applies to an episode's first search only: a first scene less similar to
    the repository than every reference episode's first scene is to the others runs dense.
    ``max_end_matches``: matches to a reference's last call an episode may have; the next one runs
    the rest of the episode dense (0: no limit, the paper's retrieval; the robot profile's
    ``cache.max_end_matches`` sets 3). Needs the episodes' lengths (``start_episode``).
    """

    top_t: int = 4
    history_len: int = 4
    min_similarity: float = 0.8
    arm_slices: tuple[tuple[int, int], ...] = ()
    first_call_floor: Mapping[str, float] = field(default_factory=dict)
    max_end_matches: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.top_t, int) or self.top_t < 1:
            raise ValueError(f"RetrievalConfig.top_t must be a positive int, got {self.top_t!r}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"RetrievalConfig.history_len must be a positive int, got {self.history_len!r}")
        if not isinstance(self.min_similarity, (int, float)) or not -1.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"RetrievalConfig.min_similarity must lie in [-1, 1], got {self.min_similarity!r}")
        if isinstance(self.max_end_matches, bool) or not isinstance(self.max_end_matches, int) \
                or self.max_end_matches < 0:
            raise ValueError(f"RetrievalConfig.max_end_matches must be an int >= 0 (0: no limit), "
                             f"got {self.max_end_matches!r}")
        self.arm_slices = tuple(tuple(s) for s in self.arm_slices)
        for task, floor in self.first_call_floor.items():
            if not isinstance(floor, (int, float)) or not -1.0 <= floor <= 1.0:
                raise ValueError(f"RetrievalConfig.first_call_floor[{task!r}] must lie in [-1, 1], got {floor!r}")
        for s in self.arm_slices:
            if len(s) != 2 or not all(isinstance(x, int) for x in s) or not 0 <= s[0] < s[1]:
                raise ValueError(f"RetrievalConfig.arm_slices entries must be [start, end) joint ranges, got {s!r}")


@dataclass(frozen=True)
class Match:
    """The chosen reference: its key, visual cosine similarity, and joint-history distance."""

    episode_id: str
    index: int
    similarity: float
    joint_distance: float

    @property
    def key(self) -> Key:
        return (self.episode_id, self.index)


@dataclass
class RetrievalStats:
    """Cumulative counters over the retriever's lifetime (diagnostics, not control)."""

    queries: int = 0
    hits: int = 0
    misses: int = 0            # queries answered None, for any reason
    fallbacks: int = 0         # episodes switched to dense by low similarity
    past_end: int = 0          # episodes switched to dense for matching references' last calls too often
    stalls: int = 0            # episodes reported stalled
    last_similarity: float = float("nan")


class EpisodeCodes:
    """Stable integer codes of episode ids, so that episode-level reductions over candidate rows
    stay vectorised (a row's code; -1: the row holds no candidate)."""

    def __init__(self) -> None:
        self._code_of: dict[str, int] = {}
        self.episode_of_code: list[str] = []
        self.codes_version = 0   # bumped whenever a row's code changes: masks built from the codes are stale

    def code(self, episode_id: str) -> int:
        """Stable integer code of an episode (assigned on first use)."""
        if episode_id not in self._code_of:
            self._code_of[episode_id] = len(self.episode_of_code)
            self.episode_of_code.append(episode_id)
        return self._code_of[episode_id]


class Candidates(Protocol):
    """What a query reads of a task's prepared candidates, row by row.

    Two kinds implement it: ``CandidateMatrix`` (packed local rows: the repository, the in-process
    cache manager) and the vision process's ``WindowView`` (one row per working-set slot, read in
    place; a row without a candidate has episode code -1 and similarity -inf). ``Retriever``'s
    rules run unchanged over either.
    """

    feature_dim: int
    keys: Sequence[Key | None]          # per row
    episode_of_code: list[str]

    @property
    def history_len(self) -> int: ...

    @property
    def state_dim(self) -> int: ...

    @property
    def episode_code_np(self) -> np.ndarray: ...      # [rows] int64, -1: no candidate

    codes_version: int                                 # changes whenever episode_code_np does

    @property
    def histories_np(self) -> np.ndarray: ...         # [rows, L, D] float32

    def __len__(self) -> int: ...                      # candidates held (0: none to search)

    def code(self, episode_id: str) -> int: ...

    def similarities(self, features: Tensor) -> np.ndarray: ...   # [rows] cosine, -inf: not eligible


class CandidateMatrix(EpisodeCodes):
    """Prepared candidates of one task in preallocated rows, kept packed: rows ``[0, len)`` hold
    the candidates, so a query multiplies only those (a removed row is filled with the last one).

    Features are flattened, converted to float32 and L2-normalised once on ``put``, so a query
    costs one ``[len, F] @ [F]`` product. Each row also carries an integer episode code so
    episode-level reductions stay vectorised.
    """

    def __init__(self, capacity: int, feature_dim: int, history_len: int, state_dim: int,
                 device: str | torch.device = "cpu"):
        for name, v in (("capacity", capacity), ("feature_dim", feature_dim),
                        ("history_len", history_len), ("state_dim", state_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CandidateMatrix.{name} must be a positive int, got {v!r}")
        self.capacity, self.feature_dim = capacity, feature_dim
        self._features = torch.zeros(capacity, feature_dim, dtype=torch.float32, device=device)
        self._histories = torch.zeros(capacity, history_len, state_dim, dtype=torch.float32, device=device)
        self._codes_by_row = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.keys: list[Key] = []
        self._slot: dict[Key, int] = {}
        super().__init__()

    @property
    def device(self) -> torch.device:
        return self._features.device

    @property
    def features(self) -> Tensor:
        """[len, F] the candidates' normalised features (a view)."""
        return self._features[: len(self.keys)]

    @property
    def histories(self) -> Tensor:
        """[len, L, D] their joint histories (a view)."""
        return self._histories[: len(self.keys)]

    @property
    def episode_code(self) -> Tensor:
        """[len] each candidate's episode code (a view)."""
        return self._codes_by_row[: len(self.keys)]

    @property
    def episode_code_np(self) -> np.ndarray:
        """``episode_code`` as numpy (a view on CPU): the query's small reductions run in numpy,
        where an operation costs about a microsecond instead of a torch dispatch's ten."""
        return self.episode_code.cpu().numpy()

    @property
    def histories_np(self) -> np.ndarray:
        """``histories`` as numpy (a view on CPU)."""
        return self.histories.cpu().numpy()

    @property
    def history_len(self) -> int:
        return self._histories.shape[1]

    @property
    def state_dim(self) -> int:
        return self._histories.shape[2]

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot

    def similarities(self, features: Tensor) -> np.ndarray:
        """[len] cosine similarity of the query to each candidate (rows are unit vectors), float32
        numpy: the one product runs where the matrix lives, the rest of the query on the host."""
        q = features.detach().reshape(-1).to(self.device, torch.float32)
        return (self.features @ q).div_(q.norm().clamp_min(1e-12)).cpu().numpy()

    def put(self, key: Key, feature: Tensor, history: Tensor) -> int:
        """Insert or overwrite one prepared entry; returns its row."""
        if feature.numel() != self.feature_dim:
            raise ValueError(
                f"candidate {key}: feature has {feature.numel()} elements, matrix holds {self.feature_dim}")
        if tuple(history.shape) != tuple(self._histories.shape[1:]):
            raise ValueError(
                f"candidate {key}: history {tuple(history.shape)}, matrix holds {tuple(self._histories.shape[1:])}")
        row = self._slot.get(key)
        if row is None:
            if len(self.keys) == self.capacity:
                raise ValueError(f"CandidateMatrix is full ({self.capacity} rows); remove an entry first")
            row = len(self.keys)
            self.keys.append(key)
            self._slot[key] = row
        dst = self._features[row]
        dst.copy_(feature.detach().reshape(-1))
        dst.div_(dst.norm().clamp_min(1e-12))
        self._histories[row].copy_(history.detach())
        self._codes_by_row[row] = self.code(key[0])
        self.codes_version += 1
        return row

    def remove(self, key: Key) -> None:
        row = self._slot.pop(key)
        last = len(self.keys) - 1
        if row != last:   # keep the rows packed: the last candidate fills the hole
            moved = self.keys[last]
            self._features[row].copy_(self._features[last])
            self._histories[row].copy_(self._histories[last])
            self._codes_by_row[row] = self._codes_by_row[last]
            self.keys[row] = moved
            self._slot[moved] = row
        self.keys.pop()
        self._codes_by_row[last] = -1
        self.codes_version += 1

    def clear(self) -> None:
        self.keys.clear()
        self._slot.clear()
        self._codes_by_row.fill_(-1)
        self.codes_version += 1

    @classmethod
    def from_tensors(cls, keys: list[Key], features: Tensor, histories: Tensor, capacity: int | None = None,
                     device: str | torch.device = "cpu") -> CandidateMatrix:
        """Build from stacked rows (e.g. ``repo.retrieval_matrix(task)`` + ``repo.state_histories(task)``)."""
        if features.shape[0] != len(keys) or histories.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} keys, {features.shape[0]} feature rows, {histories.shape[0]} histories")
        m = cls(capacity or max(len(keys), 1), int(features[0].numel()) if len(keys) else 1,
                histories.shape[1], histories.shape[2], device)
        for i, key in enumerate(keys):
            m.put(key, features[i], histories[i])
        return m


class CandidateSource(Protocol):
    """Where the retriever finds the prepared entries of a task (None = unknown task)."""

    def candidates(self, task: str) -> Candidates | None: ...


class TaskPacks:
    """The simplest ``CandidateSource``: a fixed matrix per task."""

    def __init__(self, packs: Mapping[str, CandidateMatrix]):
        self.packs = dict(packs)

    def candidates(self, task: str) -> CandidateMatrix | None:
        return self.packs.get(task)


class Retriever:
    """Per-episode reference retrieval with fallback and stall detection.

    ``query`` returns a ``Match`` or None (run dense); ``reason`` says why it was None. Stall is
    reported three ways: ``query`` returns None, ``stalled`` becomes True, and ``on_stall`` (if
    given) is called with the offending match. The caller resets the episode (``reset`` or
    ``start_episode``).
    """

    def __init__(self, cfg: RetrievalConfig, candidates: CandidateSource,
                 on_stall: Callable[[Match], None] | None = None):
        self.cfg = cfg
        self.source = candidates
        self.on_stall = on_stall
        self.stats = RetrievalStats()
        self.task: str | None = None
        self.max_calls = 0
        self.last_index: dict[str, int] = {}
        self._checked: Candidates | None = None   # the pack whose shape the query last validated
        self.reset()

    # ---------------------------------------------------------------- episode state

    def start_episode(self, task: str, max_calls: int, episode_lengths: Mapping[str, int] | None = None) -> None:
        """Select the task pack for a new episode; ``max_calls`` bounds repeats of one reference;
        ``episode_lengths`` (calls per reference episode) tell which entries are last calls (without
        them ``max_end_matches`` has nothing to count)."""
        if not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls must be a positive int, got {max_calls!r}")
        self.task, self.max_calls = task, max_calls
        self.last_index = {e: n - 1 for e, n in (episode_lengths or {}).items()}
        self.reset()
        if self.source.candidates(task) is None:
            self.reason = f"unknown task {task!r}: no task pack"

    def reset(self) -> None:
        """Clear per-episode state (fallback, stall, repeat counts, candidate episodes); keeps the task."""
        self.fallback = False
        self.stalled = False
        self.reason = ""
        self.calls = 0
        self.end_matches = 0
        self._repeats: dict[Key, int] = {}
        self._episodes: list[str] = []
        self._unfollowed: tuple[Candidates, int, np.ndarray] | None = None   # ``_unfollowed_rows``

    def candidate_episodes(self) -> list[str]:
        """The top-T reference episodes chosen by the episode's first successful search."""
        return list(self._episodes)

    # ---------------------------------------------------------------- query

    def query(self, features: Tensor, state_history: Tensor | np.ndarray) -> Match | None:
        """Pick the prepared reference for this call, or None (dense) with ``reason`` set.

        ``features``: the current call's retrieval features (any shape, flattened).
        ``state_history``: ``[>= history_len, D]``; the last row is the current state.
        """
        if self.task is None:
            raise RuntimeError("Retriever.query before start_episode")
        self.stats.queries += 1
        self.calls += 1
        match = self._query(features, state_history)
        if match is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return match

    def _query(self, features: Tensor, state_history: Tensor | np.ndarray) -> Match | None:
        if self.stalled or self.fallback:
            return None                     # latched for the episode; reason already set (stall: till reset)
        pack = self.source.candidates(self.task)
        if pack is None:
            self.reason = f"unknown task {self.task!r}: no task pack"
            return None
        cfg = self.cfg
        if features.numel() != pack.feature_dim:
            raise ValueError(f"features have {features.numel()} elements, the task pack's have {pack.feature_dim}")
        if (state_history.ndim != 2 or state_history.shape[0] < cfg.history_len
                or state_history.shape[1] != pack.state_dim):
            raise ValueError(f"state_history must be [>= {cfg.history_len}, {pack.state_dim}], "
                             f"got {tuple(state_history.shape)}")
        arms = cfg.arm_slices or ((0, pack.state_dim),)
        if pack is not self._checked:       # a pack's shape is fixed: checked once, not per call
            if pack.history_len < cfg.history_len:
                raise ValueError(f"task pack histories cover {pack.history_len} calls, "
                                 f"history_len is {cfg.history_len}")
            if any(end > pack.state_dim for _, end in arms):
                raise ValueError(f"arm_slices {arms} exceed the state dimension {pack.state_dim}")
            self._checked = pack

        if len(pack) == 0:
            self.reason = "no prepared candidates"
            return None
        sims = pack.similarities(features)                         # -inf from here on: not eligible
        sims[~np.isfinite(sims)] = -math.inf
        if self._episodes:
            sims[self._unfollowed_rows(pack)] = -math.inf
        idx = _top(sims, cfg.top_t)          # eligible rows first: -inf sorts last
        values = sims[idx]
        if not values[0] > -math.inf:
            self.reason = "no prepared candidates"
            return None

        first_search = not self._episodes
        if first_search:
            # First search of the episode: top-T episodes by their best-matching entry.
            best_per_episode = np.full(len(pack.episode_of_code), -math.inf, dtype=sims.dtype)
            np.maximum.at(best_per_episode, np.maximum(pack.episode_code_np, 0), sims)
            n_eps = int(np.isfinite(best_per_episode).sum())
            self._episodes = [pack.episode_of_code[c] for c in _top(best_per_episode, min(cfg.top_t, n_eps))]
            self._unfollowed = None

        best = float(values[0])
        self.stats.last_similarity = best
        floor = cfg.first_call_floor.get(self.task) if first_search else None
        if best < cfg.min_similarity or (floor is not None and best < floor):
            self.fallback = True
            self.stats.fallbacks += 1
            self.reason = (f"fallback: best visual similarity {best:.3f} < {cfg.min_similarity}; "
                           if best < cfg.min_similarity else
                           f"fallback: first scene's best visual similarity {best:.5f} < {floor:.5f}, the least "
                           f"any reference episode's first scene has to the others (a scene the repository "
                           f"does not cover); ") + "dense for the rest of the episode"
            return None
        keep = values >= cfg.min_similarity          # never rerank onto a visually poor match (nor an ineligible row)
        values, idx = values[keep], idx[keep]

        if isinstance(state_history, Tensor):
            state_history = state_history.detach().to("cpu", torch.float32).numpy()
        dist = _history_distance(pack.histories_np[idx, -cfg.history_len:], state_history[-cfg.history_len:], arms)
        j = int(dist.argmin())                                     # ties: the visually closer one
        episode_id, index = pack.keys[int(idx[j])]
        match = Match(episode_id, index, float(values[j]), float(dist[j]))

        if self.last_index.get(episode_id) == index:
            self.end_matches += 1
            if cfg.max_end_matches and self.end_matches > cfg.max_end_matches:
                self.fallback = True
                self.stats.past_end += 1
                self.reason = (f"past the references: match {self.end_matches} to a reference's last call "
                               f"({match.key}), more than {cfg.max_end_matches}; dense for the rest of the episode")
                return None
        n = self._repeats[match.key] = self._repeats.get(match.key, 0) + 1
        if n > self.max_calls:
            self.stalled = True
            self.stats.stalls += 1
            self.reason = (f"stall: reference {match.key} retrieved {n} times, more than the task's "
                           f"{self.max_calls} calls; reset the episode")
            if self.on_stall is not None:
                self.on_stall(match)
            return None
        self.reason = ""
        return match

    def _unfollowed_rows(self, pack: Candidates) -> np.ndarray:
        """[rows] bool: rows whose episode is not one the episode follows (its first search's
        top-T). Kept until the pack's codes or the followed episodes change: a call reuses it."""
        kept = self._unfollowed
        if kept is None or kept[0] is not pack or kept[1] != pack.codes_version:
            codes = [pack.code(e) for e in self._episodes]   # first: may give an episode its code
            followed = np.zeros(len(pack.episode_of_code) + 1, dtype=bool)   # the last: code -1 (no row)
            followed[codes] = True
            kept = self._unfollowed = (pack, pack.codes_version, ~followed[pack.episode_code_np])
        return kept[2]


def _history_distance(histories: np.ndarray, current: np.ndarray,
                      arms: Sequence[tuple[int, int]]) -> np.ndarray:
    """[k] RMS joint-angle distance of each candidate's history [k, L, D] to the current one
    [L, D], the worst arm deciding. One ``einsum`` per arm (a mean over two axes costs several
    numpy calls, and this runs on every call's path)."""
    diff = histories - current
    scale = 1.0 / histories.shape[1]
    dist = None
    for a, b in arms:
        d = diff[:, :, a:b]
        arm = np.sqrt(np.einsum("kld,kld->k", d, d) * (scale / (b - a)))
        dist = arm if dist is None else np.maximum(dist, arm)
    assert dist is not None, "at least one arm"
    return dist


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``values``, largest first (ties: the lower index first)."""
    return np.argsort(-values, kind="stable")[:k]


def fallback_rule(min_similarity: float, floors: Mapping[str, float] | None, max_end_matches: int = 0) -> str:
    """When an episode runs dense, in words (the cache manager's start-up line, ``eval.md``);
    ``floors`` None: the first-scene floor is off; ``max_end_matches`` 0: no past-the-end limit."""
    rule = f"a best visual similarity below {min_similarity:g}"
    if floors is not None and not floors:
        rule += "; no first-scene floor (no task has two reference episodes)"
    elif floors is not None:
        rule += "; a first scene below the floor of " + ", ".join(f"{t!r} {v:.5f}" for t, v in floors.items())
    if max_end_matches:
        matches = "match" if max_end_matches == 1 else "matches"
        rule += f"; more than {max_end_matches} {matches} to a reference's last call (past the references)"
    return rule


def first_call_floors(repo: ReferenceRepository, tasks: Iterable[str] | None = None) -> dict[str, float]:
    """Per task, the least similar a known-good first scene is to the rest of the repository.

    For each reference episode, its first call's best cosine similarity to any call of the *other*
    episodes of the task (leave one episode out); the task's floor is the lowest of these. Why the
    first call: the object poses vary between episodes and the first scene shows them before the
    robot moves, whereas later calls differ by the motion too, so only the first scene separates a
    pose the repository covers from one it does not. Why calibrated, not a fixed number: the cosine
    scale depends on the model's features (a small vision tower on small images puts every scene
    above 0.99). Tasks with fewer than two reference episodes get no floor.
    """
    floors = {}
    for task in (repo.tasks() if tasks is None else tasks):
        keys, feats = repo.retrieval_matrix(task)
        episodes = sorted({e for e, _ in keys})
        if len(episodes) < 2:
            continue
        f = feats.float()
        f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)
        code = torch.tensor([episodes.index(e) for e, _ in keys])
        firsts = [i for i, (_, index) in enumerate(keys) if index == 0]
        sims = f[firsts] @ f.T                                          # [episodes with a first call, n]
        sims = sims.masked_fill(code[None, :] == code[firsts][:, None], -math.inf)
        floors[task] = float(sims.amax(dim=1).min())
    return floors


def candidates_from_repository(repo: ReferenceRepository, tasks: Iterable[str] | None = None, device: str | torch.device = "cpu",
                               ) -> TaskPacks:
    """Every call of every (or the given) task as prepared candidates: for small repositories,
    offline analysis and tests, where the whole pack fits in memory."""
    packs = {}
    for task in (repo.tasks() if tasks is None else tasks):
        keys, feats = repo.retrieval_matrix(task)
        _, hist = repo.state_histories(task)
        if keys:
            packs[task] = CandidateMatrix.from_tensors(keys, feats, hist, device=device)
    return TaskPacks(packs)
