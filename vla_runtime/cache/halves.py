"""Which halves of the cache pay on this machine: the recorded timing, and the profile's choice.

The Context Cache (prefill) and the Action Cache (denoising) save FLOPs, but whether a FLOP saved
is a millisecond saved depends on the model's width and the machine: at the demo policy's size on
a 2-core CPU the gathers and scatters can cost more than the FFN rows they skip. So
``build-cache --profile`` times each half against dense on the machine it runs on and records a
``HalfTiming`` in the repository; the robot profile's ``cache.context_cache`` /
``cache.action_cache`` say ``auto`` (run a half only where it was shown faster: the timing pairs
each call with itself and bounds the ratio, ``median_interval``), ``on`` or ``off`` (forced).
``resolve_halves`` is that decision, kept pure so it is tested directly.

No torch here: the repository's schema check and the profile's validation both read this module.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

SETTINGS = ("auto", "on", "off")
DEFAULT_RHO_P = 0.4   # rMuscle's recompute fraction, where nothing was given or profiled
DEFAULT_RHO_N = 0.5   # rMuscle's neuron fraction, where nothing was given or profiled
HALVES = ("context_cache", "action_cache")   # keys of the profile and of the recorded timing
PHASE_OF = {"context_cache": "prefill", "action_cache": "denoise"}   # the phase each half changes


def parse_setting(value: object, key: str) -> str:
    """``auto`` | ``on`` | ``off``; the booleans of older profiles read as ``on`` / ``off``.

    Anything else is refused with ``key`` named (YAML's ``on``/``off`` unquoted are booleans, so
    they arrive here as True/False and mean what they say)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.strip().lower() in SETTINGS:
        return value.strip().lower()
    raise ValueError(f"{key}: must be auto, on or off (true/false read as on/off), got {value!r}")


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """The median of ``values`` and a distribution-free ``confidence`` interval for it.

    Each value lies above the true median with probability 1/2, so the number below it is
    Binomial(n, 1/2): with k the largest count such that P(B <= k) <= (1 - confidence) / 2, the
    (k+1)-th smallest and (k+1)-th largest values bound the median at that confidence whatever
    the distribution (a timing's tail of slow calls included). Too few values to bound it (n < 6
    at 95 %): (median, None, None).
    """
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval of no values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    tail = (1 - Fraction(confidence).limit_denominator(10 ** 6)) / 2   # exact: 2**n overflows a float past n = 1023
    below, k = 0, -1                   # below: how many of the 2**n sign patterns have at most k values under it
    while k + 1 < n and (below + math.comb(n, k + 1)) * tail.denominator <= tail.numerator * 2 ** n:
        k += 1
        below += math.comb(n, k)
    median = statistics.median(xs)
    return (median, None, None) if k < 0 else (median, xs[k], xs[n - 1 - k])


@dataclass(frozen=True)
class PhaseTiming:
    """One phase timed dense and with one half of the cache, over the same calls.

    ``dense_s`` / ``cached_s`` are each mode's median seconds. ``ratio`` is the median over the
    calls of each call's dense / cached time, the two run back to back, with its 95 % interval
    (``ratio_low``, ``ratio_high``; ``median_interval``): pairing a call with itself cancels what
    the machine's speed does between calls, which on a loaded 2-core CPU moves the ratio of the
    two medians by several percent from one profiling to the next (``pi05-mw``'s Action Cache:
    0.90x to 1.04x on one repository, docs/cache.md). Timings recorded before the pairing carry
    no ratio: None.
    """

    dense_s: float
    cached_s: float
    samples: int          # calls x repeats behind each median
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None

    @classmethod
    def paired(cls, dense_s: Sequence[float], cached_s: Sequence[float]) -> "PhaseTiming":
        """From each call's dense and cached seconds, in the same order (call i ran both)."""
        if len(dense_s) != len(cached_s) or not dense_s:
            raise ValueError(f"paired timings need as many dense as cached samples (and some), "
                             f"got {len(dense_s)} and {len(cached_s)}")
        ratio, low, high = median_interval([d / c for d, c in zip(dense_s, cached_s)])
        return cls(statistics.median(dense_s), statistics.median(cached_s), len(dense_s), ratio, low, high)

    @property
    def speedup(self) -> float:
        """The paired ratio where it was recorded, else the ratio of the medians."""
        return self.ratio if self.ratio is not None else self.dense_s / self.cached_s

    @property
    def shown_faster(self) -> bool:
        """Faster than dense beyond the timing's noise: the interval's lower end above 1.0 (without
        an interval, too few calls or an older record: the point figure above 1.0)."""
        return self.ratio_low > 1.0 if self.ratio_low is not None else self.speedup > 1.0

    def describe(self) -> str:
        """``1.07x`` and, where there is one, its interval: ``1.07x (95 % interval 1.05-1.11)``."""
        if self.ratio_low is None or self.ratio_high is None:
            return f"{self.speedup:.2f}x"
        return f"{self.speedup:.2f}x (95 % interval {self.ratio_low:.2f}-{self.ratio_high:.2f})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup}


@dataclass(frozen=True)
class HalfTiming:
    """Each half timed against dense on one machine, for one model, at the repository's ratios."""

    context_cache: PhaseTiming   # prefill: dense vs Context Cache at ``rho_p``
    action_cache: PhaseTiming    # denoise: dense vs Action Cache at ``rho_n``
    device: str
    threads: int
    dtype: str
    rho_p: float
    rho_n: float
    calls: int
    repeats: int

    def speedup(self, half: str) -> float:
        return getattr(self, half).speedup

    def as_dict(self) -> dict[str, Any]:
        return {"context_cache": self.context_cache.as_dict(), "action_cache": self.action_cache.as_dict(),
                "device": self.device, "threads": self.threads, "dtype": self.dtype, "rho_p": self.rho_p,
                "rho_n": self.rho_n, "calls": self.calls, "repeats": self.repeats}

    def describe(self) -> str:
        parts = [f"{h.replace('_', ' ')} {PHASE_OF[h]} {1e3 * getattr(self, h).dense_s:.2f} -> "
                 f"{1e3 * getattr(self, h).cached_s:.2f} ms ({getattr(self, h).describe()})" for h in HALVES]
        return (", ".join(parts) + f"; measured on {self.device}, {self.threads} thread(s), {self.dtype}, "
                f"rho_p {self.rho_p:g}, rho_n {self.rho_n:g}, {self.calls} call(s) x {self.repeats}")

    @classmethod
    def from_dict(cls, d: object, where: str = "half_timing") -> "HalfTiming":
        """Read back a recorded timing; ValueError naming the field at fault."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: must be an object, got {type(d).__name__}")

        def number(obj: dict, key: str, path: str, positive: bool = True) -> float:
            v = obj.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
                raise ValueError(f"{where}.{path}: must be a {'positive ' if positive else ''}number, got {v!r}")
            return v

        phases = {}
        for h in HALVES:
            p = d.get(h)
            if not isinstance(p, dict):
                raise ValueError(f"{where}.{h}: must be an object with dense_s, cached_s, samples")
            ratios = {k: (float(number(p, k, f"{h}.{k}")) if p.get(k) is not None else None)
                      for k in ("ratio", "ratio_low", "ratio_high")}
            low, mid, high = ratios["ratio_low"], ratios["ratio"], ratios["ratio_high"]
            if (low is None) != (high is None) or (low is not None and (mid is None or not low <= mid <= high)):
                raise ValueError(f"{where}.{h}: ratio_low <= ratio <= ratio_high must hold (both bounds or neither), "
                                 f"got {low!r}, {mid!r}, {high!r}")
            phases[h] = PhaseTiming(float(number(p, "dense_s", f"{h}.dense_s")),
                                    float(number(p, "cached_s", f"{h}.cached_s")),
                                    int(number(p, "samples", f"{h}.samples")), mid, low, high)
        for key in ("device", "dtype"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ValueError(f"{where}.{key}: must be a non-empty string, got {d.get(key)!r}")
        return cls(phases["context_cache"], phases["action_cache"], d["device"], int(number(d, "threads", "threads")),
                   d["dtype"], float(number(d, "rho_p", "rho_p")), float(number(d, "rho_n", "rho_n")),
                   int(number(d, "calls", "calls")), int(number(d, "repeats", "repeats")))


def choose_rho_p(given: float | None, timing: HalfTiming | None) -> tuple[float, str]:
    """The Context Cache's recompute fraction, and where it came from (for the start-up line).

    A fraction given (the profile's ``cache.rho_p``, a command's ``--rho-p``) is used as it is.
    Left unset, the runtime takes the one ``build-cache --profile`` timed the halves at: the
    cheapest ratio within the build's deviation tolerance on its held-out episodes (or the default,
    when profiling chose none), so that ``auto`` decides each half at the very ratio it then runs.
    Measured on the demo robot (``pi05-small``, three processes): 1.42x per call at the profiled
    0.2 against 1.26x at the default 0.4 (docs/cache.md)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0.0 < given <= 1.0:
            raise ValueError(f"rho_p must be in (0, 1], got {given!r}")
        return float(given), "given"
    if timing is not None:
        return timing.rho_p, "the repository's profiling"
    return DEFAULT_RHO_P, "the default: the repository was built without --profile"


@dataclass(frozen=True)
class ResolvedHalves:
    """What the runtime runs, and why (logged at start-up, carried to diagnostics)."""

    context_cache: bool
    action_cache: bool
    reason: str
    # What the running halves save a call by the recorded timing (seconds: each one's dense minus
    # cached median), where ``auto`` chose every half that runs; None where a half is forced on,
    # unmeasured, or none runs. The vision stage weighs it against what choosing a reference
    # costs the call (``selection_budget.SelectionBudget``), which the halves' timing does not see.
    saving_s: float | None = None

    @property
    def dense(self) -> bool:
        """Neither half runs: every call computes densely whatever reference it is handed."""
        return not (self.context_cache or self.action_cache)


def resolve_halves(context_cache: str, action_cache: str, timing: HalfTiming | None,
                   rho_p: float | None = None) -> ResolvedHalves:
    """Each half from its setting: ``on``/``off`` force it; ``auto`` runs it only where the
    repository's recorded timing showed it faster than dense: the lower end of the paired ratio's
    95 % interval above 1.0 (``PhaseTiming.shown_faster``; a record without one: its figure).

    ``auto`` with no recorded timing (a repository built before the timing existed, or without
    ``--profile``) runs the half, marked *unmeasured*: that is what such a repository did before,
    so upgrading never turns a working cache off silently, and the halves' FLOP savings are real
    at the widths the cache is for (full pi0.5); the start-up line says to rebuild with
    ``--profile`` to let the machine decide. ``rho_p`` (the profile's) is compared with the one the
    Context Cache was timed at, so a reader of the reason knows when the figure is for other ratios.
    """
    settings = {"context_cache": parse_setting(context_cache, "cache.context_cache"),
                "action_cache": parse_setting(action_cache, "cache.action_cache")}
    run: dict[str, bool] = {}
    why: list[str] = []
    for half, setting in settings.items():
        name = half.replace("_", " ")
        if setting != "auto":
            run[half] = setting == "on"
            why.append(f"{name} {setting} (forced by the profile)")
        elif timing is None:
            run[half] = True
            why.append(f"{name} on (auto, unmeasured: the repository records no half timing; rebuild it with "
                       f"build-cache --profile to let this machine decide)")
        else:
            t: PhaseTiming = getattr(timing, half)
            run[half] = t.shown_faster
            verdict = "faster" if run[half] else ("of dense, not faster" if t.ratio_low is None
                                                  else "of dense, not shown faster")
            why.append(f"{name} {'on' if run[half] else 'off'} "
                       f"(auto: {PHASE_OF[half]} measured {t.describe()} {verdict})")
    reason = "; ".join(why)
    if timing is not None and any(s == "auto" for s in settings.values()):
        reason += f" [{timing.describe()}]"
        if rho_p is not None and settings["context_cache"] == "auto" and not math.isclose(rho_p, timing.rho_p):
            reason += f" [the profile runs rho_p {rho_p:g}, the Context Cache was timed at {timing.rho_p:g}]"
    if not (run["context_cache"] or run["action_cache"]):
        reason = "both halves off, the cache is effectively dense: " + reason
    running = [h for h in HALVES if run[h]]
    saving_s = None
    if timing is not None and running and all(settings[h] == "auto" for h in running):
        saving_s = sum(getattr(timing, h).dense_s - getattr(timing, h).cached_s for h in running)
    return ResolvedHalves(run["context_cache"], run["action_cache"], reason, saving_s)
