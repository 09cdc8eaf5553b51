"""The vision and policy workers: one pi0.5 call split at the prefix KV cache.

The vision worker turns an observation (images, the state to condition on, instruction) into the
prefix keys/values of every VLM layer and writes them into a slot (ring-buffer memory in the
three-process deployment); the policy worker copies a slot into its own KV cache and denoises.
Both are plain Python: the rclpy nodes, the ROS-free multi-process runner and the tests drive
the same code. Splitting here is exact: the denoising loop only ever reads the prefix K/V.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import numpy as np
import torch
from torch import Tensor

from ..engine.dense import DenseEngine
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

    @staticmethod
    def for_config(cfg: Pi05Config, dtype: torch.dtype = torch.float32) -> "PrefixSlotSpec":
        return PrefixSlotSpec(cfg.vlm.depth, cfg.vlm.num_kv_heads, cfg.max_prefix_len, cfg.vlm.head_dim,
                              cfg.num_cameras * cfg.num_image_tokens, cfg.vision.width, dtype)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        kv = (self.layers, self.kv_heads, self.max_prefix, self.head_dim)
        return {"k": (kv, self.dtype), "v": (kv, self.dtype),
                "retrieval": ((self.retrieval_rows, self.retrieval_width), torch.float16),
                "state": ((64,), torch.float32)}

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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class VisionWorker:
    """Observation -> prefix K/V of every VLM layer (vision tower + VLM prefill)."""

    def __init__(self, policy: Pi05Policy):
        self.policy = policy
        self.engine: DenseEngine = policy.engine
        self.spec = PrefixSlotSpec.for_config(self.engine.cfg, self.engine.dtype)

    @torch.no_grad()
    def encode(self, obs: Observation, out: dict[str, Tensor], observation_seq: int, stamp_ns: int,
               timer: PhaseTimer | None = None) -> PrefixMeta:
        """Write the prefix of ``obs`` into ``out`` (slot tensors). ``obs.state`` is the state the
        prompt is conditioned on (the policy's predicted state, not necessarily the observed one).

        ``timer``, when given, records the ``"vision"`` (input preparation and vision tower) and
        ``"prefill"`` phases separately; it is optional because timing synchronises a GPU, which
        the nodes' hot path should not pay for when nobody reads the figures."""
        m = self.engine.model

        def phase(name: str) -> ContextManager[None]:
            return timer.phase(name) if timer is not None else nullcontext()

        with phase("vision"):
            inputs = self.policy.prepare(obs)
            image_tokens, tapped = m.embed_images(inputs.images.to(self.engine.device), m.cfg.retrieval_layer)
        with phase("prefill"):
            prefix = m.build_prefix(image_tokens, inputs.image_mask, inputs.tokens, inputs.token_mask)
            if prefix.key_bias is not None:
                raise ValueError("prompt with interior padding: not supported by the prefix slot (batch of one)")
            m.prefill(prefix)
        p = prefix.length
        for i, cache in enumerate(m.caches):
            out["k"][i, :, :p].copy_(cache.k[0, :, :p])
            out["v"][i, :, :p].copy_(cache.v[0, :, :p])
        rows = tapped[0].flatten(0, 1)
        out["retrieval"][: rows.shape[0]].copy_(rows)
        state = torch.as_tensor(np.asarray(obs.state), dtype=torch.float32).reshape(-1)
        out["state"][: state.numel()].copy_(state)
        return PrefixMeta(length=p, valid_len=int(prefix.valid_len[0]), cameras=int(inputs.image_mask.sum()),
                          state_dim=state.numel(), observation_seq=observation_seq, stamp_ns=stamp_ns)


class PolicyWorker:
    """Prefix slot -> action chunk in robot units (denoising of the action expert)."""

    def __init__(self, policy: Pi05Policy):
        self.policy = policy
        self.engine: DenseEngine = policy.engine

    @torch.no_grad()
    def act(self, slot: dict[str, Tensor], meta: PrefixMeta, noise: Tensor | None = None,
            generator: torch.Generator | None = None) -> np.ndarray:
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
        actions = m.denoise(stub, noise)
        return self.policy.action_norm.unnormalize(actions[0].float().cpu()).numpy()
