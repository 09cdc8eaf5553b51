"""The pipeline without ROS: the three stages in one process, or in three processes.

``LocalPipeline`` passes the notes by direct calls (tests, benchmarks, replay).
``ProcessPipeline`` runs each stage in its own OS process, as the nodes do, with the notes on
``multiprocessing`` pipes instead of ROS topics; the tensors go through the same shared-memory
rings either way. Both answer ``call(images, state, task)`` with a ``ChunkResult`` and are what
``vla-runtime run`` drives.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.policy import Pi05Policy
from .profile import CacheSpec, EngineSpec
from .stages import (CacheStage, ChunkResult, PolicyStage, PrefixRequestNote, QueryNote, RingNames, VisionStage,
                     cache_config, load_policy, open_repository_meta)
from .workers import ReferenceChoice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSpec:
    """What every stage needs to start: the model, the cameras, the cache, the shared memory."""

    checkpoint: Path
    cameras: tuple[str, ...]
    cache: CacheSpec = field(default_factory=CacheSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    rings: RingNames = field(default_factory=RingNames)
    seed: int = 0
    ring_slots: int = 4
    arm_slices: tuple[tuple[int, int], ...] = ()
    time_available_s: float | None = None  # the working set's rebuild budget per call (None: the manager's default)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if not self.cameras:
            raise ValueError("at least one camera name is needed")
        if not 2 <= self.ring_slots <= 64:
            raise ValueError(f"ring_slots must be in [2, 64], got {self.ring_slots}")

    def load_policy(self) -> Pi05Policy:
        return load_policy(self.checkpoint, self.engine, self.cameras)


class LocalPipeline:
    """All three stages in this process, sharing one model (they never run at the same time)."""

    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        policy = spec.load_policy()
        cc = cache_config(spec.cache, open_repository_meta(spec.cache, policy))
        self.vision = VisionStage(policy, spec.rings, spec.ring_slots, cc)
        try:
            self.cache = CacheStage(policy, spec.cache, spec.rings, spec.arm_slices) if cc is not None else None
            self.policy = PolicyStage(policy, spec.rings, cc, spec.seed)
        except BaseException:
            self.vision.close()
            raise
        self._seq = 0
        self.last_choice: ReferenceChoice | None = None
        self.last_times: dict[str, float] = {}

    def call(self, images: dict[str, np.ndarray], state: np.ndarray, task: str, start_tick: int = 0) -> ChunkResult:
        req = PrefixRequestNote(self._seq, start_tick, tuple(float(x) for x in np.asarray(state).reshape(-1)), task)
        self._seq += 1
        ask = self.cache.answer if self.cache is not None and self.cache.enabled else None
        note = self.vision.encode(req, images, ask)
        self.last_choice = self.vision.last_choice
        t0 = time.perf_counter()
        result = self.policy.act(note)
        self.last_times = {**self.vision.last_timer.times.seconds, "denoise": time.perf_counter() - t0}
        if result is None:   # cannot happen in one process: nothing writes between the two stages
            raise RuntimeError(f"prefix slot {note.slot} overwritten before it was read")
        if self.cache is not None:
            self.cache.upkeep(self.spec.time_available_s)
        return result

    def close(self) -> None:
        for stage in (self.policy, self.cache, self.vision):
            if stage is not None:
                stage.close()

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------- three processes

_STOP = "stop"


def _serve(name: str, spec: PipelineSpec, ready: Connection, body) -> None:
    """A stage process: report start-up (or the error that prevented it), then run ``body``."""
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    try:
        policy = spec.load_policy()
        stage_loop = body(policy)
    except BaseException as e:  # noqa: BLE001  # the parent shows it; the process exits non-zero
        ready.send(("error", f"{name}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    ready.send(("ready", name))
    stage_loop()


def _vision_main(spec: PipelineSpec, ready: Connection, requests: Connection, to_cache: Connection | None,
                 to_policy: Connection) -> None:
    def body(policy: Pi05Policy):
        cc = cache_config(spec.cache, open_repository_meta(spec.cache, policy)) if to_cache is not None else None
        stage = VisionStage(policy, spec.rings, spec.ring_slots, cc)

        def ask(q: QueryNote) -> ReferenceChoice | None:
            try:
                to_cache.send(q)
                deadline = time.monotonic() + spec.cache.reference_timeout_s
                while to_cache.poll(max(0.0, deadline - time.monotonic())):
                    choice = to_cache.recv()
                    if choice.request_seq == q.request_seq:   # late answers to earlier queries are dropped
                        return choice
            except (OSError, EOFError) as e:   # the cache manager is gone: this call runs dense
                log.warning("cache manager unreachable (%s): call %d runs dense", e, q.request_seq)
                return None
            log.warning("no reference for call %d within %.3f s: dense", q.request_seq, spec.cache.reference_timeout_s)
            return None

        def loop() -> None:
            try:
                while (msg := requests.recv()) != _STOP:
                    req, images = msg
                    try:
                        note = stage.encode(req, images, ask if to_cache is not None else None)
                        to_policy.send(("slot", note, stage.last_choice, dict(stage.last_timer.times.seconds)))
                    except ValueError as e:   # a bad observation: reported, the stage stays up
                        to_policy.send(("refused", req.request_seq, str(e)))
            finally:
                for conn in (to_cache, to_policy):
                    try:
                        if conn is not None:
                            conn.send(_STOP)
                    except (OSError, EOFError):
                        pass
                stage.close()
        return loop
    _serve("vision", spec, ready, body)


def _cache_main(spec: PipelineSpec, ready: Connection, queries: Connection) -> None:
    def body(policy: Pi05Policy):
        stage = CacheStage(policy, spec.cache, spec.rings, spec.arm_slices)

        def loop() -> None:
            try:
                while (q := queries.recv()) != _STOP:
                    queries.send(stage.answer(q))
                    stage.upkeep(spec.time_available_s)   # while the other stages finish the call
            finally:
                stage.close()
        return loop
    _serve("cache", spec, ready, body)


def _policy_main(spec: PipelineSpec, ready: Connection, slots: Connection, results: Connection) -> None:
    def body(policy: Pi05Policy):
        stage = PolicyStage(policy, spec.rings, cache_config(spec.cache, open_repository_meta(spec.cache, policy)),
                            spec.seed)

        def loop() -> None:
            try:
                while (msg := slots.recv()) != _STOP:
                    if msg[0] == "refused":
                        results.send(msg)
                        continue
                    _, note, choice, times = msg
                    t0 = time.perf_counter()
                    res = stage.act(note)
                    times = {**times, "denoise": time.perf_counter() - t0}
                    results.send(("chunk", res, choice, times) if res is not None else
                                 ("refused", -1, f"slot {note.slot} overwritten before it was read"))
            finally:
                stage.close()
        return loop
    _serve("policy", spec, ready, body)


class ProcessPipeline:
    """The three stages as three OS processes (the nodes' deployment, without ROS)."""

    def __init__(self, spec: PipelineSpec, start_timeout_s: float = 300.0):
        self.spec = spec
        ctx = mp.get_context("spawn")   # a fresh interpreter per stage, like a node process
        cached = spec.cache.enabled
        self._requests, vision_requests = ctx.Pipe()
        vision_slots, policy_slots = ctx.Pipe()
        policy_results, self._results = ctx.Pipe()
        vision_cache, cache_queries = ctx.Pipe() if cached else (None, None)
        readies = []

        def start(target, *args) -> mp.Process:
            mine, theirs = ctx.Pipe()
            readies.append((target.__name__.strip("_").removesuffix("_main"), mine))
            p = ctx.Process(target=target, args=(spec, theirs, *args), daemon=True)
            p.start()
            return p

        self.processes = {"vision": start(_vision_main, vision_requests, vision_cache, vision_slots),
                          "policy": start(_policy_main, policy_slots, policy_results)}
        if cached:
            self.processes["cache"] = start(_cache_main, cache_queries)
        self._seq = 0
        self.last_choice: ReferenceChoice | None = None
        self.last_times: dict[str, float] = {}
        deadline = time.monotonic() + start_timeout_s
        try:
            for name, conn in readies:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"the {name} stage did not start within {start_timeout_s:g} s")
                try:
                    kind, what = conn.recv()
                except EOFError:
                    p = self.processes[name]
                    p.join(5.0)
                    raise RuntimeError(f"the {name} stage process exited during start-up (exit code "
                                       f"{p.exitcode})") from None
                if kind == "error":
                    raise RuntimeError(f"stage failed to start: {what}")
        except BaseException:
            self.close()
            raise

    def call(self, images: dict[str, np.ndarray], state: np.ndarray, task: str, start_tick: int = 0,
             timeout_s: float = 600.0) -> ChunkResult:
        req = PrefixRequestNote(self._seq, start_tick, tuple(float(x) for x in np.asarray(state).reshape(-1)), task)
        self._seq += 1
        self._requests.send((req, images))
        if not self._results.poll(timeout_s):
            dead = [n for n, p in self.processes.items() if not p.is_alive()]
            raise TimeoutError(f"no chunk for call {req.request_seq} within {timeout_s:g} s"
                               + (f"; stage process(es) {dead} died" if dead else ""))
        msg = self._results.recv()
        if msg[0] == "refused":
            raise ValueError(f"call {req.request_seq} refused: {msg[2]}")
        _, result, self.last_choice, self.last_times = msg
        return result

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            self._requests.send(_STOP)
        except (OSError, BrokenPipeError):
            pass
        for p in self.processes.values():
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(timeout_s)

    def __enter__(self) -> "ProcessPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_pipeline(spec: PipelineSpec, processes: int = 1) -> LocalPipeline | ProcessPipeline:
    if processes not in (1, 3):
        raise ValueError(f"processes must be 1 (all stages here) or 3 (one per stage), got {processes}")
    return LocalPipeline(spec) if processes == 1 else ProcessPipeline(spec)

