"""Whether choosing a reference costs a call more than the cache's halves save it (``auto`` only).

``auto`` runs a half where ``build-cache --profile`` timed its phase faster than dense, but a
cached call also pays for choosing its reference: the vision process's ``select`` phase, after
the tower and before the prefill, which the halves' timing never sees. At ``pi05-mw`` on a 2-core
CPU the Context Cache saves about 0.1-0.2 ms of a call's prefill and choosing costs 0.35-0.45 ms
(docs/cache.md), so with ``auto`` the cache made every call slower. The halves' saving is recorded
in the repository; the selection's cost is only known where it is paid, in the running pipeline,
so the vision stage measures it over its first calls and, where it outweighs the saving, runs
the rest of the run dense and says why. A half forced ``on`` is never second-guessed.

No torch here: plain bookkeeping, tested directly.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def selection_pays(saving_s: float, served_share: float, select_s: float) -> bool:
    """The rule: what the halves save a served call, times the share of calls served, is at least
    what choosing a reference costs a call."""
    return saving_s * served_share >= select_s


@dataclass
class SelectionBudget:
    """Decides once, after ``calls`` calls that ran the selection, whether the cache stays on.

    ``saving_s``: what the running halves save a served call (``ResolvedHalves.saving_s``). Per
    call the selection costs its median ``select`` time (a median, so one call slowed by the
    machine does not decide) and saves ``saving_s`` only on the calls a reference served, so the
    cache stays on where ``saving_s x served / calls`` is at least that median.
    """

    saving_s: float
    calls: int = 50
    select_s: list[float] = field(default_factory=list)
    served: int = 0
    verdict: str | None = None      # set once decided: why the cache stays on or goes off
    keep: bool | None = None        # None until decided

    def __post_init__(self) -> None:
        if self.calls < 1:
            raise ValueError(f"calls must be >= 1, got {self.calls}")

    def observe(self, select_s: float, served: bool) -> bool | None:
        """One call's selection cost and whether a reference served it. Returns the decision on
        the call that makes it (True: keep the cache, False: run dense from now on), else None."""
        if self.keep is not None:
            return None
        self.select_s.append(select_s)
        self.served += bool(served)
        if len(self.select_s) < self.calls:
            return None
        cost, share = statistics.median(self.select_s), self.served / len(self.select_s)
        saved = self.saving_s * share
        self.keep = selection_pays(self.saving_s, share, cost)
        self.verdict = (f"choosing a reference cost {1e3 * cost:.2f} ms a call (median of the first "
                        f"{len(self.select_s)} calls), the halves save {1e3 * saved:.2f} ms a call "
                        f"({1e3 * self.saving_s:.2f} ms by the recorded timing, {self.served} of "
                        f"{len(self.select_s)} calls served)")
        return self.keep
