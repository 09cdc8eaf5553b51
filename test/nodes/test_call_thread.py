"""CallThread: a node's long calls in order, off the executor's thread, never piling up."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vla_runtime.nodes.call_thread import CallThread

WAIT_S = 5.0   # generous: only a broken thread makes a test wait this long


def blocker(thread: CallThread) -> tuple[threading.Event, threading.Event]:
    """Submit a call that holds the thread until released; returns (started, release)."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(WAIT_S)

    assert thread.submit(hold)
    assert started.wait(WAIT_S)
    return started, release


def drain(thread: CallThread) -> None:
    """Wait until every call submitted so far has run (retrying while the queue is still full)."""
    done = threading.Event()
    deadline = time.monotonic() + WAIT_S
    while not thread.submit(done.set):
        assert time.monotonic() < deadline, "the call thread never took its queue"
        time.sleep(0.001)
    assert done.wait(WAIT_S)


def test_calls_run_in_order_on_their_own_thread():
    t = CallThread("calls")
    seen: list[tuple[int, str]] = []
    for i in range(3):
        assert t.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    drain(t)
    assert seen == [(0, "calls"), (1, "calls"), (2, "calls")]
    assert t.stop()


def test_arguments_reach_the_call():
    t = CallThread("calls")
    got = []
    t.submit(lambda a, b: got.append((a, b)), "slot", 7)
    drain(t)
    assert got == [("slot", 7)]
    t.stop()


def test_a_full_queue_refuses_and_counts_without_blocking():
    t = CallThread("calls", max_pending=2)
    _, release = blocker(t)
    ran = []
    assert t.submit(ran.append, 1) and t.submit(ran.append, 2)
    assert not t.submit(ran.append, 3)     # two already waiting
    assert t.dropped == 1
    release.set()
    drain(t)
    assert ran == [1, 2]
    t.stop()


def test_a_periodic_call_waits_once_however_often_it_is_submitted():
    t = CallThread("calls", max_pending=3)
    _, release = blocker(t)
    beats = []

    def beat() -> None:
        beats.append(1)

    for _ in range(10):                    # a 10 Hz heartbeat during a 1 s call
        assert t.submit(beat, coalesce=True)
    assert t.submit(beats.append, 2)       # a call with arguments still finds room
    assert t.dropped == 0
    release.set()
    drain(t)
    assert beats == [1, 2]
    assert t.submit(beat, coalesce=True)   # once it ran, it can wait again
    drain(t)
    assert beats == [1, 2, 1]
    t.stop()


def test_only_calls_without_arguments_coalesce():
    t = CallThread("calls")
    with pytest.raises(ValueError, match="without arguments.*got 1"):
        t.submit(print, "x", coalesce=True)
    t.stop()


def test_dropped_calls_never_run_and_the_running_one_finishes():
    t = CallThread("calls")
    _, release = blocker(t)
    ran = []
    t.submit(ran.append, "taken while active")
    t.submit(lambda: ran.append("beat"), coalesce=True)
    assert t.drop_pending() == 2
    release.set()
    drain(t)
    assert ran == []
    beat = lambda: ran.append("beat")   # noqa: E731 - the same callable twice
    assert t.submit(beat, coalesce=True)   # the dropped one no longer stands for it
    assert t.submit(beat, coalesce=True)
    drain(t)
    assert ran == ["beat"]
    t.stop()


def test_a_failing_call_is_logged_and_the_next_runs(caplog):
    t = CallThread("calls")
    ran = []

    def fail() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="vla_runtime.nodes.call_thread"):
        t.submit(fail)
        t.submit(ran.append, 1)
        drain(t)
    assert ran == [1]
    assert "calls: a call failed" in caplog.text and "boom" in caplog.text
    t.stop()


def test_stop_waits_for_the_running_call_then_refuses_new_ones():
    t = CallThread("calls")
    _, release = blocker(t)
    ran = []
    t.submit(ran.append, "pending")
    assert not t.stop(timeout_s=0.05)      # the call still holds the thread
    release.set()
    assert t.stop(timeout_s=WAIT_S)
    assert ran == []                       # what was pending at the stop never ran
    assert not t.submit(ran.append, "late") and t.dropped == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_pending_is_validated(bad):
    with pytest.raises(ValueError, match=f"max_pending must be an int >= 1, got {bad!r}"):
        CallThread("calls", max_pending=bad)
