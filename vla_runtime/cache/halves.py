"""Which halves of the cache pay on this machine: the recorded timing, and the profile's choice.

The Context Cache (prefill) and the Action Cache (denoising) save FLOPs, but whether a FLOP saved
is a millisecond saved depends on the model's width and the machine: at the demo policy's size on
a 2-core CPU the gathers and scatters can cost more than the FFN rows they skip. So
``build-cache --profile`` times each half against dense on the machine it runs on and records a
``HalfTiming`` in the repository; the robot profile's ``cache.context_cache`` /
``cache.action_cache`` say ``auto`` (run a half only where it was measured faster), ``on`` or
``off`` (forced). ``resolve_halves`` is that decision, kept pure so it is tested directly.

No torch here: the repository's schema check and the profile's validation both read this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class PhaseTiming:
    """Median seconds of one phase, dense and with one half of the cache, over the same calls."""

    dense_s: float
    cached_s: float
    samples: int          # calls x repeats behind each median

    @property
    def speedup(self) -> float:
        return self.dense_s / self.cached_s

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
                 f"{1e3 * getattr(self, h).cached_s:.2f} ms ({self.speedup(h):.2f}x)" for h in HALVES]
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
            phases[h] = PhaseTiming(float(number(p, "dense_s", f"{h}.dense_s")),
                                    float(number(p, "cached_s", f"{h}.cached_s")),
                                    int(number(p, "samples", f"{h}.samples")))
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

    @property
    def dense(self) -> bool:
        """Neither half runs: every call computes densely whatever reference it is handed."""
        return not (self.context_cache or self.action_cache)


def resolve_halves(context_cache: str, action_cache: str, timing: HalfTiming | None,
                   rho_p: float | None = None) -> ResolvedHalves:
    """Each half from its setting: ``on``/``off`` force it; ``auto`` runs it only where the
    repository's recorded timing measured it faster than dense (speed-up > 1.0).

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
            s = timing.speedup(half)
            run[half] = s > 1.0
            why.append(f"{name} {'on' if run[half] else 'off'} (auto: {PHASE_OF[half]} measured {s:.2f}x "
                       f"{'faster' if s > 1.0 else 'of dense, not faster'})")
    reason = "; ".join(why)
    if timing is not None and any(s == "auto" for s in settings.values()):
        reason += f" [{timing.describe()}]"
        if rho_p is not None and settings["context_cache"] == "auto" and not math.isclose(rho_p, timing.rho_p):
            reason += f" [the profile runs rho_p {rho_p:g}, the Context Cache was timed at {timing.rho_p:g}]"
    if not (run["context_cache"] or run["action_cache"]):
        reason = "both halves off, the cache is effectively dense: " + reason
    return ResolvedHalves(run["context_cache"], run["action_cache"], reason)
