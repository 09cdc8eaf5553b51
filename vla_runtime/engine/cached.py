"""The cached engine: the dense engine with rMuscle's Context Cache and Action Cache swapped in.

It decides per call, from the reference the cache manager hands it, which FFNs run in full:
with no reference (nothing similar known, fallback, camera layout differs) it is exactly the
dense engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..cache.action_cache import ActionCache, ActionCacheBuffers
from ..cache.context_cache import ContextCache
from ..cache.entry import PreparedEntry
from ..cache.halves import DEFAULT_RHO_N, DEFAULT_RHO_P
from ..cache.masks import Groups, resolve_groups
from ..models.gemma import DenoiseFFN, PrefillFFN
from ..models.pi05 import Pi05Model
from .dense import DenseEngine, ModelInputs, StaticFFN, _no_ffn


@dataclass(frozen=True)
class CacheConfig:
    rho_p: float = DEFAULT_RHO_P          # fraction of visual tokens recomputed per VLM layer
    rho_n: float = DEFAULT_RHO_N          # fraction of expert MLP neurons computed at non-anchor steps
    groups: Groups | None = None          # denoising step groups, each opened by a dense anchor step;
                                          # None: rMuscle's two even groups over the model's steps
    context_cache: bool = True
    action_cache: bool = True
    reason: str = ""                      # why these halves run (the profile's auto/on/off, resolved at start-up)
    saving_s: float | None = None         # what auto's halves save a call by the recorded timing
                                          # (ResolvedHalves.saving_s; the vision stage's selection check)

    @property
    def dense(self) -> bool:
        """Neither half runs: a call computes densely whatever reference it is handed."""
        return not (self.context_cache or self.action_cache)

    def validate(self, num_steps: int) -> "CacheConfig":
        """This config for a model of ``num_steps`` denoising steps, its groups resolved."""
        if not 0.0 < self.rho_p <= 1.0 or not 0.0 < self.rho_n <= 1.0:
            raise ValueError(f"rho_p and rho_n must be in (0, 1], got {self.rho_p}, {self.rho_n}")
        groups = resolve_groups(self.groups, num_steps)
        return self if self.groups is not None else replace(self, groups=groups)

    def mask_size(self, mlp_dim: int) -> int:
        import math
        return min(mlp_dim, math.ceil(self.rho_n * mlp_dim))


def same_camera_layout(entry: PreparedEntry, image_mask: Tensor) -> bool:
    """A reference serves the Context Cache only with the call's camera layout (batch of one)."""
    mask = image_mask[0] if image_mask.ndim == 2 else image_mask
    return mask.shape[0] == entry.image_mask.shape[0] and bool(torch.equal(mask.cpu(), entry.image_mask.cpu()))


class CachedEngine(DenseEngine):
    def __init__(self, model: Pi05Model, cache: CacheConfig = CacheConfig(), **kwargs):
        super().__init__(model, max_batch=1, tap_retrieval_features=True, **kwargs)
        self.cache = cache.validate(model.cfg.num_steps)
        k = cache.mask_size(model.cfg.expert.mlp_dim)
        self.buffers = ActionCacheBuffers(model.cfg, k, self.dtype, self.device)
        self.last_context: ContextCache | None = None
        self._static_entry: PreparedEntry | None = None     # captured phases: the reference's copy
        self._static_masks: Tensor | None = None
        self._contexts: dict[tuple, ContextCache] = {}

    def usable(self, entry: PreparedEntry, inputs: ModelInputs) -> bool:
        return same_camera_layout(entry, inputs.image_mask)

    def _prefill_ffn(self, reference: object | None, inputs: ModelInputs) -> PrefillFFN | None:
        self.last_context = None
        if not (self.cache.context_cache and isinstance(reference, PreparedEntry) and self.usable(reference, inputs)):
            return None
        self.last_context = ContextCache(reference, self.cache.rho_p)
        return self.last_context

    # ------------------------------------------------------------ captured phases (static buffers)
    def _prefill_ffn_static(self, reference: object | None, inputs: ModelInputs) -> StaticFFN:
        """The Context Cache over a static copy of the reference: the captured prefill reads the
        reference from there, so each call copies its own reference in first."""
        self.last_context = None
        if not (self.cache.context_cache and isinstance(reference, PreparedEntry) and self.usable(reference, inputs)):
            return None, _no_ffn
        pv = reference.visual_tokens
        s = self._static_reference()
        s.ffn_in[:, :pv].copy_(reference.ffn_in)
        s.ffn_out[:, :pv].copy_(reference.ffn_out)
        s.image_mask.copy_(reference.image_mask)
        key = ("context", pv)
        self.last_context = self._contexts.get(key)

        def build() -> ContextCache:   # once per captured shape; replays reuse it over the static copy
            view = PreparedEntry(reference.key, s.ffn_in[:, :pv], s.ffn_out[:, :pv], s.image_mask, None)
            self.last_context = self._contexts[key] = ContextCache(view, self.cache.rho_p)
            return self.last_context
        return key, build

    def _denoise_ffn_static(self, reference: object | None) -> StaticFFN:
        if not (self.cache.action_cache and isinstance(reference, PreparedEntry) and reference.masks is not None):
            return None, _no_ffn
        masks = self._check_masks(reference.masks)
        if self._static_masks is None:
            self._static_masks = torch.empty_like(masks, device=self.device)
        self._static_masks.copy_(masks)
        return ("action",), lambda: ActionCache(self.buffers, self._static_masks, self.cache.groups, self.cfg.num_steps)

    def _static_reference(self) -> PreparedEntry:
        if self._static_entry is None:
            cfg = self.cfg
            shape = (cfg.vlm.depth - 1, cfg.num_cameras * cfg.num_image_tokens, cfg.vlm.width)
            self._static_entry = PreparedEntry(("static", -1), torch.empty(shape, dtype=self.dtype, device=self.device),
                                               torch.empty(shape, dtype=self.dtype, device=self.device),
                                               torch.empty(cfg.num_cameras, dtype=torch.bool, device=self.device), None)
        return self._static_entry

    def _check_masks(self, masks: Tensor) -> Tensor:
        if masks.shape[-1] != self.buffers.k:
            raise ValueError(f"reference masks hold {masks.shape[-1]} neurons, the engine expects "
                             f"{self.buffers.k} (rho_n={self.cache.rho_n}); rebuild the repository's masks")
        return masks

    def _denoise_ffn(self, reference: object | None) -> DenoiseFFN | None:
        if not (self.cache.action_cache and isinstance(reference, PreparedEntry) and reference.masks is not None):
            return None
        return ActionCache(self.buffers, self._check_masks(reference.masks), self.cache.groups, self.cfg.num_steps)
