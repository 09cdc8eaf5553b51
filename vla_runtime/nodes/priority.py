"""Background work yields to calls: the cache manager's process runs at a lower CPU priority.

Why: on a machine with few cores the window rebuild (a dense prefill per entering entry) competes
with the vision and policy processes for the same cores; at a higher nice value the scheduler
gives a runnable call almost all of a core the rebuild would take, while the rebuild still uses
every idle cycle (the time the robot executes a chunk). On a GPU the rebuild's kernels are issued
the same way, so the CPU side of a call is not held up either.
"""

from __future__ import annotations

import logging
import os

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
