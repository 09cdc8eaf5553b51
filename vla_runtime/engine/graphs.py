"""Captured phases: record a phase once per static shape, then replay it with new inputs.

A CUDA graph replays the kernels it recorded on the *same* memory: whatever a phase reads must
be in buffers that exist at capture time and are refilled before each replay, and whatever it
writes is read back from the buffers it wrote at capture. The engine therefore captures each
phase as a closure over static buffers (``StaticPhase``): the closure, and every Python object
it built (a Context Cache, an Action Cache, a ``Prefix``), is made once, at capture; a replay only
copies new inputs into the static tensors and re-runs the recording.

Two backends share that contract. ``cuda`` records a ``torch.cuda.CUDAGraph`` (warm-up on a side
stream first, as capture requires). ``eager`` keeps the closure and calls it again at replay:
it has no speed benefit, but the same objects are reused exactly as a graph would reuse its
recorded pointers, so on a CPU the tests can check that every input goes through the static
buffers (an input that bypasses them would give the captured call's result, not the new one).

Shapes are static per graph: a phase is captured per key (prefix length, camera layout, whether
a reference is used, ...), and ``GraphCache`` keeps the most recent few.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Literal

import torch
from torch import Tensor

Backend = Literal["cuda", "eager"]


class StaticPhase:
    """One phase captured over static buffers; ``replay()`` re-runs it and returns its outputs."""

    def __init__(self, fn: Callable[[], Tensor | tuple[Tensor, ...]], backend: Backend, device: torch.device):
        self.backend = backend
        self._fn = fn
        if backend == "eager":
            self.out = fn()
            return
        if backend != "cuda":
            raise ValueError(f"graph backend must be 'cuda' or 'eager', got {backend!r}")
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use the 'eager' backend (tests) or no graphs")
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):      # warm-up outside the graph (lazy inits, autotuning)
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def replay(self) -> Tensor | tuple[Tensor, ...]:
        if self.backend == "eager":
            self.out = self._fn()
        else:
            self.graph.replay()
        return self.out


class GraphCache:
    """The captured phases of one engine, by key, least recently used dropped beyond ``capacity``
    (each graph holds its own memory pool; prompts of a few lengths are the common case)."""

    def __init__(self, backend: Backend, device: torch.device, capacity: int = 8):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.backend, self.device, self.capacity = backend, device, capacity
        self._phases: OrderedDict[Hashable, StaticPhase] = OrderedDict()
        self.captures = 0

    def get(self, key: Hashable, build: Callable[[], Callable[[], Tensor | tuple[Tensor, ...]]]) -> StaticPhase:
        """The phase for ``key``; ``build()`` makes its closure (over static buffers) when new."""
        phase = self._phases.get(key)
        if phase is not None:
            self._phases.move_to_end(key)
            return phase
        phase = StaticPhase(build(), self.backend, self.device)
        self.captures += 1
        self._phases[key] = phase
        if len(self._phases) > self.capacity:
            self._phases.popitem(last=False)
        return phase

    def __len__(self) -> int:
        return len(self._phases)

    def clear(self) -> None:
        self._phases.clear()
