"""What a late tick records: where each other thread was, and how long threads waited for a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from vla_runtime.nodes.late_ticks import LateTickWatch, RunqueueClock, where_threads_are

HAS_SCHEDSTAT = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")


def runqueue_wait_ns() -> dict[int, int]:
    """One ``RunqueueClock`` reading, its files closed again (a reader that reads once)."""
    clock = RunqueueClock()
    try:
        return clock.read()
    finally:
        clock.close()


def park(parked: threading.Event, release: threading.Event) -> None:
    parked.set()
    release.wait()


def test_where_threads_are_names_a_library_frame_and_the_code_that_called_it() -> None:
    """A thread waiting on an event sits in the interpreter's threading module: shown with the
    innermost frame outside the libraries (this file's function) that called it; a thread whose
    innermost frame is its own code is shown with that frame alone; the caller is left out."""
    parked, release = threading.Event(), threading.Event()
    looping, done = [False], [False]

    def spin() -> None:
        while not done[0]:   # no library call inside: the innermost frame is this function's
            looping[0] = True

    waiter = threading.Thread(target=park, args=(parked, release), name="waiter")
    spinner = threading.Thread(target=spin, name="spinner")
    waiter.start(), spinner.start()
    try:
        assert parked.wait(120.0)
        give_up = time.monotonic() + 120.0
        while not looping[0] and time.monotonic() < give_up:
            time.sleep(0.001)
        seen = dict(w.split(": ", 1) for w in where_threads_are(but=threading.get_ident()))
    finally:
        release.set()
        done[0] = True
        waiter.join(), spinner.join()
    assert seen["waiter"].startswith("python") and " wait <- nodes/test_late_ticks.py:" in seen["waiter"]
    assert seen["waiter"].endswith(f":{park.__code__.co_firstlineno + 2} park")
    assert seen["spinner"].startswith("nodes/test_late_ticks.py:") and seen["spinner"].endswith(" spin")
    assert " <- " not in seen["spinner"] and "MainThread" not in seen


def test_runqueue_wait_grows_while_two_other_processes_share_its_cpu() -> None:
    """This thread and two busy child processes pinned to one CPU: while it spins, the kernel
    gives each of the three about a third of the CPU, so this thread's time runnable but not
    running grows about twice as fast as its CPU time (``time.thread_time``). The bound asks for
    1.2 times: a wrong field of schedstat (the run time) would give 1."""
    tid = threading.get_native_id()
    if not HAS_SCHEDSTAT:   # no per-thread schedstat (not Linux, or a kernel without it): nothing read
        assert runqueue_wait_ns() == {}
        return
    assert tid in runqueue_wait_ns()
    cpu, affinity = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    busy = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    children = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.3)   # the children are up and spinning on that CPU
        w0, c0 = runqueue_wait_ns()[tid], time.thread_time()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            pass
        waited_ms, ran_ms = (runqueue_wait_ns()[tid] - w0) * 1e-6, (time.thread_time() - c0) * 1e3
    finally:
        os.sched_setaffinity(0, affinity)
        for c in children:
            c.kill()
            c.wait()
    assert ran_ms > 0 and waited_ms > 1.2 * ran_ms


def test_a_note_gives_each_thread_its_wait_since_the_last_mark_and_is_kept() -> None:
    parked, release = threading.Event(), threading.Event()
    other = threading.Thread(target=park, args=(parked, release), name="other")
    other.start()
    try:
        assert parked.wait(120.0)
        watch = LateTickWatch(keep=2)
        watch.mark()
        notes = [watch.note(10_000_000_000 + k, 15_000_000, watch.where()) for k in range(3)]
    finally:
        release.set()
        other.join()
    assert watch.count == 3 and list(watch.ticks) == notes[1:]   # the latest kept
    late = notes[0]
    assert late.late_ms == pytest.approx(15.0) and late.at_s == pytest.approx(10.0)
    text = [w for w in late.threads if w.startswith("other")][0]
    if HAS_SCHEDSTAT:
        assert late.own_wait_ms is not None and late.own_wait_ms >= 0.0
        assert text.startswith("other (waited ") and " ms for a CPU): " in text
        assert "the tick thread waited" in str(late)
    else:
        assert late.own_wait_ms is None and text.startswith("other: ")


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="no per-thread schedstat: nothing is opened (checked above)")
def test_the_clock_keeps_each_threads_file_open_drops_an_ended_thread_and_closes_on_request() -> None:
    """Read after every tick, the clock opens each thread's schedstat once and re-reads it in
    place: the same threads and no smaller values than a one-shot reading, one file per thread;
    a thread that ended leaves the reading with its file, and ``close`` closes the rest."""
    parked, release = threading.Event(), threading.Event()
    other = threading.Thread(target=park, args=(parked, release), name="other")
    other.start()
    assert parked.wait(120.0)
    clock, base = RunqueueClock(), _open_files()
    try:
        first = clock.read()
        held = _open_files() - base
        assert other.native_id in first and threading.get_native_id() in first
        assert held == len(first)                                     # one file per thread, kept open
        again, once = clock.read(), runqueue_wait_ns()
        assert _open_files() - base == held                           # re-read in place: no new file
        assert again.keys() == first.keys() == once.keys()
        assert all(again[t] >= first[t] for t in first) and all(once[t] >= again[t] for t in again)
        release.set()
        other.join()
        after = clock.read()
        assert other.native_id not in after and _open_files() - base == held - 1
    finally:
        release.set()
        clock.close()
    assert _open_files() == base
