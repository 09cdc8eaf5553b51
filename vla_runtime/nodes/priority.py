"""CPU priorities of the node processes: background work yields to calls, the control tick to nothing.

The cache manager's process runs at a lower CPU priority (``background_priority``), the policy
node's at a higher one (``control_priority``).

Why: on a machine with few cores the window rebuild (a dense prefill per entering entry) competes
with the vision and policy processes for the same cores; at a higher nice value the scheduler
gives a runnable call almost all of a core the rebuild would take, while the rebuild still uses
every idle cycle (the time the robot executes a chunk). On a GPU the rebuild's kernels are issued
the same way, so the CPU side of a call is not held up either.

Why the policy node's whole process, and not only its tick thread: the tick is Python, and it
starts only once it holds the interpreter lock. Whichever thread of the process holds it then
(the executor taking a joint state, the denoising call) must get a core to hand it over; at an
ordinary priority on a loaded machine that thread waits its turn behind every other process,
and the tick with it (measured with ``bench/control_tick.py``: ticks 100-600 ms late with the
tick thread alone at real-time priority, load 10 on 2 cores). On Linux a nice value belongs to
a thread, and threads inherit the value of the thread that starts them: so the node sets it
before it starts its executor and tick threads, and sets it also on the threads it started
before it knew its profile (``threads``: the call thread that denoises, which holds the lock
between torch operations; left at nice 0, it waited its turn behind the other processes while
holding the lock, and the tick with it: ``bench/control_tick.py``'s late ticks named it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def background_priority(nice: int) -> int:
    """Raise this process's nice value by ``nice`` (0: leave it); returns the value now in force.
    A refused change (a container without the capability) is logged, never fatal."""
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise ValueError(f"nice must be an int in [0, 19], got {nice!r}")
    if nice == 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    try:
        return os.nice(nice)
    except OSError as e:
        log.warning("could not lower the cache manager's CPU priority (nice +%d): %s", nice, e)
        return os.getpriority(os.PRIO_PROCESS, 0)


def control_priority(nice: int | None, threads: Iterable[int] = ()) -> int:
    """Set this thread's nice value to ``nice`` (-20..19; None: leave it), so also that of the
    threads it starts afterwards, and that of the already running ``threads`` (native thread
    ids); returns this thread's value now in force. A value below the current one needs
    CAP_SYS_NICE (or RLIMIT_NICE): refused, it is logged, never fatal."""
    if nice is not None and (not isinstance(nice, int) or isinstance(nice, bool) or not -20 <= nice <= 19):
        raise ValueError(f"nice must be null or an int in [-20, 19], got {nice!r}")
    for tid in (0, *threads) if nice is not None else ():
        if nice == os.getpriority(os.PRIO_PROCESS, tid):
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)   # Linux: one thread (0: this one)
        except OSError as e:
            log.warning("could not set the policy node's CPU priority to nice %d (%s): control ticks may start late "
                        "on a loaded machine; grant CAP_SYS_NICE or raise the nice limit (ulimit -e)", nice, e)
            break
    return os.getpriority(os.PRIO_PROCESS, 0)
