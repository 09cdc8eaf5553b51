"""Reference selection in the vision process, from the window the cache manager publishes.

Between the vision tower and the prefill a call needs its reference. Asking the cache manager
for it (a process round trip, answered only when the manager is not busy rebuilding entries)
cost 6.6 ms at the smallest model and timed out at 0.5 s on a loaded machine, so the choice is
made here instead: the episode's retrieval state (``ReferenceSelector``) over the published window
read in place (``WindowView``: no copy of the window's features), then the chosen entry, still
pinned as it was scored, is read in place by the Context Cache. What was chosen goes on to the
cache manager as a ``Selection`` note, after the fact, so it can slide its window while the robot
executes; it is never waited for. A window that is not
there, not ready or of another camera layout means a dense call, never a wait.

An episode's first search picks the top-T reference episodes it follows to its end, so it waits
(dense calls) until the cache manager says the episode's initial window is complete
(``window_state``): what the pipeline selects then does not depend on how far the cache manager
had got, and equals what one process selects. The wait is bounded (``first_search_wait_s`` from
the episode's first call): a cache manager starved of CPU, or an episode too short for its window,
then searches what has been published rather than running the whole episode dense.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..cache.entry import PreparedEntry
from ..cache.repository import ReferenceRepository
from ..cache.retrieval import RetrievalConfig
from ..cache.selector import ReferenceSelector, Selection
from ..ipc.ring import PinnedSlot, RingBuffer
from .window_view import WindowView
from .working_set import current_ring, window_state

@dataclass
class Choice:
    """One call's selection and, when it found a prepared entry, that entry pinned in place."""

    selection: Selection
    entry: PreparedEntry | None = None
    pin: PinnedSlot | None = None
    slot: int = -1
    seq: int = -1

    @property
    def found(self) -> bool:
        return self.entry is not None

    @property
    def reason(self) -> str:
        return self.selection.reason


class WindowSelector:
    """The episode's reference selection over the shared working set called ``working_set``.

    The repository (its index only) gives each task's reference episodes and their lengths;
    ``retrieval`` is the same configuration the cache manager was given (thresholds, floors).
    """

    def __init__(self, repo: ReferenceRepository, retrieval: RetrievalConfig, working_set: str,
                 first_search_wait_s: float = 1.0):
        self.name = working_set
        self.first_search_wait_s = first_search_wait_s
        self.episode_t0 = 0.0          # monotonic time of the episode's first call
        self.episode_ready: dict = {}  # the window state that says this episode's initial window is complete
        self.partial_first_searches = 0   # first searches run on an incomplete window (the wait ran out)
        self.episodes = {t: {r.episode_id: r.num_calls for r in repo.episodes(t)} for t in repo.tasks()}
        layout = repo.call_layout or {}
        if "state_history" not in layout:
            raise ValueError(f"repository {repo.root} holds no episodes yet")
        self.state_dim = int(layout["state_history"][1])
        self.ring: RingBuffer | None = None   # the working set's segment, attached
        self.view: WindowView | None = None
        self._had_window = False
        self._attached_since_call = False   # ``idle`` checked the attachment since the last call
        self.selector = ReferenceSelector(retrieval, _NoSource(), self.episodes, self.state_dim)
        self.episode_key: tuple[str, int] | None = None
        self.torn = 0   # pinned entries rewritten while a prefill read them (that call reran dense)

    def choose(self, request_seq: int, task: str, episode: int, features: Tensor, state: np.ndarray) -> Choice:
        """The reference for one call (never waits; dense with the reason when none is usable)."""
        if (task, episode) != self.episode_key:
            self.episode_key = (task, episode)
            self.selector.start_episode(task)
            self.episode_t0 = time.monotonic()
            self.episode_ready = window_state(task, episode, True)
        self.selector.observe_state(state)
        if task not in self.episodes:
            return Choice(Selection(request_seq, task, episode, None,
                                    reason=f"unknown task {task!r}: the repository has no reference episodes for it"))
        # the attachment was checked between calls (``idle``) unless calls came back to back; a
        # cache manager restarted since then has left its last window readable and exact
        down = "" if self._attached_since_call and self.view is not None else self._attach()
        self._attached_since_call = False
        if down:
            return Choice(Selection(request_seq, task, episode, None, reason=down))
        assert self.view is not None
        if self.view.task != task:   # a task's reference episodes are fixed (the repository's index)
            self.view.follow_task(task, self.episodes[task])
        self.view.refresh()
        if not self.selector.candidate_episodes() and self.view.window != self.episode_ready:
            if time.monotonic() - self.episode_t0 < self.first_search_wait_s:
                return Choice(Selection(request_seq, task, episode, None,
                                        reason=f"initial window still being prepared (the episode's first search "
                                               f"waits up to {self.first_search_wait_s:g} s for it)"))
            self.partial_first_searches += 1
        try:
            match = self.selector.select(features)
        except ValueError as e:   # e.g. a camera layout the references were not recorded with
            return Choice(Selection(request_seq, task, episode, None, reason=f"query refused: {e}"))
        sel = self.selector.selection(request_seq, episode)
        if match is None:
            return Choice(sel)
        found = self.view.entry(match.key)
        if found is None or not found[0].valid():   # written since it was taken in: its score and history may be torn
            return Choice(Selection(request_seq, task, episode, None, sel.candidates,
                                    f"entry {match.key} replaced before it was read"))
        pin, entry = found
        return Choice(sel, entry, pin, pin.slot, pin.seq)

    def idle(self) -> None:
        """Between calls (the vision process has nothing to encode): take in what the cache
        manager changed in the window since the last look (it slides the window while a chunk
        executes), so that the next call's ``refresh`` finds little or nothing left to read, and
        read the window's features so that the call's product finds them in the caches."""
        if self.view is not None and self.view.task is not None and not self._attach():
            self._attached_since_call = True
            self.view.refresh()
            self.view.warm()

    def _attach(self) -> str:
        """Attach to (or re-attach to a restarted cache manager's) working set: '' when there is
        one to select from, else why the call runs dense."""
        ring = current_ring(self.ring, self.name)
        if ring is None:
            self.ring = self.view = None
            return ("cache manager not running (working set gone)" if self._had_window else
                    "no working set yet (cache manager starting)")
        if ring is not self.ring:
            try:
                self.view = WindowView(ring)
            except ValueError as e:
                ring.close()
                self.ring = self.view = None
                return f"working set unusable: {e}"
            self.ring = ring
            self.selector.retriever.source = self.view
            self._had_window = True
        return ""

    def diagnostics(self) -> dict[str, str]:
        st = self.selector.retriever.stats
        rate = st.hits / st.queries if st.queries else 0.0
        return {"queries": str(st.queries), "hits": str(st.hits), "hit_rate": f"{rate:.3f}",
                "fallbacks": str(st.fallbacks), "stalls": str(st.stalls), "past_end": str(st.past_end),
                "last_similarity": f"{st.last_similarity:.4f}", "torn_references": str(self.torn),
                "partial_first_searches": str(self.partial_first_searches),
                "window_entries": str(0 if self.view is None else len(self.view))}

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = self.view = None


class BesideTower:
    """Runs each call's selection beside the vision tower's later layers, where that pays.

    rMuscle §5: the query is an intermediate layer's output, so retrieval can overlap the rest of
    vision encoding. ``start`` gives the tower a callback for its retrieval layer (``on_tap``);
    from there the selection runs on a thread of its own while the later layers and projector
    run (both threads release the interpreter in torch's kernels), and ``finish`` waits for it
    after the tower. Two guards, because handing work to another thread costs a scheduler's
    wake-up, which a busy 2-core machine can stretch to milliseconds:

    - only a tower whose layers after the retrieval layer take at least ``MIN_TAIL_S`` (measured
      on every call: ``tail_s``, a moving average) gets its selection beside it. ``pi05-mw``, a
      1 ms tail: beside it, one call in ten waited 5-11 ms for the selection's thread, against
      0.9 ms for the selection in series; ``pi05-small``, a third of its tower: 1.8 ms hidden;
    - a selection whose thread has not started when the tower is done is taken back and run by
      the caller.
    """

    MIN_TAIL_S = 0.005
    TAIL_EMA = 0.2   # weight of one call's measured tail in ``tail_s``

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision-select")
        self.tail_s = 0.0
        self._pending: list[Future[Choice]] = []
        self._tapped_at: float | None = None

    def start(self, choose: Callable[[Tensor], Choice]) -> Callable[[Tensor], None]:
        """A new call: the tower's ``on_tap`` callback, which starts ``choose(features)`` beside
        the tower when its tail has been long enough."""
        self._pending, self._tapped_at = [], None

        def on_tap(features: Tensor) -> None:
            self._tapped_at = time.perf_counter()
            if self.tail_s >= self.MIN_TAIL_S:
                self._pending.append(self._pool.submit(choose, features))
        return on_tap

    def finish(self, choose: Callable[[], Choice]) -> Choice:
        """After the tower: the selection's result, waited for, or run here with ``choose`` (it
        did not run beside the tower, or its thread never started)."""
        self._measure_tail()
        if self._pending and self._pending[0].cancel():
            self._pending.clear()
        return self._pending.pop().result() if self._pending else choose()

    def abandon(self) -> None:
        """The tower failed: wait for a selection in flight (nothing runs behind a call)."""
        for f in self._pending:
            f.exception()
        self._pending = []

    def _measure_tail(self) -> None:
        if self._tapped_at is not None:
            self.tail_s += self.TAIL_EMA * (time.perf_counter() - self._tapped_at - self.tail_s)
            self._tapped_at = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _NoSource:
    """Before a working set is attached: no task has candidates."""

    def candidates(self, task: str) -> None:
        return None
