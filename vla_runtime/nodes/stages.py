"""The three stages of the pipeline: a worker plus the shared memory it reads and writes.

A stage is what a node process does, minus how notifications travel: the rclpy nodes, the
ROS-free runner (``pipeline.py``: one process or three) and the tests all drive these classes
and pass the same small notes between them ("slot k holds sequence n", "a query is waiting",
"use entry s"). Bulk tensors only ever move through the rings:

- prefix ring (vision -> policy): every VLM layer's prefix K/V, one slot per call;
- working set (cache manager -> vision, policy): the prepared reference entries, each with the
  retrieval features and joint history selection needs (the vision stage selects there itself,
  and tells the cache manager afterwards what it chose: a ``Selection`` note).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..cache.builder import model_summary
from ..cache.halves import choose_rho_p, resolve_halves
from ..cache.manager import CacheManager, ManagerConfig
from ..cache.repository import ReferenceRepository, RepositoryError
from ..cache.retrieval import RetrievalConfig, fallback_rule, first_call_floors
from ..cache.selection_budget import SelectionBudget
from ..cache.selector import Selection
from ..cache.window import WindowConfig
from ..engine.cached import CacheConfig
from ..engine.policy import Observation, Pi05Policy
from ..engine.timing import PhaseTimer
from ..ipc.layout import SlotLayout
from ..ipc.ring import LayoutMismatchError, RingBuffer, RingBufferError
from ..models.config import preset
from ..models.parts import role_parts
from .call_gate import CallGate
from .devices import cpu_latency_note, measured_cpu_gflops, resolve_device
from .profile import CacheSpec, EngineSpec
from .prefix_ring import DEFAULT_RING, prefix_layout
from .selection import BesideTower, Choice, WindowSelector
from .workers import (CacheWorker, PolicyWorker, PrefixMeta, PrefixSlotSpec, ReferenceChoice, VisionWorker)
from .working_set import (DEFAULT_WORKING_SET, SharedEntryStore, current_ring, pin_entry, window_state,
                          working_set_layout)

log = logging.getLogger(__name__)

MAX_STATE = 64
EPISODE_CALLS = 100_000   # calls an episode may have under one noise seed (``episode_noise_key``)


# ---------------------------------------------------------------- notes (what ROS messages carry)

@dataclass(frozen=True)
class PrefixRequestNote:
    """policy -> vision: encode the newest images, conditioned on ``state``, for ``start_tick``."""

    request_seq: int
    start_tick: int
    state: tuple[float, ...]
    task: str
    episode: int = 0        # a new number starts a new episode (the cache manager resets)
    noise_key: int | None = None   # the denoising noise stream of this call (None: ``request_seq``)

    @property
    def noise(self) -> int:
        return self.request_seq if self.noise_key is None else self.noise_key


def episode_noise_key(episode_seed: int, call: int) -> int:
    """Noise stream of call ``call`` of the episode seeded ``episode_seed``: two pipelines (dense
    and cached) that run the same seeded episode draw the same noise at the same call, whatever
    episodes each ran before, so their success can be compared seed by seed."""
    if episode_seed < 0 or not 0 <= call < EPISODE_CALLS:
        raise ValueError(f"episode seed must be >= 0 and call in [0, {EPISODE_CALLS}), got {episode_seed}, {call}")
    return episode_seed * EPISODE_CALLS + call


@dataclass(frozen=True)
class SlotNote:
    """A payload is ready: ``ring`` slot ``slot`` holds sequence ``seq`` (``layout_tag``: the
    writer's slot layout; a reader expecting another one refuses the note before reading)."""

    ring: str
    slot: int
    seq: int
    layout_tag: str = ""


@dataclass(frozen=True)
class RingNames:
    """Shared-memory names; one set per pipeline (two robots on one machine need two sets)."""

    prefix: str = DEFAULT_RING
    working_set: str = DEFAULT_WORKING_SET

    @classmethod
    def for_namespace(cls, namespace: str) -> "RingNames":
        """The default names of a node in ``namespace``: the plain defaults in the root namespace,
        else suffixed with it (``/robot1/left`` -> ``vla_prefix_robot1_left``)."""
        tag = namespace.strip("/").replace("/", "_")
        return cls() if not tag else cls(f"{DEFAULT_RING}_{tag}", f"{DEFAULT_WORKING_SET}_{tag}")

    @classmethod
    def tagged(cls, tag: str) -> "RingNames":
        """A private set for one run of a tool (``<tag>_prefix``, ``<tag>_refs``)."""
        return cls(f"{tag}_prefix", f"{tag}_refs")


def open_repository_meta(spec: CacheSpec, policy: Pi05Policy) -> ReferenceRepository | None:
    """The repository the profile names, checked against the loaded checkpoint (headers only), or
    None with the reason logged: a refused repository means dense, never a stopped robot."""
    if not spec.enabled or not spec.repository:
        return None
    try:
        return ReferenceRepository.open(spec.repository, expect_checkpoint_hash=policy.checkpoint_hash,
                                        expect_model=model_summary(policy.engine.cfg), verify=False)
    except (RepositoryError, OSError) as e:
        log.warning("muscle-memory cache disabled, running dense: %s", e)
        return None


def cache_config(spec: CacheSpec, repo: ReferenceRepository | None) -> CacheConfig | None:
    """The engine-side cache parameters: rho_p from the profile, or where it leaves it unset the
    one the repository was profiled at (``choose_rho_p``); rho_n and the step groups from the
    repository (its masks were built for them); and which halves run: the profile's auto/on/off
    against the repository's recorded half timing (``resolve_halves``). Logged here, at each
    stage's start-up, and kept as ``CacheConfig.reason`` for diagnostics."""
    if repo is None:
        return None
    rho_p, rho_p_from = choose_rho_p(spec.rho_p, repo.meta.half_timing)
    halves = resolve_halves(spec.context_cache, spec.action_cache, repo.meta.half_timing, rho_p)
    reason = f"rho_p {rho_p:g} ({rho_p_from}); {halves.reason}"
    if halves.saving_s is not None and spec.selection_check_calls:
        reason += (f"; they save {1e3 * halves.saving_s:.2f} ms a call by that timing, weighed against what "
                   f"choosing a reference costs over the first {spec.selection_check_calls} calls")
    log.warning("muscle-memory cache: %s", reason)   # once per stage start-up, seen at the default level
    return CacheConfig(rho_p=rho_p, rho_n=repo.meta.rho_n, groups=tuple(tuple(g) for g in repo.meta.mask_groups),
                       context_cache=halves.context_cache, action_cache=halves.action_cache, reason=reason,
                       saving_s=halves.saving_s)


def manager_config(spec: CacheSpec, repo: ReferenceRepository, arm_slices: tuple[tuple[int, int], ...] = ()) -> ManagerConfig:
    return ManagerConfig(retrieval=RetrievalConfig(history_len=repo.meta.history_len, arm_slices=arm_slices,
                                                   min_similarity=float(spec.min_similarity),
                                                   first_call_floor=first_call_floors(repo) if spec.first_scene_floor
                                                   else {}, max_end_matches=spec.max_end_matches),
                         window=WindowConfig(episodes=spec.episodes, lookahead=spec.lookahead),
                         memory_budget_bytes=spec.memory_budget_mb << 20,
                         reuse_budget_bytes=spec.reuse_budget_mb << 20)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(checkpoint: str | Path, engine: EngineSpec, cameras: Sequence[str],
                state_dim: int | None = None, role: str | None = None,
                control_hz: float | None = None) -> Pi05Policy:
    """The model as the profile's engine section says (dtype, device, threads); ``device: auto``
    takes CUDA when this process sees a GPU, else the CPU with a warning of the latency to expect
    there (``devices.py``; ``control_hz`` puts it next to a chunk's duration). On CPU the nodes map
    one shared file of fused weights instead of holding a copy each (``share_weights``). With a
    pipeline ``role`` ("vision", "policy", "cache") and ``engine.weights_per_role`` the model keeps
    only the parts that role runs (``models.parts.ROLE_PARTS``); without one it keeps everything
    (one process running every stage).

    Refused at start-up (ValueError naming the difference): a checkpoint whose architecture is not
    the profile's ``engine.preset`` (when the profile names one), or whose state/action dimensions
    are not the profile's ``state_dim`` joints (the nodes build the state from those joints and
    send every action column to one of them)."""
    cuda = torch.cuda.is_available()
    device = resolve_device(engine.device, cuda, torch.cuda.device_count() if cuda else 0)
    if engine.threads:
        torch.set_num_threads(engine.threads)
    parts = role_parts(role) if role is not None and engine.weights_per_role else None
    policy = Pi05Policy.from_checkpoint(checkpoint, camera_names=list(cameras), dtype=DTYPES[engine.dtype],
                                        device=device, share_weights=engine.share_weights and device == "cpu",
                                        norm_asset=engine.norm_asset, parts=parts)
    problem = checkpoint_mismatch(policy, engine.preset, state_dim)
    if problem:
        raise ValueError(f"checkpoint {checkpoint} does not match the profile: {problem}")
    if engine.device == "auto" and device == "cpu":
        log.warning(cpu_latency_note(policy.engine.cfg, len(cameras), measured_cpu_gflops(DTYPES[engine.dtype]),
                                     control_hz))
    return policy


def checkpoint_mismatch(policy: Pi05Policy, preset_name: str | None, state_dim: int | None) -> str:
    """What differs between a loaded checkpoint and the profile ('' when nothing does)."""
    out = []
    if preset_name:
        want, have = model_summary(preset(preset_name)), model_summary(policy.engine.cfg)
        diff = [f"{k} {have[k]} (preset {preset_name!r}: {want[k]})" for k in want if have.get(k) != want[k]]
        if diff:
            out.append(f"architecture is not engine.preset {preset_name!r}: " + ", ".join(diff))
    if state_dim is not None:
        if policy.state_dim != state_dim:
            out.append(f"the checkpoint's state has {policy.state_dim} dims, the profile has {state_dim} joints")
        if policy.action_norm.dim != state_dim:
            out.append(f"the checkpoint's actions have {policy.action_norm.dim} dims, the profile has "
                       f"{state_dim} joints")
    return "; ".join(out)


def _current_ring(ring: RingBuffer | None, name: str, layout: SlotLayout) -> RingBuffer:
    """``ring`` if it is still the live ring called ``name``, else a fresh attachment (a restarted
    writer's new segment); raises RingBufferError/OSError when there is none to attach to."""
    if ring is not None and ring.name == name and not ring.superseded():
        return ring
    if ring is not None:
        ring.close()
    return RingBuffer.attach(name, layout)


# ---------------------------------------------------------------- vision

class VisionStage:
    """Images + a prefix request -> a prefix slot, with the Context Cache when the window the
    cache manager publishes holds a similar reference (selected here, never asked for)."""

    def __init__(self, policy: Pi05Policy, rings: RingNames = RingNames(), slots: int = 4,
                 cache: CacheSpec | None = None, arm_slices: tuple[tuple[int, int], ...] = ()):
        repo = open_repository_meta(cache, policy) if cache is not None else None
        cc = cache_config(cache, repo)
        self.worker = VisionWorker(policy, cc)
        self.rings = rings
        self.cache_reason = "cache off" if cc is None else cc.reason   # which halves run and why (diagnostics)
        self.selector: WindowSelector | None = None
        self.beside: BesideTower | None = None   # the selection beside the tower's later layers
        if cc is not None and not cc.dense and repo is not None:
            try:
                self.selector = WindowSelector(repo, manager_config(cache, repo, arm_slices).retrieval,
                                               rings.working_set, cache.first_search_wait_s)
                self.beside = BesideTower()
            except ValueError as e:
                log.warning("muscle-memory cache disabled, running dense: %s", e)
        # auto's halves against what choosing costs the call, measured here where it is paid
        self.budget: SelectionBudget | None = None
        self.budget_reason = ""   # each later call's dense reason, once the budget turned the cache off
        if self.selector is not None and cc.saving_s is not None and cache.selection_check_calls:
            self.budget = SelectionBudget(cc.saving_s, cache.selection_check_calls)
        self.prefix = RingBuffer.create(rings.prefix, prefix_layout(self.worker.spec), slots, replace_stale=True)
        self.last_choice: ReferenceChoice | None = None
        self.last_selection: Selection | None = None
        self.last_timer: PhaseTimer | None = None
        # Where a call's reference is announced as soon as it is chosen, before the prefill (the
        # working-set entry as a SlotNote), so that the policy stage gathers its masks' weights
        # while the prefill runs (``PolicyStage.gather_ahead``); None: nobody listens.
        self.ahead: Callable[[SlotNote], None] | None = None
        self.announces_ahead = cc is not None and cc.action_cache

    def encode(self, req: PrefixRequestNote, images: dict[str, np.ndarray]) -> SlotNote:
        """One call's prefix; with the cache on, ``last_selection`` then says what was chosen (the
        note for the cache manager, which slides its window after the call).

        The reference is chosen from the moment the vision tower's retrieval layer is done,
        beside the tower's later layers where that pays (``selection.BesideTower``); the
        ``select`` phase is what is left of it after the tower, its cost on the call's path."""
        self.prefix.call_begun()   # background work (the cache manager's upkeep) now waits for the call's end
        try:
            return self._encode(req, images)
        except BaseException:
            self.prefix.call_abandoned()
            raise

    def _encode(self, req: PrefixRequestNote, images: dict[str, np.ndarray]) -> SlotNote:
        timer = PhaseTimer(self.worker.engine.device)
        obs = Observation(images=images, state=list(req.state), task=req.task)
        choice: Choice | None = None
        self.last_choice = self.last_selection = None
        selector, beside = self.selector, self.beside   # both set, or neither (__init__)

        def choose(features: Tensor) -> Choice:
            assert selector is not None
            return selector.choose(req.request_seq, req.task, req.episode, features, req.state)
        try:
            vp = self.worker.embed(obs, timer, on_features=beside.start(choose) if beside is not None else None)
        except BaseException:
            if beside is not None:
                beside.abandon()
            raise
        if beside is not None:
            with timer.phase("select"):   # what is left of the selection after the tower: its cost on the path
                choice = beside.finish(lambda: choose(vp.features))
        reference = choice.entry if choice is not None else None
        if reference is not None and reference.masks is not None and self.ahead is not None and self.announces_ahead:
            self.ahead(SlotNote(self.rings.working_set, choice.slot, choice.seq))
        with self.prefix.begin_write() as writer:
            out = {f.name: writer[f.name] for f in self.prefix.layout.fields}
            kw = dict(observation_seq=req.request_seq, stamp_ns=time.monotonic_ns(), timer=timer)
            meta = self.worker.prefill(vp, req.state, out, reference=reference, **kw)
            if choice is not None and choice.pin is not None and not choice.pin.valid():
                # the cache manager rewrote the entry while the prefill read it: that result is
                # void, the call runs dense (the choice's reason says so)
                self.selector.torn += 1
                choice = Choice(Selection(req.request_seq, req.task, req.episode, None,
                                          choice.selection.candidates, "reference rewritten during the prefill"))
                meta = self.worker.prefill(vp, req.state, out, **kw)
            slot, seq = writer.commit({**meta.as_dict(), "request_seq": int(req.request_seq),
                                       "start_tick": int(req.start_tick), "noise_key": int(req.noise)})
        if choice is not None:
            m = choice.selection.match if choice.found else None
            self.last_selection = choice.selection
            self.last_choice = ReferenceChoice(req.request_seq, choice.slot, choice.seq,
                                               m.episode_id if m else "", m.index if m else -1,
                                               m.similarity if m else float("nan"), choice.reason)
        elif self.budget is not None and self.budget.keep is False:   # reported dense, and why
            self.last_choice = ReferenceChoice(req.request_seq, reason=self.budget_reason)
        self.last_timer = timer
        if self.budget is not None and choice is not None:
            self._weigh_selection(timer.times.seconds.get("select", 0.0), choice.found)
        return SlotNote(self.prefix.name, slot, seq, self.prefix.layout.tag)

    def _weigh_selection(self, select_s: float, served: bool) -> None:
        """One call's selection cost into the budget; where it decides that choosing costs more than
        the halves save, the rest of the run is dense (no selection at all) and the log says why."""
        assert self.budget is not None
        keep = self.budget.observe(select_s, served)
        if keep is None:
            return
        if keep:
            log.info("muscle-memory cache stays on (auto): %s", self.budget.verdict)
            return
        why = f"off for the rest of the run (auto): {self.budget.verdict}"
        log.warning("muscle-memory cache %s; set cache.context_cache / cache.action_cache to on to keep it", why)
        self.cache_reason += f"; {why}"
        self.budget_reason = f"cache {why}"
        if self.beside is not None:
            self.beside.close()
        if self.selector is not None:
            self.selector.close()
        self.selector = self.beside = None

    def warm_up(self) -> None:
        """One call on blank images into a private buffer (not the ring: nothing is announced), so
        that the first real call does not pay for lazy initialisation (a managed node's configure)."""
        policy = self.worker.policy
        size = policy.engine.cfg.vision.image_size
        obs = Observation(images={c: np.zeros((size, size, 3), np.uint8) for c in policy.camera_names},
                          state=np.zeros(policy.state_dim, np.float32), task="warm up")
        self.worker.encode(obs, self.worker.spec.allocate(), observation_seq=0, stamp_ns=0)

    def heartbeat(self) -> None:
        self.prefix.heartbeat()

    def idle(self) -> None:
        """Work that can wait for a gap between calls (``WindowSelector.idle``); none without the
        cache, and none while the call this stage encoded is still being denoised (the prefix
        ring's call words): the idle work reads the window's features, and on a 2-core computer
        that slows the policy's denoising on the other core (docs/cache.md). A call whose policy
        never finishes it leaves the idle work to the next call's own ``refresh``."""
        if self.selector is not None and not self.prefix.call_words().in_flight:
            self.selector.idle()

    def close(self) -> None:
        self.prefix.close()
        if self.beside is not None:
            self.beside.close()
        if self.selector is not None:
            self.selector.close()


# ---------------------------------------------------------------- cache manager

class CacheStage:
    """The repository and the window: prepares the entries the vision stage selects among, and
    slides the window after each call from what was selected (never on a call's path)."""

    def __init__(self, policy: Pi05Policy, spec: CacheSpec, rings: RingNames = RingNames(),
                 arm_slices: tuple[tuple[int, int], ...] = ()):
        self.rings = rings
        self.disabled_reason = ""
        self.fallback_rule = ""   # when an episode runs dense, said at start-up
        self.worker: CacheWorker | None = None
        self.working_set: RingBuffer | None = None
        self.gate: CallGate | None = None
        self.cfg = policy.engine.cfg
        self.instruction: str | None = None   # the robot's current task, once an instruction was heard
        self.notes_of_other_tasks = 0          # late notes dropped (diagnostics)
        repo = open_repository_meta(spec, policy)
        if repo is None:
            self.disabled_reason = "cache disabled in the profile" if not spec.enabled else "repository refused"
            return
        try:   # full open: hashes every episode file once (bit rot is caught before the robot moves)
            repo = ReferenceRepository.open(repo.root, expect_checkpoint_hash=policy.checkpoint_hash,
                                            expect_model=model_summary(self.cfg))
        except (RepositoryError, OSError) as e:
            self.disabled_reason = f"repository refused: {e}"
            log.warning("muscle-memory cache disabled, running dense: %s", e)
            return
        cc = cache_config(spec, repo)
        if cc.dense:   # neither half runs (auto found both slower here): no window to keep
            self.disabled_reason = cc.reason
            return
        mcfg = manager_config(spec, repo, arm_slices)
        layout = repo.call_layout or {}
        slots = mcfg.window.capacity + max((len(repo.episodes(t)) for t in repo.tasks()), default=0)
        try:
            ws_layout = working_set_layout(self.cfg, len(cc.groups), cc.mask_size(self.cfg.expert.mlp_dim),
                                           policy.engine.dtype, tuple(layout["retrieval"]),
                                           tuple(layout["state_history"]))
        except KeyError:
            self.disabled_reason = f"repository {repo.root} holds no episodes yet"
            log.warning("muscle-memory cache disabled, running dense: %s", self.disabled_reason)
            return
        # one slot more: the window's state (SharedEntryStore.mark_window)
        self.working_set = RingBuffer.create(rings.working_set, ws_layout, slots + 1, replace_stale=True)
        self.store = SharedEntryStore(self.working_set, window_marker=True)
        try:
            manager = CacheManager(policy.engine.model, repo, mcfg, entries=self.store)
        except ValueError as e:
            self.working_set.close()
            self.working_set = None
            self.disabled_reason = f"repository unusable: {e}"
            log.warning("muscle-memory cache disabled, running dense: %s", e)
            return
        self.worker = CacheWorker(manager)
        self.gate = CallGate(rings.prefix)   # the upkeep's entries wait for the gap between calls
        self.fallback_rule = fallback_rule(mcfg.retrieval.min_similarity,
                                           mcfg.retrieval.first_call_floor if spec.first_scene_floor else None,
                                           mcfg.retrieval.max_end_matches)

    @property
    def enabled(self) -> bool:
        return self.worker is not None

    def disable(self, reason: str) -> None:
        """Prepare nothing from now on (the repository or the working set became unusable)."""
        self.worker, self.disabled_reason = None, reason

    def begin(self, task: str, episode: int) -> None:
        """Prepare an episode before its first call (nothing when the cache is off). A task the
        repository cannot serve is not an error here: its calls run dense, saying why."""
        if self.worker is None or self.worker.serves(task, episode):
            return
        self.store.mark_window(window_state(task, episode, ready=False))
        try:
            self.worker.begin(task, episode)
        except (ValueError, RuntimeError) as e:
            log.warning("episode %d of %r not prepared ahead: %s", episode, task, e)
        # complete (or as complete as it will get: a task the repository lacks has no window)
        self.store.mark_window(window_state(task, episode, ready=True))

    def instruct(self, task: str) -> None:
        """The instruction the robot now follows (its task's episode is begun by the caller)."""
        self.instruction = task

    def follow(self, selection: Selection) -> None:
        """What a call selected (its episode starts here if it was not announced ahead). A stall
        restarts the window: the vision side's restarted first search waits for it again.

        Two kinds of late note are dropped, because following them would restart an episode that
        is over and have the next call start the current one a second time: a note of an earlier
        episode of the current task (a call in flight at the reset), and a note of another task
        than the current instruction (a call in flight when the instruction changed, released
        after the robot was switched back). Without an instruction heard, every task's notes are
        followed; a note of a new task arriving before its instruction is dropped, and the
        instruction then begins the task's episode as it would anyway."""
        w = self.worker
        if w is None:
            return
        if self.instruction is not None and selection.task != self.instruction:
            self.notes_of_other_tasks += 1
            return
        if selection.task == w.manager.task and w.episode is not None and selection.episode < w.episode:
            return   # a late note of an episode already over (a call in flight at the reset): not followed
        self.begin(selection.task, selection.episode)
        if selection.restart:
            self.store.mark_window(window_state(selection.task, selection.episode, ready=False))
        self.worker.follow(selection)
        if selection.restart:
            self.store.mark_window(window_state(selection.task, selection.episode, ready=True))

    def upkeep(self, time_available_s: float | None = None) -> None:
        """Slide the working set after a call (overlaps the robot executing the chunk). Each entry
        rebuilt waits for the gap between two calls first (``call_gate``), heartbeating meanwhile."""
        if self.worker is not None and self.worker.manager.task is not None:
            gate = self.gate
            wait = None if gate is None else (lambda: gate.wait_for_gap(self.heartbeat))
            self.worker.prepare(time_available_s, wait)

    def heartbeat(self) -> None:
        if self.working_set is not None:
            self.working_set.heartbeat()

    def close(self) -> None:
        if self.working_set is not None:
            self.working_set.close()


# ---------------------------------------------------------------- policy

@dataclass(frozen=True)
class ChunkResult:
    request_seq: int
    start_tick: int
    chunk: np.ndarray        # [chunk, action_dim] robot units
    used_reference: bool     # denoised with a reference's masks (Action Cache)
    meta: PrefixMeta
    gathers: int = 0         # compact-weight gathers on the call's path (0: gathered ahead, or reused)

    @property
    def cached(self) -> bool:
        """A reference served this call, in the prefill (Context Cache) or the denoising (Action Cache)."""
        return self.used_reference or bool(self.meta.context_cache)


class PolicyStage:
    """Prefix slots -> action chunks (Action Cache when the slot names a reference)."""

    def __init__(self, policy: Pi05Policy, rings: RingNames = RingNames(), cache: CacheConfig | None = None,
                 seed: int = 0):
        self.worker = PolicyWorker(policy, cache)
        self.rings = rings
        self.seed = seed
        self.layout = prefix_layout(PrefixSlotSpec.for_config(policy.engine.cfg, policy.engine.dtype, cache))
        self.slot_buf = {f.name: torch.zeros(f.shape, dtype=f.dtype) for f in self.layout.fields}
        self.prefix: RingBuffer | None = None
        self.working_set: RingBuffer | None = None   # read for ``gather_ahead`` only
        self.gathered_ahead = 0                      # gathers done ahead of calls (diagnostics)
        self.gathered_in_calls = 0                   # gathers calls did on their own path (diagnostics)

    def generator(self, noise_key: int) -> torch.Generator:
        """Noise of the call whose key is n (its ``request_seq`` unless the request names a key):
        seed * 1000003 + n, so chunks are reproducible whatever process runs them."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + noise_key)

    def act(self, note: SlotNote) -> ChunkResult | None:
        """Denoise the announced slot; None when it was overwritten before it was read.

        A note whose layout tag is not this policy's, a ring whose layout differs (the error
        names the difference) or a missing ring raise RingBufferError before anything is read.
        A ring whose writer restarted is re-attached first (``RingBuffer.superseded``): the old
        mapping may hold a payload with the very sequence the new writer announces."""
        if note.layout_tag and note.layout_tag != self.layout.tag:
            raise LayoutMismatchError(f"slot note for ring {note.ring!r} has layout tag {note.layout_tag}, this "
                                      f"policy reads {self.layout.tag} (another checkpoint or version on the vision side)")
        try:
            self.prefix = _current_ring(self.prefix, note.ring, self.layout)
        except (RingBufferError, OSError):
            self.prefix = None
            raise
        ring = self.prefix
        try:
            return self._act(ring, note)
        finally:   # the call is over, whatever its outcome: background work may use the cores again
            ring.call_done(note.seq)

    def gather_ahead(self, note: SlotNote) -> int:
        """A coming call's reference, announced by the vision stage before its prefill
        (``VisionStage.ahead``, working-set slot and sequence): gather the compact weights of its
        masks now, reading the masks in place, so that the call's anchors find them ready.

        Only ever a head start: where the entry was replaced meanwhile, the working set is gone or
        the masks do not fit, nothing is gathered and the call does what it would have done
        anyway (gather itself from the masks its prefix slot carries, or run dense). Returns the
        gathers done."""
        if self.worker.buffers is None:
            return 0
        try:
            self.working_set = current_ring(self.working_set, note.ring)
            pinned = pin_entry(self.working_set, note.slot, note.seq) if self.working_set is not None else None
            if pinned is None or pinned[0].masks is None:
                return 0
            entry, pin = pinned
            masks = entry.masks.clone()   # the gather must read what the pin vouches for
            if not pin.valid():
                return 0
            done = self.worker.gather_ahead(masks)
        except (RingBufferError, ValueError, OSError) as e:
            log.debug("no gather ahead of the call (it gathers itself): %s", e)
            return 0
        self.gathered_ahead += done
        return done

    def _act(self, ring: RingBuffer, note: SlotNote) -> ChunkResult | None:
        info = ring.read(note.slot, note.seq, self.slot_buf)
        if info is None or not isinstance(info.meta, dict):
            return None
        meta = PrefixMeta.from_dict(info.meta)
        request_seq = int(info.meta["request_seq"])
        masks = self.slot_buf["masks"] if meta.masks and "masks" in self.slot_buf else None
        noise_key = int(info.meta.get("noise_key", request_seq))
        chunk = self.worker.act(self.slot_buf, meta, generator=self.generator(noise_key), masks=masks)
        self.gathered_in_calls += self.worker.last_gathers
        return ChunkResult(request_seq, int(info.meta["start_tick"]), chunk, self.worker.last_used_masks, meta,
                           self.worker.last_gathers)

    def warm_up(self) -> None:
        """One denoising of a one-row blank prefix (a managed node's configure: the first real
        chunk does not pay for lazy initialisation). Reads no ring."""
        meta = PrefixMeta(length=1, valid_len=1, cameras=0, state_dim=self.worker.policy.state_dim,
                          observation_seq=0, stamp_ns=0)
        blank = {name: torch.zeros_like(t) for name, t in self.slot_buf.items()}
        self.worker.act(blank, meta, generator=self.generator(0))

    def close(self) -> None:
        if self.prefix is not None:
            self.prefix.close()
        if self.working_set is not None:
            self.working_set.close()
