"""The three workers: one pi0.5 call split at the prefix KV cache, plus the cache manager.

The vision worker turns an observation (images, the state to condition on, instruction) into the
prefix keys/values of every VLM layer and writes them into a slot (ring-buffer memory in the
three-process deployment); the policy worker copies a slot into its own KV cache and denoises.
Splitting here is exact: the denoising loop only ever reads the prefix K/V. Between the vision
tower and the prefill the vision side selects a reference (rMuscle) among the entries the cache
worker prepared in the shared working set: it turns the prefill's FFNs into the Context Cache and
the denoising loop's into the Action Cache.

All three are plain Python: the rclpy nodes, the ROS-free runner (one process or three) and the
tests drive the same code; only how the small notifications travel differs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import MISSING, dataclass, fields
from typing import ContextManager

import numpy as np
import torch
from torch import Tensor

from ..cache.action_cache import ActionCache, ActionCacheBuffers
from ..cache.context_cache import ContextCache
from ..cache.entry import PreparedEntry
from ..cache.manager import CacheManager, PrepareReport
from ..cache.selector import Selection
from ..engine.cached import CacheConfig, same_camera_layout
from ..engine.dense import DenseEngine, ModelInputs
from ..engine.policy import Observation, Pi05Policy
from ..engine.timing import PhaseTimer
from ..models.config import Pi05Config
from ..models.pi05 import Prefix


@dataclass(frozen=True)
class PrefixSlotSpec:
    """Shapes of one prefix slot for a model (what the ring-buffer layout is built from)."""

    layers: int
    kv_heads: int
    max_prefix: int
    head_dim: int
    retrieval_rows: int
    retrieval_width: int
    dtype: torch.dtype
    mask_shape: tuple[int, int, int] | None = None   # [groups, expert depth, K]: the Action Cache's masks

    @staticmethod
    def for_config(cfg: Pi05Config, dtype: torch.dtype = torch.float32,
                   cache: CacheConfig | None = None) -> "PrefixSlotSpec":
        """The slot for ``cfg``; with the Action Cache on (``cache``), room for the masks of the
        reference the call was given, so they travel with the call (the working set may drop that
        entry before the policy denoises: the vision process runs calls ahead of it)."""
        masks = None
        if cache is not None and cache.action_cache:
            groups = cache.validate(cfg.num_steps).groups
            masks = (len(groups), cfg.expert.depth, cache.mask_size(cfg.expert.mlp_dim))
        return PrefixSlotSpec(cfg.vlm.depth, cfg.vlm.num_kv_heads, cfg.max_prefix_len, cfg.vlm.head_dim,
                              cfg.num_cameras * cfg.num_image_tokens, cfg.vision.width, dtype, masks)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        kv = (self.layers, self.kv_heads, self.max_prefix, self.head_dim)
        shapes = {"k": (kv, self.dtype), "v": (kv, self.dtype),
                  "retrieval": ((self.retrieval_rows, self.retrieval_width), torch.float16),
                  "state": ((64,), torch.float32)}
        if self.mask_shape is not None:
            shapes["masks"] = (self.mask_shape, torch.int64)
        return shapes

    def allocate(self) -> dict[str, Tensor]:
        """Plain tensors of the slot's shapes (in-process use and tests)."""
        return {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in self.shapes().items()}


@dataclass
class PrefixMeta:
    """The small part of a slot: what the policy needs besides the tensors."""

    length: int          # prefix rows written
    valid_len: int       # valid tokens (suffix positions start here)
    cameras: int         # cameras whose tokens are in the prefix
    state_dim: int
    observation_seq: int
    stamp_ns: int
    masks: int = 0           # 1: the slot's ``masks`` hold the reference's (the policy runs the Action Cache)
    context_cache: int = 0   # 1: the prefill reused the reference's FFN outputs (Context Cache)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, meta: dict) -> "PrefixMeta":
        """From a slot's metadata; a missing or non-integer field is an error, extra keys are ignored."""
        try:
            return cls(**{f.name: int(meta[f.name]) for f in fields(cls) if f.name in meta or f.default is MISSING})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"prefix slot metadata unusable ({e!r}): {meta}") from None


@dataclass(frozen=True)
class ReferenceChoice:
    """One call's reference as reported (``run``'s JSON, ``eval``, diagnostics): a working-set
    entry, or dense and why."""

    request_seq: int
    slot: int = -1
    seq: int = -1
    episode: str = ""
    index: int = -1
    similarity: float = float("nan")
    reason: str = ""

    @property
    def found(self) -> bool:
        return self.slot >= 0


@dataclass
class VisionPass:
    """The vision tower's half of a call: what the prefill needs, and the retrieval query."""

    inputs: ModelInputs
    image_tokens: Tensor
    features: Tensor     # [N, patches, vision width] at cfg.retrieval_layer (the cache manager's query)


class VisionWorker:
    """Observation -> prefix K/V of every VLM layer (vision tower + VLM prefill).

    ``cache`` enables the Context Cache for calls given a reference (``rho_p``); without it, or
    without a reference, the prefill is the dense engine's.
    """

    def __init__(self, policy: Pi05Policy, cache: CacheConfig | None = None):
        self.policy = policy
        self.engine: DenseEngine = policy.engine
        self.cache = cache
        self.spec = PrefixSlotSpec.for_config(self.engine.cfg, self.engine.dtype, cache)
        self.last_context: ContextCache | None = None

    @staticmethod
    def _phase(timer: PhaseTimer | None, name: str) -> ContextManager[None]:
        # Timing synchronises a GPU: only when somebody reads the figures.
        return timer.phase(name) if timer is not None else nullcontext()

    @torch.no_grad()
    def embed(self, obs: Observation, timer: PhaseTimer | None = None,
              on_features: Callable[[Tensor], None] | None = None) -> VisionPass:
        """Validate the observation and run the vision tower (``"vision"`` phase). ``on_features``
        gets the retrieval features ([N, patches, vision width]) as soon as the tower computed
        them, while its later layers still run (the reference is chosen meanwhile)."""
        m = self.engine.model
        tap = None if on_features is None else (lambda t: on_features(t[0]))
        with self._phase(timer, "vision"):
            inputs = self.policy.prepare(obs)
            image_tokens, tapped = m.embed_images(inputs.images.to(self.engine.device), m.cfg.retrieval_layer, tap)
        return VisionPass(inputs, image_tokens, tapped[0])

    @torch.no_grad()
    def prefill(self, vp: VisionPass, state: np.ndarray | list[float], out: dict[str, Tensor], observation_seq: int,
                stamp_ns: int, reference: PreparedEntry | None = None,
                timer: PhaseTimer | None = None) -> PrefixMeta:
        """Prefill (``"prefill"`` phase) and write the prefix into ``out`` (slot tensors).

        ``state`` is the state the prompt was conditioned on (the policy's predicted state).
        ``reference``: the prepared entry chosen for this call; its masks go into the slot (the
        policy denoises with them) and, unless it was recorded with another camera layout, its
        FFN states serve the Context Cache.
        """
        m = self.engine.model
        self.last_context = None
        with self._phase(timer, "prefill"):
            prefix = m.build_prefix(vp.image_tokens.to(self.engine.dtype), vp.inputs.image_mask, vp.inputs.tokens,
                                    vp.inputs.token_mask)
            if prefix.key_bias is not None:
                raise ValueError("prompt with interior padding: not supported by the prefix slot (batch of one)")
            ffn = None
            if (reference is not None and self.cache is not None and self.cache.context_cache
                    and same_camera_layout(reference, vp.inputs.image_mask)):
                ffn = self.last_context = ContextCache(reference, self.cache.rho_p)
            m.prefill(prefix, ffn=ffn)
        p = prefix.length
        for i, cache in enumerate(m.caches):
            out["k"][i, :, :p].copy_(cache.k[0, :, :p])
            out["v"][i, :, :p].copy_(cache.v[0, :, :p])
        rows = vp.features.flatten(0, 1)
        out["retrieval"][: rows.shape[0]].copy_(rows)
        state_t = torch.as_tensor(np.asarray(state), dtype=torch.float32).reshape(-1)
        out["state"][: state_t.numel()].copy_(state_t)
        uses_masks = (reference is not None and reference.masks is not None and "masks" in out
                      and tuple(reference.masks.shape) == tuple(out["masks"].shape))
        if uses_masks:
            out["masks"].copy_(reference.masks)
        return PrefixMeta(length=p, valid_len=int(prefix.valid_len[0]), cameras=int(vp.inputs.image_mask.sum()),
                          state_dim=state_t.numel(), observation_seq=observation_seq, stamp_ns=stamp_ns,
                          masks=int(uses_masks), context_cache=int(ffn is not None))

    def encode(self, obs: Observation, out: dict[str, Tensor], observation_seq: int, stamp_ns: int,
               timer: PhaseTimer | None = None) -> PrefixMeta:
        """A dense prefix in one step (no reference)."""
        return self.prefill(self.embed(obs, timer), obs.state, out, observation_seq, stamp_ns, timer=timer)


class PolicyWorker:
    """Prefix slot -> action chunk in robot units (denoising of the action expert).

    ``mask_size`` (neurons per expert layer, rho_n x MLP width) and ``groups`` enable the Action
    Cache for calls whose prefix came with a reference's masks.
    """

    def __init__(self, policy: Pi05Policy, cache: CacheConfig | None = None):
        self.policy = policy
        self.engine: DenseEngine = policy.engine
        self.cache = cache
        self.buffers: ActionCacheBuffers | None = None
        if cache is not None and cache.action_cache:
            k = cache.mask_size(self.engine.cfg.expert.mlp_dim)
            self.buffers = ActionCacheBuffers(self.engine.cfg, k, self.engine.dtype, self.engine.device)
        self.last_used_masks = False
        self.last_gathers = 0   # compact-weight gathers the last call did itself (0: all gathered ahead or reused)

    @torch.no_grad()
    def gather_ahead(self, masks: Tensor) -> int:
        """Gather the compact weights of a coming call's reference ``masks`` now (between calls,
        while the vision process prefills): returns the gathers done, 0 without the Action Cache."""
        if self.buffers is None:
            return 0
        mlps = [layer.mlp for layer in self.engine.model.expert_layers]
        return self.buffers.gather_ahead(mlps, masks.to(self.engine.device))

    @torch.no_grad()
    def act(self, slot: dict[str, Tensor], meta: PrefixMeta, noise: Tensor | None = None,
            generator: torch.Generator | None = None, masks: Tensor | None = None) -> np.ndarray:
        m, cfg = self.engine.model, self.engine.cfg
        p = meta.length
        if not 0 < p <= cfg.max_prefix_len or not 0 < meta.valid_len <= p:
            raise ValueError(f"prefix slot declares {p} rows / {meta.valid_len} valid, outside the model's bounds")
        for i, cache in enumerate(m.caches):
            cache.k[0, :, :p].copy_(slot["k"][i, :, :p])
            cache.v[0, :, :p].copy_(slot["v"][i, :, :p])
        noise = self.engine.make_noise(1, generator) if noise is None else noise.to(self.engine.device, torch.float32)
        stub = Prefix(torch.empty(1, 0, cfg.vlm.width, device=self.engine.device),
                      torch.empty(1, 0, dtype=torch.int64), None, torch.tensor([meta.valid_len]), start=p)
        ffn = None
        if masks is not None and self.buffers is not None:
            if masks.shape[-1] != self.buffers.k:
                raise ValueError(f"reference masks hold {masks.shape[-1]} neurons, this policy expects "
                                 f"{self.buffers.k} (rho_n={self.cache.rho_n})")
            ffn = ActionCache(self.buffers, masks.to(self.engine.device), self.cache.groups, cfg.num_steps)
        self.last_used_masks = ffn is not None
        gathers = self.buffers.gathers if self.buffers is not None else 0
        actions = m.denoise(stub, noise, ffn=ffn)
        self.last_gathers = (self.buffers.gathers if self.buffers is not None else 0) - gathers
        return self.policy.action_norm.unnormalize(actions[0].float().cpu()).numpy()


class CacheWorker:
    """The cache manager's side: episodes, and the working set's upkeep after each call.

    A new episode (task pack, fresh window) starts when the instruction changes or the caller's
    episode number does (the same task repeated at a station). Which reference a call uses is
    decided in the vision process; this worker only hears it afterwards (``follow``).
    """

    def __init__(self, manager: CacheManager):
        self.manager = manager
        self.last_prepare: PrepareReport | None = None
        self.episodes_started = 0
        self.episode: int | None = None
        self.last_selection: Selection | None = None
        self.selections = 0

    def serves(self, task: str, episode: int) -> bool:
        """Whether (task, episode) is the episode the window is for."""
        return task == self.manager.task and episode == self.episode

    def begin(self, task: str, episode: int = 0) -> bool:
        """Start (task, episode) unless it is the current one: the task pack and the initial
        window are loaded now. Called ahead of the episode's first query when the caller knows
        the task (the robot resetting), else by that query itself. True when it started one."""
        if self.serves(task, episode):
            return False
        self.manager.start_episode(task)
        self.episodes_started += 1
        self.episode = episode
        return True

    def follow(self, selection: Selection) -> None:
        """What the vision side selected for a call: the window slides after it."""
        self.manager.follow(selection)
        self.last_selection = selection
        self.selections += 1

    def prepare(self, time_available_s: float | None = None,
                before_rebuild: Callable[[], object] | None = None) -> PrepareReport:
        """Slide the window after a call (meant to overlap the robot executing the chunk);
        ``before_rebuild``: ``CacheManager.prepare``'s."""
        self.last_prepare = self.manager.prepare(time_available_s, before_rebuild)
        return self.last_prepare

    def diagnostics(self) -> dict[str, str]:
        m, sel = self.manager, self.last_selection
        return {"selections": str(self.selections), "prepared_entries": str(len(m.entries)), "task": m.task or "",
                "stalls": str(m.stalls),
                "episodes_started": str(self.episodes_started),
                "last_reference": "" if sel is None or sel.match is None else f"{sel.match.episode_id}:{sel.match.index}",
                "last_dense_reason": "" if sel is None else sel.reason}
