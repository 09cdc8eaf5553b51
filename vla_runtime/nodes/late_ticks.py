"""Why a control tick started late: where the process's threads were, and who waited for a CPU.

The tick thread wakes at real-time priority, yet over minutes a tick now and then starts one or
two periods late with no call of its own to blame. Two causes look the same from outside:

- the tick thread woke on time but another thread held the interpreter (a long call into a
  library that keeps the lock, or a holder that was itself taken off its CPU while holding it);
- the tick thread, or the holder, waited on a run queue: the CPUs were busy with other
  processes (or the hypervisor took them).

So each late tick (``LateTickWatch.note``) keeps, for every Python thread of the process, where
it was at that moment (``where_threads_are``: the thread that just handed the interpreter over
is still at the line that held it) and how long it waited on a run queue since the tick before
(``RunqueueClock``, from the kernel's per-thread ``schedstat``). The tick thread's own wait
says whether it got a CPU at all. Kept for the node's diagnostics and logged at most once a
second; ``bench/control_tick.py`` puts each beside the long gap it caused.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
from collections import deque
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

LATE_LOG_EVERY_S = 1.0   # a late tick is logged at most this often (each one is kept: ``ticks``)
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../vla_runtime
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class LateTick:
    """A tick that started ``late_ms`` after its deadline (monotonic ``at_s``); ``own_wait_ms``:
    how long the tick thread waited on a run queue since the tick before (None where the kernel
    does not say); ``threads``: each other thread, where it was and its own run-queue wait."""

    at_s: float
    late_ms: float
    own_wait_ms: float | None
    threads: tuple[str, ...]

    def __str__(self) -> str:
        own = "" if self.own_wait_ms is None else f" (the tick thread waited {self.own_wait_ms:.1f} ms for a CPU)"
        return f"{self.late_ms:.1f} ms late at monotonic {self.at_s:.3f} s{own}: " + " | ".join(self.threads)


class RunqueueClock:
    """Per Python thread of this process (by native id), the nanoseconds it has spent runnable
    but not running: the second field of the kernel's ``/proc/self/task/<tid>/schedstat``.

    Read after every control tick, so each thread's file is opened once and re-read in place
    (``pread``): with five threads a read took 8.7 µs against 33.7 µs opening and closing the
    files each time. A thread that ended is dropped with its file; one whose native id was given to a
    new thread gets the new thread's file. Empty off Linux (no such files)."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[threading.Thread, int]] = {}   # native id -> (thread, fd)

    def read(self) -> dict[int, int]:
        out = {}
        alive = set()
        for t in threading.enumerate():
            tid = t.native_id
            if tid is None:
                continue
            alive.add(tid)
            try:
                out[tid] = int(os.pread(self._fd(tid, t), 256, 0).split()[1])
            except (OSError, ValueError, IndexError):
                self._forget(tid)
        for tid in self._open.keys() - alive:   # threads that ended
            self._forget(tid)
        return out

    def close(self) -> None:
        """Close every file (a later ``read`` opens them again)."""
        for tid in list(self._open):
            self._forget(tid)

    def _fd(self, tid: int, thread: threading.Thread) -> int:
        held = self._open.get(tid)
        if held is not None and held[0] is thread:
            return held[1]
        self._forget(tid)
        fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        self._open[tid] = (thread, fd)
        return fd

    def _forget(self, tid: int) -> None:
        held = self._open.pop(tid, None)
        if held is not None:
            os.close(held[1])


Where = tuple[int | None, str, str]   # (native thread id, name, where it is)


def where_threads_are(but: int | None = None) -> tuple[str, ...]:
    """Each thread's ``name: where`` (``thread_frames``), sorted. ``but``: a thread ident left out."""
    return tuple(sorted(f"{name}: {where}" for _, name, where in thread_frames(but)))


def thread_frames(but: int | None = None) -> list[Where]:
    """Each thread's native id, name, innermost frame (``file:line function``) and, when that
    frame is in a library (torch, rclpy, the interpreter's threading), the innermost frame of
    the code that called into it. ``but``: a thread ident left out (the caller's)."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == but:
            continue
        where = _frame_text(frame)
        if _in_library(frame):
            f: FrameType | None = frame.f_back
            while f is not None and _in_library(f):
                f = f.f_back
            if f is not None:
                where += " <- " + _frame_text(f)
        t = threads.get(ident)
        out.append((t.native_id, t.name, where) if t is not None else (None, str(ident), where))
    return out


def _in_library(f: FrameType) -> bool:
    """A frame of the standard library or an installed package other than this one (the package
    itself may run from a site-packages too: a ROS install space)."""
    path = f.f_code.co_filename
    if path.startswith(PACKAGE):
        return False
    return path.startswith(_STDLIB) or "site-packages" in path or "dist-packages" in path


def _frame_text(f: FrameType) -> str:
    parts = f.f_code.co_filename.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{f.f_lineno} {f.f_code.co_name}"


class LateTickWatch:
    """Used by the tick thread, whose every instruction counts: ``mark`` after every tick (the
    run-queue waits so far), ``where`` as soon as a tick is found late (the other threads' frames
    move on, so they are read before the tick; nothing else is), ``note`` after that tick ran
    (the waits read and the note logged: reading /proc and logging before the tick, with the
    denoising thread asking for the interpreter every millisecond, once delayed a late tick by
    another 23 ms). ``ticks``: the latest late ticks, oldest first; ``count``: all."""

    def __init__(self, keep: int = 100) -> None:
        self.ticks: deque[LateTick] = deque(maxlen=keep)
        self.count = 0
        self._waits: dict[int, int] = {}
        self._last_log_ns: int | None = None
        self._clock = RunqueueClock()

    def mark(self) -> None:
        self._waits = self._clock.read()

    def close(self) -> None:
        """Close the schedstat files (by the thread that marks: the next ``mark`` reopens them)."""
        self._clock.close()

    @staticmethod
    def where() -> list[Where]:
        """Where each other thread is now (``thread_frames``)."""
        return thread_frames(but=threading.get_ident())

    def note(self, now_ns: int, late_ns: int, where: list[Where]) -> LateTick:
        """Keep (and at most once a second log) a tick that started ``late_ns`` late at ``now_ns``,
        with ``where`` the threads were then and each one's run-queue wait since the last mark."""
        now = self._clock.read()
        waited = {tid: (ns - self._waits[tid]) * 1e-6 for tid, ns in now.items() if tid in self._waits}
        threads = []
        for tid, name, at in sorted(where, key=lambda w: w[1]):
            wait = waited.get(tid) if tid is not None else None
            threads.append(f"{name}{'' if wait is None else f' (waited {wait:.1f} ms for a CPU)'}: {at}")
        late = LateTick(now_ns * 1e-9, late_ns * 1e-6, waited.get(threading.get_native_id()), tuple(threads))
        self.ticks.append(late)
        self.count += 1
        if self._last_log_ns is None or now_ns - self._last_log_ns >= LATE_LOG_EVERY_S * 1e9:
            self._last_log_ns = now_ns
            log.warning("control tick %s", late)
        return late
