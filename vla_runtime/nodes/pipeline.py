"""The pipeline without ROS: the three stages in one process, or in three processes.

``LocalPipeline`` passes the notes by direct calls (tests, benchmarks, replay).
``ProcessPipeline`` runs each stage in its own OS process, as the nodes do, with the notes on
``multiprocessing`` pipes (routed by the parent, so a stage can be killed and restarted) instead
of ROS topics; the tensors go through the same shared-memory
rings either way. Both answer ``call(images, state, task)`` with a ``ChunkResult`` and are what
``vla-runtime run`` drives.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.selector import Selection
from ..engine.policy import Pi05Policy
from ..ipc.ring import RingBufferError
from ..models.parts import weight_bytes
from .priority import background_priority
from .profile import CacheSpec, EngineSpec
from .stages import (CacheStage, ChunkResult, PolicyStage, PrefixRequestNote, RingNames, VisionStage, cache_config,
                     episode_noise_key, load_policy, open_repository_meta)
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
    episode_ready_s: float = 10.0  # start_episode waits this long at most for the initial window (a robot's reset)
    state_dim: int | None = None   # the profile's joints: the checkpoint must have as many state/action dims

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        if not self.cameras:
            raise ValueError("at least one camera name is needed")
        if not 2 <= self.ring_slots <= 64:
            raise ValueError(f"ring_slots must be in [2, 64], got {self.ring_slots}")

    def load_policy(self, role: str | None = None) -> Pi05Policy:
        """The model for one stage process (``role``: only the parts it runs, when
        ``engine.weights_per_role``) or for all stages in one process (None: everything)."""
        return load_policy(self.checkpoint, self.engine, self.cameras, self.state_dim, role)


class RequestNumbering:
    """Numbers a pipeline's calls and episodes, as the policy node does on a robot.

    Calls are numbered across episodes (``request_seq``) and draw the noise stream of that
    number. An episode started with a ``noise_seed`` draws ``episode_noise_key(noise_seed, call)``
    instead: two pipelines running the same seeded episodes (dense and cached in ``eval``) then
    denoise from the same noise at the same call, whatever else each ran before."""

    def __init__(self) -> None:
        self.seq = 0
        self.episode = 0
        self._noise_seed: int | None = None
        self._call = 0   # calls in this episode

    def start_episode(self, noise_seed: int | None = None) -> None:
        if noise_seed is not None:
            episode_noise_key(noise_seed, 0)   # refuses a bad seed now, not at the first call
        self.episode += 1
        self._noise_seed, self._call = noise_seed, 0

    def request(self, state: np.ndarray, task: str, start_tick: int) -> PrefixRequestNote:
        key = None if self._noise_seed is None else episode_noise_key(self._noise_seed, self._call)
        req = PrefixRequestNote(self.seq, start_tick, tuple(float(x) for x in np.asarray(state).reshape(-1)), task,
                                self.episode, key)
        self.seq += 1
        self._call += 1
        return req


class LocalPipeline:
    """All three stages in this process, sharing one model (they never run at the same time)."""

    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        policy = spec.load_policy()
        self.vision = VisionStage(policy, spec.rings, spec.ring_slots, spec.cache, spec.arm_slices)
        cc = self.vision.worker.cache   # resolved once (repository index, halves), shared by the stages here
        try:
            self.cache = CacheStage(policy, spec.cache, spec.rings, spec.arm_slices) \
                if cc is not None and not cc.dense else None
            self.policy = PolicyStage(policy, spec.rings, cc, spec.seed)
        except BaseException:
            self.vision.close()
            raise
        self.numbering = RequestNumbering()
        self.last_choice: ReferenceChoice | None = None
        self.last_times: dict[str, float] = {}
        self.last_episode_start_s = 0.0

    @property
    def episode(self) -> int:
        return self.numbering.episode

    def start_episode(self, task: str | None = None, noise_seed: int | None = None) -> None:
        """The next call starts a new episode (the same task again, e.g. a new object pose).
        With ``task`` the cache manager prepares it now (``last_episode_start_s``), as it does on
        a robot while the arm resets, instead of inside the episode's first call. With
        ``noise_seed`` the episode's noise depends on that seed only (``RequestNumbering``)."""
        self.numbering.start_episode(noise_seed)
        t0 = time.perf_counter()
        if task and self.cache is not None:
            self.cache.begin(task, self.episode)
        self.last_episode_start_s = time.perf_counter() - t0

    def call(self, images: dict[str, np.ndarray], state: np.ndarray, task: str, start_tick: int = 0) -> ChunkResult:
        req = self.numbering.request(state, task, start_tick)
        note = self.vision.encode(req, images)
        self.last_choice = self.vision.last_choice
        if self.cache is not None and self.vision.last_selection is not None:
            self.cache.follow(self.vision.last_selection)
        t0 = time.perf_counter()
        result = self.policy.act(note)
        self.last_times = {**self.vision.last_timer.times.seconds, "denoise": time.perf_counter() - t0}
        if result is None:   # cannot happen in one process: nothing writes between the two stages
            raise RuntimeError(f"prefix slot {note.slot} overwritten before it was read")
        if self.cache is not None:   # in one process the upkeep is serial; on a robot it overlaps execution
            t1 = time.perf_counter()
            self.cache.upkeep(self.spec.time_available_s)
            self.last_times["upkeep"] = time.perf_counter() - t1
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
IDLE_POLL_S = 0.005   # the vision stage's idle work (taking in window changes) between calls, this often


@dataclass(frozen=True)
class StageWeights:
    """The model parts a stage process holds and their weight bytes (``models.parts``)."""

    stage: str
    parts: tuple[str, ...]
    nbytes: int


class StageDied(RuntimeError):
    """A stage process died during a call (the call is lost; ``ProcessPipeline.restart`` it)."""


def _serve(name: str, spec: PipelineSpec, conn: Connection, body) -> None:
    """A stage process: report start-up (or the error that prevented it), then run ``body``."""
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    try:
        policy = spec.load_policy(role=name)
        stage_loop = body(policy)
    except BaseException as e:  # noqa: BLE001  # the parent shows it; the process exits non-zero
        conn.send(("error", f"{name}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    model = policy.engine.model
    conn.send(("ready", StageWeights(name, tuple(sorted(p.value for p in model.parts)), weight_bytes(model))))
    stage_loop()


def _vision_main(spec: PipelineSpec, conn: Connection) -> None:
    def body(policy: Pi05Policy):
        stage = VisionStage(policy, spec.rings, spec.ring_slots, spec.cache if spec.cache.enabled else None,
                            spec.arm_slices)

        def next_message():
            if stage.selector is not None:   # gaps between calls take in the window's changes
                while not conn.poll(IDLE_POLL_S):
                    stage.idle()
            return conn.recv()

        def loop() -> None:
            try:
                while (msg := next_message()) != _STOP:
                    _, req, images = msg
                    # the call's reference as soon as it is chosen: the policy gathers ahead of the slot
                    stage.ahead = lambda note, seq=req.request_seq: conn.send(("ahead", seq, note))
                    try:
                        note = stage.encode(req, images)
                        conn.send(("slot", req.request_seq, note, stage.last_choice, stage.last_selection,
                                   dict(stage.last_timer.times.seconds)))
                    except ValueError as e:   # a bad observation: reported, the stage stays up
                        conn.send(("refused", req.request_seq, str(e)))
            finally:
                stage.close()
        return loop
    _serve("vision", spec, conn, body)


def _cache_main(spec: PipelineSpec, conn: Connection) -> None:
    def body(policy: Pi05Policy):
        background_priority(spec.cache.background_nice)
        stage = CacheStage(policy, spec.cache, spec.rings, spec.arm_slices)

        def loop() -> None:
            try:
                while (msg := conn.recv()) != _STOP:
                    if msg[0] == "begin":   # an episode announced ahead of its first call
                        stage.begin(msg[1], msg[2])
                        conn.send(("begun", msg[2]))
                    else:                   # what a call selected: slide the window while it executes
                        stage.follow(msg[1])
                        stage.upkeep(spec.time_available_s)
            finally:
                stage.close()
        return loop
    _serve("cache", spec, conn, body)


def _policy_main(spec: PipelineSpec, conn: Connection) -> None:
    def body(policy: Pi05Policy):
        stage = PolicyStage(policy, spec.rings, cache_config(spec.cache, open_repository_meta(spec.cache, policy)),
                            spec.seed)

        def loop() -> None:
            try:
                while (msg := conn.recv()) != _STOP:
                    kind, seq, note = msg
                    if kind == "ahead":   # the coming call's reference, while its prefill runs
                        stage.gather_ahead(note)
                        continue
                    t0 = time.perf_counter()
                    try:
                        res = stage.act(note)
                    except (RingBufferError, ValueError, OSError) as e:   # a refused slot: reported, no chunk
                        conn.send(("refused", seq, f"slot {note.slot} of ring {note.ring!r} unusable: {e}"))
                        continue
                    conn.send(("chunk", seq, res, time.perf_counter() - t0) if res is not None else
                              ("refused", seq, f"slot {note.slot} overwritten before it was read"))
            finally:
                stage.close()
        return loop
    _serve("policy", spec, conn, body)


_MAINS = {"vision": _vision_main, "policy": _policy_main, "cache": _cache_main}


@dataclass
class _SlotMessage:
    """What the vision stage sent with a call's slot, besides the slot itself."""

    choice: ReferenceChoice | None = None
    selection: Selection | None = None
    times: dict[str, float] = field(default_factory=dict)


class ProcessPipeline:
    """The three stages as three OS processes (the nodes' deployment, without ROS).

    This process routes the notes (one pipe per stage, like one ROS connection per node), so a
    stage can die and be started again while the others keep their state and shared memory:
    ``kill`` and ``restart`` do that on purpose (fault tests). A call whose stage died raises
    ``StageDied``; a dead (or stopped) cache manager only means that no new entries are prepared:
    the vision stage selects from the window already published and never waits. Results of a call that timed out are dropped when they come late,
    never handed to a later call.
    """

    def __init__(self, spec: PipelineSpec, start_timeout_s: float = 300.0):
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")   # a fresh interpreter per stage, like a node process
        self.processes: dict[str, mp.Process] = {}
        self.conns: dict[str, Connection | None] = {}
        self.numbering = RequestNumbering()
        self.last_choice: ReferenceChoice | None = None
        self.last_times: dict[str, float] = {}
        self.last_episode_start_s = 0.0   # how long the last start_episode waited for the initial window
        self.weights: dict[str, StageWeights] = {}   # what each stage process holds, said at start-up
        names = ("vision", "policy") + (("cache",) if spec.cache.enabled else ())
        try:
            for name in names:
                self._spawn(name)
            for name in names:
                self._wait_ready(name)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ stage processes
    def _spawn(self, name: str) -> None:
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(target=_MAINS[name], args=(self.spec, theirs), daemon=True, name=f"vla-{name}")
        p.start()
        theirs.close()   # only the child holds its end: its death reads as EOF here
        self.processes[name], self.conns[name] = p, mine

    def _wait_ready(self, name: str) -> None:
        conn, p = self.conns[name], self.processes[name]
        if not conn.poll(self.start_timeout_s):
            raise TimeoutError(f"the {name} stage did not start within {self.start_timeout_s:g} s")
        try:
            kind, what = conn.recv()
        except EOFError:
            p.join(5.0)
            raise RuntimeError(f"the {name} stage process exited during start-up (exit code {p.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"stage failed to start: {what}")
        self.weights[name] = what

    def alive(self, name: str) -> bool:
        return self.conns.get(name) is not None and self.processes[name].is_alive()

    def kill(self, name: str) -> None:
        """SIGKILL one stage process (a crash: it cleans nothing up) and forget its pipe."""
        p = self.processes[name]
        p.kill()
        p.join(10.0)
        self._lost(name)

    def restart(self, name: str) -> None:
        """Start a stage again (killed first if it still runs); it re-creates its shared memory
        (replacing the dead writer's segments) and the other stages re-attach on their next read."""
        if self.processes[name].is_alive():
            self.kill(name)
        self._lost(name)
        self._spawn(name)
        try:
            self._wait_ready(name)
        except BaseException:
            self.kill(name)
            raise

    def _lost(self, name: str) -> None:
        conn = self.conns.get(name)
        if conn is not None:
            conn.close()
        self.conns[name] = None

    def _send(self, name: str, msg: Any) -> bool:
        conn = self.conns.get(name)
        if conn is None:
            return False
        try:
            conn.send(msg)
            return True
        except (OSError, EOFError):
            self._lost(name)
            return False

    # ------------------------------------------------------------ calls
    @property
    def episode(self) -> int:
        return self.numbering.episode

    def start_episode(self, task: str | None = None, noise_seed: int | None = None) -> None:
        """The next call starts a new episode (the same task again, e.g. a new object pose).
        With ``task`` the cache manager process prepares its initial window now, and this process
        waits for that at most ``spec.episode_ready_s`` (what a robot's reset gives it; measured
        in ``last_episode_start_s``). Calls never wait: one that comes before the window is ready
        runs dense. With ``noise_seed`` the episode's noise depends on that seed only."""
        self.numbering.start_episode(noise_seed)
        self.last_episode_start_s = 0.0
        if not task or not self._send("cache", ("begin", task, self.episode)):
            return
        t0 = time.perf_counter()
        deadline = t0 + self.spec.episode_ready_s
        conn = self.conns["cache"]
        try:
            while conn is not None and conn.poll(max(0.0, deadline - time.perf_counter())):
                if conn.recv() == ("begun", self.episode):
                    break
        except (EOFError, OSError):
            self._lost("cache")
        self.last_episode_start_s = time.perf_counter() - t0

    def call(self, images: dict[str, np.ndarray], state: np.ndarray, task: str, start_tick: int = 0,
             timeout_s: float = 600.0) -> ChunkResult:
        req = self.numbering.request(state, task, start_tick)
        seq = req.request_seq
        if not self._send("vision", ("request", req, images)):
            raise StageDied(f"call {seq}: the vision stage is not running")
        slot = _SlotMessage()
        try:
            return self._await_chunk(seq, timeout_s, slot)
        finally:   # whatever the call's outcome, the window follows what it selected, after it
            self._follow(slot.selection)

    def _await_chunk(self, seq: int, timeout_s: float, slot: _SlotMessage) -> ChunkResult:
        """Route call ``seq``'s notes (vision's slot to the policy) until its chunk comes back, for
        at most ``timeout_s``; ``slot`` keeps what the vision stage said with the slot."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = {c: n for n, c in self.conns.items() if c is not None}
            ready = mp_connection.wait(list(live), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                dead = [n for n, p in self.processes.items() if not p.is_alive()]
                raise TimeoutError(f"no chunk for call {seq} within {timeout_s:g} s"
                                   + (f"; stage process(es) {dead} died" if dead else "; a stage is stalled"))
            for conn in ready:
                name = live[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._lost(name)
                    self.processes[name].join(5.0)
                    if name != "cache":   # a dead cache manager only means dense calls
                        raise StageDied(f"call {seq}: the {name} stage died (exit code "
                                        f"{self.processes[name].exitcode})") from None
                    continue
                kind, about = msg[0], msg[1]
                if kind == "begun" or about != seq:   # late: an episode prepared, or an earlier call's result
                    continue
                elif kind == "refused":
                    raise ValueError(f"call {seq} refused: {msg[2]}")
                elif kind == "ahead":   # the call's reference, chosen before its prefill
                    self._send("policy", msg)
                elif kind == "slot":
                    _, _, note, slot.choice, slot.selection, slot.times = msg
                    if not self._send("policy", ("slot", seq, note)):
                        raise StageDied(f"call {seq}: the policy stage is not running")
                elif kind == "chunk":
                    self.last_choice, self.last_times = slot.choice, {**slot.times, "denoise": msg[3]}
                    return msg[2]

    def _follow(self, selection: Selection | None) -> None:
        """Hand the cache manager what a call selected once the call is over: the window then
        slides (a dense prefill per entering entry) while the robot executes the chunk, not while
        the policy denoises. Work on the other core slows a call's phases through the memory and
        caches they share, however low its CPU priority (docs/cache.md, "Background work")."""
        if selection is not None:
            self._send("cache", ("follow", selection))

    def close(self, timeout_s: float = 10.0) -> None:
        for name in list(self.conns):
            self._send(name, _STOP)
        for name, p in self.processes.items():
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(timeout_s)
            self._lost(name)

    def __enter__(self) -> "ProcessPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_pipeline(spec: PipelineSpec, processes: int = 1) -> LocalPipeline | ProcessPipeline:
    if processes not in (1, 3):
        raise ValueError(f"processes must be 1 (all stages here) or 3 (one per stage), got {processes}")
    return LocalPipeline(spec) if processes == 1 else ProcessPipeline(spec)

