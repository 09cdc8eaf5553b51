"""Per-phase wall-clock timing that is honest on a GPU (synchronises before reading the clock)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of one policy call."""

    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, float]:
        return {**self.seconds, "total": self.total}


class PhaseTimer:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.times = PhaseTimes()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times.seconds[name] = self.times.seconds.get(name, 0.0) + time.perf_counter() - t0


def summarize(values: list[float], quantiles: tuple[float, ...] = (0.5, 0.9)) -> dict[str, float | int | None]:
    """Count, mean, the given quantiles (keys ``p50``, ``p90``, ...) and maximum of a list of
    timings, for JSON reports; every statistic is None when there is nothing to summarise."""
    arr = np.asarray(values, dtype=np.float64)
    qs = {f"p{round(100 * q)}": (float(np.quantile(arr, q)) if arr.size else None) for q in quantiles}
    if not arr.size:
        return {"n": 0, "mean": None, **qs, "max": None}
    return {"n": int(arr.size), "mean": float(arr.mean()), **qs, "max": float(arr.max())}


def gemm_gflops(n: int, dtype: torch.dtype, device: str, repeats: int = 3) -> float:
    """Throughput of a large square matmul: the practical ceiling for this machine and dtype."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
