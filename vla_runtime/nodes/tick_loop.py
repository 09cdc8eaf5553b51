"""The policy node's control tick on a thread of its own, on an absolute schedule, at real-time priority.

Why not an rclpy timer: measured with ``bench/control_tick.py`` (three nodes, 2-core machine),
a timer tick goes through the executor's Python wait loop and thread pool, shared with every
joint-state message, at the process's ordinary CPU priority: on a loaded machine a tick often
started 30-100 ms late, and ticks were missed, with or without a call running. Here:

- the deadlines are ``t0 + k * period`` on the monotonic clock (no drift: a late tick does
  not move the ones after it; a deadline already past is skipped, never run in a burst);
- the thread asks for ``SCHED_FIFO`` at ``rt_priority`` (the kernel then runs it as soon as it
  wakes, ahead of every ordinary process); where that is refused (no CAP_SYS_NICE, rtprio
  limit 0) it says so once and runs at ordinary priority;
- the interpreter's GIL switch interval is shortened (``GIL_SWITCH_S``), so that a tick waits
  at most about that long for the thread that is denoising to hand the interpreter over.

With ``use_sim_time`` the node keeps an rclpy timer instead: simulated time is not the
monotonic clock this schedule sleeps on.

A tick that starts more than half a period late is noted with where the process's threads
were and how long each waited for a CPU (``late_ticks.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from .late_ticks import LateTickWatch

log = logging.getLogger(__name__)

GIL_SWITCH_S = 0.001   # CPython's default is 0.005: a tick could wait that long for the GIL


def next_deadline(deadline_ns: int, now_ns: int, period_ns: int) -> int:
    """The deadline after ``deadline_ns`` (the one just run): the next on the grid that is not
    already past at ``now_ns`` (ticks whose time went by while the last one ran are skipped)."""
    if period_ns <= 0:
        raise ValueError(f"period_ns must be > 0, got {period_ns}")
    nxt = deadline_ns + period_ns
    if nxt <= now_ns:
        nxt += ((now_ns - nxt) // period_ns + 1) * period_ns
    return nxt


def realtime_thread(rt_priority: int) -> str:
    """Put the calling thread under SCHED_FIFO at ``rt_priority`` (0: leave it). Returns '' on
    success, else why not (the caller logs it; the thread carries on at ordinary priority)."""
    if isinstance(rt_priority, bool) or not isinstance(rt_priority, int) or not 0 <= rt_priority <= 99:
        raise ValueError(f"rt_priority must be an int in [0, 99], got {rt_priority!r}")
    if rt_priority == 0:
        return ""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt_priority))   # pid 0: this thread
    except (OSError, AttributeError) as e:   # PermissionError without CAP_SYS_NICE; no SCHED_FIFO off Linux
        return f"SCHED_FIFO priority {rt_priority} refused ({e}); needs CAP_SYS_NICE or an rtprio limit (ulimit -r)"
    return ""


class TickLoop:
    """Calls ``tick`` once per ``period_s`` on its own daemon thread until ``stop``.

    ``clock`` (ns) and ``wait`` (seconds; returns True when asked to stop) are the monotonic
    clock and the stop event's wait: tests pass their own to check the schedule without time."""

    def __init__(self, period_s: float, tick: Callable[[], None], rt_priority: int = 0,
                 clock: Callable[[], int] = time.monotonic_ns,
                 wait: Callable[[float], bool] | None = None) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.period_ns = int(round(period_s * 1e9))
        self.tick = tick
        self.rt_priority = rt_priority
        self.clock = clock
        self._stop = threading.Event()
        self.wait = wait if wait is not None else self._stop.wait
        self._thread: threading.Thread | None = None
        self.priority_problem = ""
        self.skipped = 0   # deadlines passed over because the tick before them ran late
        self.late_after_ns = self.period_ns // 2   # a start later than this after its deadline is noted
        self.late = LateTickWatch()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the tick loop is already running")
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="control-tick", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ask the loop to end and wait for the tick in progress; False if it is still running."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is None or t is threading.current_thread():
            return True
        t.join(timeout_s)
        return not t.is_alive()

    def run(self) -> None:
        """The loop (the thread's body): wait for each deadline, tick, move to the next one."""
        self.priority_problem = realtime_thread(self.rt_priority)
        if self.priority_problem:
            log.warning("control tick at ordinary priority: %s; ticks may start late on a loaded machine",
                        self.priority_problem)
        try:
            self._loop()
        finally:
            self.late.close()   # here, not in stop(): only this thread reads the files

    def _loop(self) -> None:
        deadline = self.clock() + self.period_ns
        while True:
            remaining = (deadline - self.clock()) * 1e-9
            if remaining > 0 and self.wait(remaining):
                return
            if self._stop.is_set():
                return
            started = self.clock()
            where = self.late.where() if started - deadline > self.late_after_ns else None
            try:
                self.tick()
            except Exception:   # noqa: BLE001 - the loop outlives one bad tick (the tick logs its own errors)
                log.exception("control tick failed")
            if where is not None:   # the rest of the note after the tick (late_ticks.LateTickWatch: why)
                self.late.note(started, started - deadline, where)
            self.late.mark()
            nxt = next_deadline(deadline, self.clock(), self.period_ns)
            self.skipped += (nxt - deadline) // self.period_ns - 1
            deadline = nxt
