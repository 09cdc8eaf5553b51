"""When the cache manager may slide its window: after the call that selected, not during it.

The vision node says what a call selected (``ReferenceSelection``) as soon as its prefix is
written, that is when the policy starts denoising. Sliding the window then means a dense prefill
per entering entry on the other core while the policy denoises, and on a CPU that slows the
denoising through the memory and caches the two share, whatever the cache manager's nice value
(docs/cache.md, "Background work"). So the cache manager holds each selection until the policy
publishes the chunk of that call (``ActionChunk.call_id``), and follows it then, while the robot
executes the chunk (rMuscle §4.3: reconstruction overlaps action execution). A selection whose
chunk never comes (a refused slot, an inactive or dead policy node) is followed anyway once it
has waited ``max_wait_s`` or three times as long as a selection usually waits for its chunk
(the denoising time, learnt from the chunks: seconds for a large model on a CPU), so the window
never stops following.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.selector import Selection

DEFAULT_MAX_WAIT_S = 0.5
WAIT_MARGIN = 3.0     # a selection is overdue after this many times the usual wait for its chunk
WAIT_EMA = 0.2        # weight of one call's wait in the usual wait


@dataclass
class AfterCall:
    """Selections held until their call's chunk is out; each method returns those now due, oldest
    first (selections arrive in request order, so each is due no later than the ones after it)."""

    max_wait_s: float = DEFAULT_MAX_WAIT_S
    usual_wait_s: float = 0.0      # moving average of the selection-to-chunk wait
    _held: deque[tuple[Selection, float]] = field(default_factory=deque)
    _done_seq: int | None = None   # call_id of the newest chunk published

    def __post_init__(self) -> None:
        if not self.max_wait_s >= 0.0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")

    def __len__(self) -> int:
        return len(self._held)

    def add(self, selection: Selection, now_s: float) -> list[Selection]:
        """A call's selection; due at once when its chunk was published before it arrived."""
        self._held.append((selection, now_s))
        return self._due(now_s)

    def chunk_published(self, call_id: int, now_s: float) -> list[Selection]:
        """The policy published call ``call_id``'s chunk: that call and the ones before it are over.
        The newest chunk's id is kept as is, so a restarted policy numbering from 0 again is
        followed too."""
        self._done_seq = call_id
        for selection, since in self._held:
            if selection.request_seq == call_id:   # its own chunk: how long a call's denoising takes
                wait = now_s - since
                self.usual_wait_s = wait if self.usual_wait_s == 0.0 else \
                    self.usual_wait_s + WAIT_EMA * (wait - self.usual_wait_s)
        return self._due(now_s)

    @property
    def wait_limit_s(self) -> float:
        """How long a selection waits for its chunk before it is followed anyway."""
        return max(self.max_wait_s, WAIT_MARGIN * self.usual_wait_s)

    def overdue(self, now_s: float) -> list[Selection]:
        """Selections held ``wait_limit_s`` or longer (no chunk came for them)."""
        return self._due(now_s)

    def clear(self) -> None:
        """Forget what is held (the node stops following: deactivated)."""
        self._held.clear()
        self._done_seq = None

    def _due(self, now_s: float) -> list[Selection]:
        due = []
        while self._held:
            selection, since = self._held[0]
            over = self._done_seq is not None and selection.request_seq <= self._done_seq
            if not (over or now_s - since >= self.wait_limit_s):
                break
            due.append(self._held.popleft()[0])
        return due
