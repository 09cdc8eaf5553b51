"""Progress of a command's long phases: one bar per phase on stderr, not a line per step.

A closed-loop evaluation or a repository build runs hundreds of policy calls; a line for each
buries the result a user ran the command for. Each phase (reference episodes, recording,
profiling, evaluation) is one tqdm bar that redraws in place, with the step's detail (the
episode, the successes so far) in its postfix, and ends as one line. The code doing the work
takes a :data:`Progress` (a factory of bars) so a library caller or a test can pass
:func:`silent`; the command line passes :func:`bars`. Notes printed while a bar is open go
through :func:`note`, which moves the bar out of the way instead of breaking it.
"""

from __future__ import annotations

import sys
from typing import Callable

from tqdm import tqdm

# desc, total (None: unknown), unit -> a bar; use it as a context manager (closing it prints its last state)
Progress = Callable[..., tqdm]


def bars(desc: str, total: int | None, unit: str = "it") -> tqdm:
    """A bar on stderr. On a terminal it redraws often; into a pipe or a file (``make demo | tee``)
    once a second at most, so the log holds the bar's states, not thousands of them."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True, dynamic_ncols=interactive,
                mininterval=0.1 if interactive else 1.0)


def silent(desc: str, total: int | None, unit: str = "it") -> tqdm:
    """A bar that shows nothing (same methods as :func:`bars`)."""
    return tqdm(total=total, desc=desc, unit=unit, disable=True)


def note(msg: str) -> None:
    """One line on stderr that does not break an open bar (tqdm clears and redraws it)."""
    tqdm.write(msg, file=sys.stderr)
