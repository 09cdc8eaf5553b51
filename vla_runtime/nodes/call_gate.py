"""Background work that yields to calls: the cache manager waits for the gap between two calls
before each dense prefill of its window upkeep.

Why: on a small CPU a process computing on the other core still slows the call (shared memory
bandwidth, last-level cache, often one physical core under two hyperthreads), whatever its nice
level. The upkeep already starts only once a call is over (``after_call.py``), but an upkeep
longer than the gap before the next call (the simulator's steps, the robot executing the chunk)
used to run on into that call. The prefix ring carries which call is in progress (the vision stage
marks it begun, the policy stage done: ``RingBuffer.call_begun`` / ``call_done``), and the cache
manager reads it between entries, never attaching the ring (``read_call_words``).

Bounded on both sides so the window never starves: a call in progress for much longer than calls
usually take is taken as abandoned (a vision encoding that failed, a dead policy), and one wait
ends after about two usual calls even when calls follow each other without a gap (streaming):
the entry is then prepared beside the call, as it was before the gate.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..ipc.ring import CallWords, read_call_words


@dataclass
class GateStats:
    """What the gate cost the background side (diagnostics)."""

    waits: int = 0           # waits that found a call in progress
    waited_s: float = 0.0    # time spent in them
    gave_up: int = 0         # waits ended by a bound, not by the call's end


class CallGate:
    """Waits for no call to be in progress on prefix ring ``ring_name`` (the background side).

    ``read`` reads the ring's call words (``read_call_words`` of the ring; tests pass their own).
    Until calls have been seen end, the usual call time is ``first_guess_s``.
    """

    POLL_S = 0.0005          # between reads of the call words while a call runs
    MIN_WAIT_S = 0.05        # one wait's bound is never below this ...
    MIN_ABANDON_S = 0.25     # ... nor the age at which a call counts as abandoned

    def __init__(self, ring_name: str, read: Callable[[], CallWords | None] | None = None,
                 first_guess_s: float = 0.25, clock: Callable[[], int] = time.monotonic_ns,
                 sleep: Callable[[float], None] = time.sleep):
        self.ring_name = ring_name
        self._read = read if read is not None else (lambda: read_call_words(ring_name))
        self._clock, self._sleep = clock, sleep
        self._first_guess_s = first_guess_s
        self._calls_s: deque[float] = deque(maxlen=16)   # recent calls' durations, start to end
        self._last_seen: int = 0                         # the call whose duration was recorded last
        self.stats = GateStats()

    def usual_call_s(self) -> float:
        """The median of the recent calls' durations (``first_guess_s`` before any)."""
        return statistics.median(self._calls_s) if self._calls_s else self._first_guess_s

    def max_wait_s(self) -> float:
        """One wait's bound: about two usual calls (calls back to back never starve the window)."""
        return max(self.MIN_WAIT_S, 2.0 * self.usual_call_s())

    def abandoned_after_s(self) -> float:
        """A call in progress for longer than this is not waited for (nobody will end it)."""
        return max(self.MIN_ABANDON_S, 4.0 * self.usual_call_s())

    def wait_for_gap(self, while_waiting: Callable[[], None] | None = None) -> float:
        """Return once no call is in progress (or a bound is reached); the seconds waited.
        ``while_waiting`` runs between reads (a heartbeat: readers must not take a waiting
        writer for a dead one)."""
        words = self._observe()
        if words is None or not words.in_flight:
            return 0.0
        start = self._clock()
        limit_ns = int(self.max_wait_s() * 1e9)
        abandoned_ns = int(self.abandoned_after_s() * 1e9)
        ended = False
        while True:
            now = self._clock()
            if now - words.begun_ns > abandoned_ns or now - start > limit_ns:
                break
            if while_waiting is not None:
                while_waiting()
            self._sleep(self.POLL_S)
            words = self._observe()
            if words is None or not words.in_flight:
                ended = True
                break
        waited = (self._clock() - start) / 1e9
        self.stats.waits += 1
        self.stats.waited_s += waited
        self.stats.gave_up += not ended
        return waited

    def _observe(self) -> CallWords | None:
        """Read the call words, learning each finished call's duration once."""
        words = self._read()
        if words is not None:
            took = words.last_call_s()
            if took is not None and words.done != self._last_seen:
                self._calls_s.append(took)
                self._last_seen = words.done
        return words
