"""Selection's view of the published window, read in place in the working set's shared memory.

Why in place: copying each newly published entry's retrieval features into a local matrix (and
moving rows when entries slid out) cost about 1 ms per call at ``pi05-mw``, more than the
selection itself. The working set's slots sit a constant stride apart, so the retrieval field of
every slot is one strided ``[slots, F]`` tensor (``RingBuffer.field_view``): a query is a
matrix-vector product over its rows that hold candidates (``_product``), scaled by each slot's
inverse norm. Per slot only small things are
kept, each computed once per sequence number (a slot rewritten gets a new one): the entry's key
and episode code (from its header, decoded once), the inverse norm of its features, and the pin
whose seqlock word says whether the slot was written since.

A view of shared memory can change under the reader, so what is read counts only where the slot
was not written meanwhile: scores of slots written since their pin are not eligible (checked for
all slots at once after the product), and the caller checks the chosen entry's pin once more after
the joint-history rerank (``entry``): a slot rewritten mid-read means a dense call, never a wrong
reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..cache.entry import EntryKey, PreparedEntry
from ..cache.retrieval import EpisodeCodes
from ..ipc.ring import PinnedSlot, RingBuffer
from .working_set import pinned_entry


class WindowView(EpisodeCodes):
    """The working set as ``Candidates`` (one row per slot) and as a ``CandidateSource``.

    Only entries of the current task's reference episodes (``follow_task``) are candidates, so a
    window still holding another task's entries can never serve this one. ``window`` is the
    state the cache manager last published for its window (``window_state``).
    """

    GAP_READ_BYTES = 256 * 1024   # spare slots between candidates read through when smaller (``_product``)

    def __init__(self, ring: RingBuffer):
        if "retrieval" not in {f.name for f in ring.layout.fields}:
            raise ValueError(f"working set {ring.name!r} publishes no retrieval features (an older cache manager?)")
        self.ring = ring
        features = ring.field_view("retrieval")
        if features.device.type != "cpu":
            raise ValueError(f"working set {ring.name!r} lives on {features.device}: selection reads it on the host")
        # the product in torch, which keeps to the process's thread setting (numpy's BLAS threads a
        # large product over every core: on a loaded machine that cost 7x); norms with numpy's
        # einsum, no BLAS and no torch dispatch (the larger cost at small widths)
        self._features = features.view(ring.slots, -1)             # [slots, F], no copy
        self._features_np = self._features.numpy()                 # the same memory
        self._histories = ring.field_view("history").numpy()       # [slots, L, D], no copy
        self.feature_dim = int(self._features.shape[1])
        self.task: str | None = None
        self._episodes: frozenset[str] = frozenset()
        self.window: dict | None = None
        self._query: Tensor | None = None   # the query buffer (_query_buffer)
        self.rows_scored = 0                # slots the last product read (the candidates)
        self._forget_all()

    def _forget_all(self) -> None:
        slots = self.ring.slots
        version = getattr(self, "codes_version", 0) + 1   # never back to a value a mask was built at
        EpisodeCodes.__init__(self)
        self.codes_version = version
        self._seen = np.full(slots, -1, dtype=np.int64)            # sequence last looked at, per slot
        self._slot_codes = np.full(slots, -1, dtype=np.int64)           # episode code; -1: no candidate
        self._inv_norm = np.zeros(slots, dtype=np.float32)
        self._locks = np.zeros(slots, dtype=np.int64)              # each candidate's seqlock at its pin
        self._pins: list[PinnedSlot | None] = [None] * slots
        self._entries: list[PreparedEntry | None] = [None] * slots   # each candidate's entry, in place
        self.keys: list[EntryKey | None] = [None] * slots
        self._slot_of: dict[EntryKey, int] = {}
        self._plan: _ProductPlan | None = None      # the product's spans and masks (``_plan_now``)
        self._changes_seen = -1   # the ring's header change count when the view was last complete

    def follow_task(self, task: str, episodes: Iterable[str]) -> None:
        """Candidates from now on: the prepared entries of ``episodes`` (the task's references)."""
        episodes = frozenset(episodes)
        if task != self.task or episodes != self._episodes:
            self.task, self._episodes = task, episodes
            self._forget_all()

    def refresh(self) -> int:
        """Take in the slots whose sequence changed since the last call; returns the entries that
        became candidates. Costs one word's read when no slot header changed since the view was
        last complete (``RingBuffer.changes``), one vectorised read of the headers otherwise."""
        changes = self.ring.changes
        if changes == self._changes_seen:
            return 0
        added, complete = 0, True
        seqs = self.ring.slot_seqs()
        for slot in np.flatnonzero(seqs != self._seen).tolist():
            seq = int(seqs[slot])
            self._forget(slot)
            if seq < 0:
                self._seen[slot] = seq
                continue
            pin = self.ring.pin(slot, seq)
            if pin is None or not isinstance(pin.meta, dict):
                complete = False                            # being rewritten: looked at again next call
                continue
            meta = pin.meta
            if "window" in meta:                            # the window's state, not an entry
                self.window, self._seen[slot] = meta["window"], seq
                continue
            key = (str(meta["episode"]), int(meta["index"]))
            if meta.get("selectable") and key[0] in self._episodes:
                norm = _norm(self._features_np[slot])
                if not pin.valid():                         # rewritten while its norm was taken
                    complete = False
                    continue
                self._inv_norm[slot] = 1.0 / max(norm, 1e-12)
                self._slot_codes[slot], self._locks[slot] = self.code(key[0]), pin.lock_word
                self._pins[slot], self.keys[slot], self._slot_of[key] = pin, key, slot
                self._entries[slot] = pinned_entry(pin)   # views, built here: mostly between calls
                self._candidates_changed()
                added += 1
            self._seen[slot] = seq
        self._changes_seen = changes if complete else -1
        return added

    def _query_buffer(self) -> Tensor:
        """The float32 vector a query is copied into (allocated once: a call allocates nothing here)."""
        if self._query is None:
            self._query = torch.zeros(self.feature_dim, dtype=self._features.dtype)
        return self._query

    def warm(self) -> None:
        """Read the candidates' features once, as a query will (between calls): the next call's
        product then finds more of them in the CPU's caches than in main memory (at ``pi05-mw``,
        24 slots of 16k float32 features, 1.5 MB: the product over cold features was the largest
        part of a call's selection)."""
        self._product(self._query_buffer(), self._current_plan())

    def _candidates_changed(self) -> None:
        """A candidate came or went: the product plan and masks built from the codes are stale."""
        self._plan = None
        self.codes_version += 1

    def _current_plan(self) -> _ProductPlan:
        return self._plan or self._plan_now()

    def _forget(self, slot: int) -> None:
        key = self.keys[slot]
        if key is not None and self._slot_of.get(key) == slot:   # not if the entry moved to a slot taken in first
            del self._slot_of[key]
        if self._slot_codes[slot] >= 0:
            self._candidates_changed()
        self.keys[slot], self._pins[slot], self._entries[slot] = None, None, None
        self._slot_codes[slot], self._inv_norm[slot] = -1, 0.0

    def entry(self, key: EntryKey) -> tuple[PinnedSlot, PreparedEntry] | None:
        """A candidate's pin (its slot and sequence when taken in; ``valid()`` says whether the slot
        is still as it was when scored) and its ``PreparedEntry`` of views into the slot (built
        when the candidate was taken in; valid while the pin is)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        pin, entry = self._pins[slot], self._entries[slot]
        return None if pin is None or entry is None else (pin, entry)

    def __len__(self) -> int:
        return len(self._slot_of)

    # Candidates
    @property
    def history_len(self) -> int:
        return int(self._histories.shape[1])

    @property
    def state_dim(self) -> int:
        return int(self._histories.shape[2])

    @property
    def episode_code_np(self) -> np.ndarray:
        return self._slot_codes

    @property
    def histories_np(self) -> np.ndarray:
        return self._histories

    def similarities(self, features: Tensor) -> np.ndarray:
        """[slots] cosine similarity of the query to each slot's entry, -inf where a slot holds no
        candidate or was written since its pin (its score may mix two payloads). The view's own
        buffer: valid until the next call."""
        q = features.detach().reshape(-1)
        if q.dtype != self._features.dtype or q.device.type != "cpu" or not q.is_contiguous():
            q = self._query_buffer().copy_(q)                       # the call's features, as float32
        plan = self._current_plan()
        self._product(q, plan)
        sims = plan.sims
        # no candidate: free slots read through in a gap hold whatever they last held (any float,
        # inf and nan included), so -inf before scaling (their scale is 1, never 0 * inf)
        np.copyto(sims, -math.inf, where=plan.not_candidate)
        sims *= plan.inv_norm * (1.0 / max(math.sqrt(float(torch.dot(q, q))), 1e-12))   # torch: this process's threads
        if not self.ring.unchanged_since(self._changes_seen):   # some slot was written: which ones since their pins
            sims[self.ring.seqlocks() != self._locks] = -math.inf
        return sims

    def _product(self, q: Tensor, plan: _ProductPlan) -> None:
        """``plan.sims[slot] = features[slot] . q`` over the plan's spans of slots, read in place."""
        for rows, out in plan.spans:
            torch.mv(rows, q, out=out)
        self.rows_scored = plan.rows_scored

    def _plan_now(self) -> _ProductPlan:
        """The product's spans of slots, candidates and the short gaps between them, and the masks
        a call applies after it; kept until a candidate comes or goes (``refresh``), so a call
        computes none of it.

        Why spans, not every slot: the working set has room for the whole window and its spare
        slots, and after an episode's first search it holds few candidates (2-16 of 27 at
        ``pi05-small``, where a slot's features are 768 KB); the product over every slot read all
        21 MB, from main memory after the vision tower, and was most of a call's selection. A gap
        of other slots between two spans is read through when it is smaller than
        ``GAP_READ_BYTES`` (what a product's dispatch costs in memory time: at ``pi05-mw``, 64 KB a
        slot, several products cost more than one over a few spare slots); their scores are
        masked (``not_candidate``)."""
        slots = self.ring.slots
        sims = np.full(slots, -math.inf, dtype=np.float32)
        out = torch.from_numpy(sims)
        rows = np.flatnonzero(self._slot_codes >= 0)
        spans: list[tuple[Tensor, Tensor]] = []
        scored = 0
        if len(rows):
            gap_rows = self.GAP_READ_BYTES // (self.feature_dim * self._features.element_size())
            cuts = np.flatnonzero(np.diff(rows) > gap_rows + 1)
            starts = rows[np.concatenate(([0], cuts + 1))].tolist()
            ends = (rows[np.concatenate((cuts, [len(rows) - 1]))] + 1).tolist()
            spans = [(self._features[a:b], out[a:b]) for a, b in zip(starts, ends)]
            scored = sum(ends) - sum(starts)
        not_candidate = self._slot_codes < 0
        inv_norm = np.where(not_candidate, np.float32(1.0), self._inv_norm)
        self._plan = _ProductPlan(spans, scored, sims, not_candidate, inv_norm)
        return self._plan

    # CandidateSource
    def candidates(self, task: str) -> WindowView | None:
        return self if task == self.task else None


@dataclass
class _ProductPlan:
    """What a query needs that changes only when candidates come or go (``WindowView._plan_now``)."""

    spans: list[tuple[Tensor, Tensor]]   # per span of slots: its features [n, F] and its scores [n], views
    rows_scored: int                     # slots the spans cover
    sims: np.ndarray                     # [slots] the scores, written by the spans' products (the query's result)
    not_candidate: np.ndarray            # [slots] bool: slots holding no candidate (never eligible)
    inv_norm: np.ndarray                 # [slots] 1 / |features| of each candidate, 1 elsewhere (their -inf stays)


def _norm(v: np.ndarray) -> float:
    """L2 norm of a vector (einsum: no BLAS, so never threaded)."""
    return math.sqrt(float(np.einsum("i,i->", v, v)))
