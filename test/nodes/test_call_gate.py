"""CallGate: the cache manager's upkeep waits for the gap between calls, within bounds.

Driven by a scripted clock and scripted call words (the ring's side is in test_ring.py, and the
stages' marks in test_stages.py), so every bound is checked exactly.
"""

from __future__ import annotations

import pytest

from vla_runtime.ipc.ring import CallWords
from vla_runtime.nodes.call_gate import CallGate

MS = 1_000_000


class Script:
    """A monotonic clock that only sleep moves, and call words that change at given times."""

    def __init__(self, words_at: list[tuple[int, CallWords]]):
        self.now = 0
        self.words_at = words_at      # (from this time on, these words), in time order
        self.reads = 0
        self.beats = 0

    def clock(self) -> int:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += int(s * 1e9)

    def read(self) -> CallWords | None:
        self.reads += 1
        current = None
        for t, w in self.words_at:
            if t <= self.now:
                current = w
        return current

    def beat(self) -> None:
        self.beats += 1


def gate(script: Script, **kw) -> CallGate:
    return CallGate("ring", read=script.read, clock=script.clock, sleep=script.sleep, **kw)


def test_no_call_in_progress_or_no_ring_means_no_wait():
    for words in (None, CallWords(0, 0, 0, 0), CallWords(3, 10 * MS, 3, 30 * MS)):
        s = Script([(0, words)])
        g = gate(s)
        assert g.wait_for_gap(s.beat) == 0.0 and s.reads == 1 and s.beats == 0
        assert g.stats.waits == 0


def test_a_call_in_progress_is_waited_for_until_the_policy_ends_it():
    s = Script([(0, CallWords(5, 0, 4, 0)), (12 * MS, CallWords(5, 0, 5, 12 * MS))])
    g = gate(s)
    waited = g.wait_for_gap(s.beat)
    assert waited == pytest.approx(0.012, abs=CallGate.POLL_S + 1e-9)   # ended within one poll of the call's end
    assert s.beats > 0 and g.stats.waits == 1 and g.stats.gave_up == 0
    assert g.usual_call_s() == pytest.approx(0.012)                      # learnt from that call


def test_the_usual_call_is_the_median_of_recent_calls_learnt_once_each():
    g = gate(Script([]), first_guess_s=0.3)
    assert g.usual_call_s() == 0.3 and g.max_wait_s() == pytest.approx(0.6)
    for i, took_ms in enumerate((10, 30, 20)):
        s = Script([(0, CallWords(i + 1, 100 * MS, i + 1, (100 + took_ms) * MS))])
        g._read, g._clock, g._sleep = s.read, s.clock, s.sleep
        g.wait_for_gap()
        g.wait_for_gap()                          # the same finished call seen again: not counted twice
    assert list(g._calls_s) == pytest.approx([0.01, 0.03, 0.02])
    assert g.usual_call_s() == pytest.approx(0.02)
    assert g.max_wait_s() == CallGate.MIN_WAIT_S                         # 2 x 20 ms is under the floor
    assert g.abandoned_after_s() == CallGate.MIN_ABANDON_S


def test_calls_back_to_back_never_starve_the_upkeep():
    """Each call ends, the next begins at once (streaming): one wait ends after max_wait_s."""
    g_first = 0.02
    words = [(t * 5 * MS, CallWords(t + 1, t * 5 * MS, t, t * 5 * MS)) for t in range(1000)]
    s = Script(words)
    g = gate(s, first_guess_s=g_first)
    waited = g.wait_for_gap()
    assert waited == pytest.approx(g.max_wait_s(), abs=CallGate.POLL_S + 1e-9)
    assert g.stats.gave_up == 1


def test_a_call_nobody_ends_is_abandoned_after_four_usual_calls():
    """A call begun long ago and never ended (its encoding failed before the abandon mark, the
    policy died): the wait ends once the call is older than abandoned_after_s, not at max_wait_s."""
    s = Script([(0, CallWords(7, 0, 6, 0))])
    g = gate(s, first_guess_s=0.1)
    s.now = 390 * MS                             # the call began 390 ms ago; abandoned at 400 ms
    waited = g.wait_for_gap()
    assert waited == pytest.approx(0.010, abs=CallGate.POLL_S + 1e-9)
    assert g.stats.gave_up == 1
    s.now = 500 * MS
    assert g.wait_for_gap() == 0.0               # older than that: not waited for at all
