"""The control tick's schedule, checked on a simulated clock (no real time is measured)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from vla_runtime.nodes.tick_loop import GIL_SWITCH_S, TickLoop, next_deadline, realtime_thread

P = 20_000_000   # a 50 Hz period, ns


@pytest.mark.parametrize("now, expected", [
    (0, P),              # the tick ran in no time: the next grid point
    (P - 1, P),          # ran almost a period: still the next one
    (P, 2 * P),          # the next deadline is now: already past, skipped
    (5 * P + 3, 6 * P),  # ran five periods late: four deadlines skipped, never run in a burst
])
def test_next_deadline_stays_on_the_grid_and_skips_past_ones(now: int, expected: int) -> None:
    assert next_deadline(0, now, P) == expected


def test_next_deadline_refuses_a_useless_period() -> None:
    with pytest.raises(ValueError, match="period_ns"):
        next_deadline(0, 0, 0)


class FakeTime:
    """A clock that moves only when the loop waits (by the time asked) or a tick takes time."""

    def __init__(self, tick_costs_ns: list[int]) -> None:
        self.now = 1_000 * P + 7
        self.costs = list(tick_costs_ns)
        self.ticks: list[int] = []
        self.loop: TickLoop | None = None

    def clock(self) -> int:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += int(round(seconds * 1e9))
        return False

    def tick(self) -> None:
        self.ticks.append(self.now)
        self.now += self.costs.pop(0)
        if not self.costs:
            self.loop.stop()


def run_loop(costs: list[int]) -> tuple[FakeTime, TickLoop]:
    t = FakeTime(costs)
    t.loop = TickLoop(P * 1e-9, t.tick, rt_priority=0, clock=t.clock, wait=t.wait)
    t.loop.run()
    return t, t.loop


def test_ticks_start_on_an_absolute_grid_whatever_each_tick_costs() -> None:
    t, loop = run_loop([1_000_000, 7_000_000, 19_000_000, 0, 3_000_000])
    start = t.ticks[0]
    # every start is a whole number of periods after the first: the time a tick takes does not
    # move the next one (a relative sleep after each tick would drift by the ticks' cost)
    assert [x - start for x in t.ticks] == [k * P for k in range(5)]
    assert loop.skipped == 0


def test_a_tick_that_overruns_skips_the_deadlines_it_covered() -> None:
    t, loop = run_loop([2_500_000 * 20, 0, 0])   # the first tick takes 2.5 periods
    start = t.ticks[0]
    assert [x - start for x in t.ticks] == [0, 3 * P, 4 * P] and loop.skipped == 2


class LateWake(FakeTime):
    """Every wait wakes on time except the ``late_at``-th, which wakes ``by_ns`` after it."""

    def __init__(self, tick_costs_ns: list[int], late_at: int, by_ns: int) -> None:
        super().__init__(tick_costs_ns)
        self.waits, self.late_at, self.by_ns = 0, late_at, by_ns

        self.noted_before_tick: list[int] = []   # late ticks noted when each tick began

    def wait(self, seconds: float) -> bool:
        self.waits += 1
        super().wait(seconds)
        self.now += self.by_ns if self.waits == self.late_at else 0
        return False

    def tick(self) -> None:
        self.noted_before_tick.append(self.loop.late.count)
        super().tick()


def hold_the_interpreter_here(parked: threading.Event, release: threading.Event) -> None:
    parked.set()
    release.wait()


@pytest.mark.parametrize("by_ns, noted", [(P // 2, 0), (P // 2 + 1, 1), (3 * P, 1)])
def test_a_tick_that_starts_over_half_a_period_late_is_noted_with_where_the_other_threads_were(
        by_ns: int, noted: int) -> None:
    """One wake of four comes ``by_ns`` late: half a period is tolerated, anything later is noted
    once, with its lateness, its start and the innermost frame of the other thread (parked in a
    function named for it, as a denoising thread sits in the call holding the lock), and only
    after the late tick ran (the note costs time the tick must not wait for)."""
    parked, release = threading.Event(), threading.Event()
    other = threading.Thread(target=hold_the_interpreter_here, args=(parked, release), name="holder")
    other.start()
    try:
        assert parked.wait(120.0)
        t = LateWake([0, 0, 0, 0], late_at=2, by_ns=by_ns)
        t.loop = loop = TickLoop(P * 1e-9, t.tick, rt_priority=0, clock=t.clock, wait=t.wait)
        loop.run()
    finally:
        release.set()
        other.join()
    assert loop.late.count == len(loop.late.ticks) == noted
    assert t.noted_before_tick == [0, 0, noted, noted]   # the late tick (the second) ran before its note
    if noted:
        late = loop.late.ticks[0]
        assert late.late_ms == pytest.approx(by_ns * 1e-6) and late.at_s == pytest.approx(t.ticks[1] * 1e-9)
        holder = [w for w in late.threads if w.startswith("holder")]
        assert len(holder) == 1 and holder[0].endswith(" <- nodes/test_tick_loop.py:"
                                                       f"{hold_the_interpreter_here.__code__.co_firstlineno + 2} "
                                                       "hold_the_interpreter_here")
        assert not any("where_threads_are" in w for w in late.threads)   # the tick's own thread left out
        assert "ms late at monotonic" in str(late)


def test_a_failing_tick_does_not_end_the_loop() -> None:
    calls = []

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("one bad tick")
        loop.stop()

    loop = TickLoop(0.02, tick, clock=lambda: 0, wait=lambda s: False)
    loop.run()
    assert len(calls) == 2


def test_the_thread_starts_ticks_and_stops_and_shortens_the_gil_switch_interval() -> None:
    old = sys.getswitchinterval()
    try:
        ticked: list[int] = []
        three = threading.Event()

        def tick() -> None:
            ticked.append(1)
            if len(ticked) == 3:
                three.set()

        loop = TickLoop(0.001, tick)
        loop.start()
        with pytest.raises(RuntimeError, match="already running"):
            loop.start()
        assert sys.getswitchinterval() <= GIL_SWITCH_S
        assert three.wait(timeout=120.0)   # a bound against hanging, not a speed check
        assert loop.stop(timeout_s=120.0)
    finally:
        sys.setswitchinterval(old)


def test_realtime_thread_leaves_ordinary_scheduling_at_zero_and_refuses_bad_values() -> None:
    before = os.sched_getscheduler(0)
    assert realtime_thread(0) == "" and os.sched_getscheduler(0) == before
    for bad in (-1, 100, True, 1.5):
        with pytest.raises(ValueError, match="rt_priority"):
            realtime_thread(bad)


def test_realtime_thread_sets_fifo_where_permitted_and_says_why_not_elsewhere() -> None:
    """In a thread of its own (the policy applies to the calling thread only): either the kernel
    granted SCHED_FIFO (root, CAP_SYS_NICE) or the reason names what is missing."""
    seen: dict = {}

    def body() -> None:
        seen["problem"] = realtime_thread(5)
        seen["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if seen["problem"]:
        assert "CAP_SYS_NICE" in seen["problem"] and seen["policy"] != os.SCHED_FIFO
    else:
        assert seen["policy"] == os.SCHED_FIFO
    assert os.sched_getscheduler(0) != os.SCHED_FIFO   # this thread untouched
