"""The dense (exact) engine: one pi0.5 call from model-ready tensors to an action chunk.

Who decides vs who computes: this engine decides the schedule (phases, batch capacity, noise,
whether the denoising loop replays a CUDA graph); ``Pi05Model`` computes. The cached engine of
the muscle-memory cache swaps individual phases and keeps this contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..models.gemma import DenoiseFFN, PrefillFFN
from ..models.pi05 import Pi05Model, Prefix
from .timing import PhaseTimer, PhaseTimes


@dataclass
class ModelInputs:
    """A batch of model-ready inputs (see ``engine.policy`` for raw observations)."""

    images: Tensor        # [B, N, 3, H, W] float in [-1, 1]
    image_mask: Tensor    # [B, N] bool: camera present
    tokens: Tensor        # [B, L] int64 prompt ids (right-padded)
    token_mask: Tensor    # [B, L] bool

    def validate(self, model: Pi05Model) -> None:
        cfg = self.images.shape
        mc = model.cfg
        if self.images.ndim != 5 or cfg[2] != 3 or cfg[3] != mc.vision.image_size or cfg[4] != mc.vision.image_size:
            raise ValueError(f"images must be [B, N, 3, {mc.vision.image_size}, {mc.vision.image_size}], got {tuple(cfg)}")
        if not self.images.is_floating_point():
            raise ValueError(f"images must be floating point in [-1, 1], got {self.images.dtype}")
        if cfg[1] > mc.num_cameras:
            raise ValueError(f"{cfg[1]} cameras given, the model was configured for at most {mc.num_cameras}")
        b = cfg[0]
        if tuple(self.image_mask.shape) != (b, cfg[1]) or self.image_mask.dtype != torch.bool:
            raise ValueError(f"image_mask must be bool [{b}, {cfg[1]}], got {self.image_mask.dtype} {tuple(self.image_mask.shape)}")
        if self.tokens.ndim != 2 or self.tokens.shape[0] != b or self.tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be int64 [{b}, L], got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.tokens.shape[1] > mc.max_token_len:
            raise ValueError(f"{self.tokens.shape[1]} prompt tokens exceed the model's maximum {mc.max_token_len}")
        if self.token_mask.shape != self.tokens.shape or self.token_mask.dtype != torch.bool:
            raise ValueError("token_mask must be a bool tensor shaped like tokens")
        if self.tokens.numel() and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= mc.vocab_size):
            raise ValueError(f"token ids must lie in [0, {mc.vocab_size})")
        if not bool(torch.isfinite(self.images).all()):
            raise ValueError("images contain NaN or Inf")


@dataclass
class EngineOutput:
    actions: Tensor               # [B, chunk, action_dim] fp32, model (normalised) space
    times: PhaseTimes
    retrieval_features: Tensor | None = None   # [B, N, patches, vision width] at cfg.retrieval_layer
    reference: object | None = None            # the reference a cached engine used (None: dense)


class ReferenceSelector(Protocol):
    """Picks a prepared reference for this call from its retrieval features (None: run dense)."""

    def __call__(self, features: Tensor, inputs: "ModelInputs") -> object | None: ...


class DenseEngine:
    """Exact pi0.5 inference: vision, prefill once, denoise over static buffers."""

    def __init__(self, model: Pi05Model, max_batch: int = 1, tap_retrieval_features: bool = False,
                 cuda_graphs: bool | None = None):
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_batch = max_batch
        self.tap_layer = self.cfg.retrieval_layer if tap_retrieval_features else None
        model.setup_caches(max_batch)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self._graph: _DenoiseGraph | None = None

    def make_noise(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        return torch.randn(batch, self.cfg.chunk_size, self.cfg.action_dim, generator=generator,
                           dtype=torch.float32, device="cpu").to(self.device)

    @torch.no_grad()
    def infer(self, inputs: ModelInputs, noise: Tensor | None = None,
              generator: torch.Generator | None = None, select: ReferenceSelector | None = None) -> EngineOutput:
        """One call. ``select`` (cached engines) sees the retrieval features after vision."""
        inputs.validate(self.model)
        b = inputs.images.shape[0]
        if b > self.max_batch:
            raise ValueError(f"batch {b} exceeds the engine's max_batch {self.max_batch}")
        noise = self.make_noise(b, generator) if noise is None else noise.to(self.device, torch.float32)
        if noise.shape != (b, self.cfg.chunk_size, self.cfg.action_dim):
            raise ValueError(f"noise must be [{b}, {self.cfg.chunk_size}, {self.cfg.action_dim}], got {tuple(noise.shape)}")
        timer = PhaseTimer(self.device)
        m = self.model
        with timer.phase("vision"):
            image_tokens, tapped = m.embed_images(inputs.images.to(self.device), self.tap_layer)
        reference = None
        if select is not None:
            with timer.phase("retrieve"):
                reference = select(tapped, inputs)
        with timer.phase("prefill"):
            prefix = m.build_prefix(image_tokens.to(self.dtype), inputs.image_mask.to(self.device),
                                    inputs.tokens.to(self.device), inputs.token_mask.to(self.device))
            m.prefill(prefix, ffn=self._prefill_ffn(reference, inputs))
        with timer.phase("denoise"):
            actions = self._denoise(prefix, noise, reference)
        return EngineOutput(actions, timer.times, tapped, reference)

    def _prefill_ffn(self, reference: object | None, inputs: ModelInputs) -> PrefillFFN | None:
        """The dense engine runs every FFN; cached engines substitute the Context Cache here."""
        return None

    def _denoise_ffn(self, reference: object | None) -> DenoiseFFN | None:
        """The dense engine runs every FFN; cached engines substitute the Action Cache here."""
        return None

    def _denoise(self, prefix: Prefix, noise: Tensor, reference: object | None = None) -> Tensor:
        ffn = self._denoise_ffn(reference)
        if ffn is not None or not self.cuda_graphs:
            return self.model.denoise(prefix, noise, ffn=ffn)
        if self._graph is None or not self._graph.matches(prefix, noise):
            self._graph = _DenoiseGraph(self.model, prefix, noise)
        return self._graph.replay(prefix, noise)


class _DenoiseGraph:
    """A CUDA graph of the whole denoising loop for one (batch, prefix length, mask) shape.

    The loop's inputs are the noise and the prefix's valid lengths/key mask; its outputs the
    actions. Replaying costs one launch instead of thousands of kernel launches. Only built on a
    CUDA device.
    """

    def __init__(self, model: Pi05Model, prefix: Prefix, noise: Tensor):
        self.model = model
        self.noise = noise.clone()
        self.valid_len = prefix.valid_len.clone()
        self.key_bias = None if prefix.key_bias is None else prefix.key_bias.clone()
        self.length = prefix.length
        self._prefix = Prefix(torch.empty(prefix.embeds.shape[0], self.length, 0, device=noise.device),
                              prefix.positions, self.key_bias, self.valid_len)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph
            model.denoise(self._prefix, self.noise)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = model.denoise(self._prefix, self.noise)

    def matches(self, prefix: Prefix, noise: Tensor) -> bool:
        same_mask = (prefix.key_bias is None) == (self.key_bias is None)
        return same_mask and prefix.length == self.length and noise.shape == self.noise.shape

    def replay(self, prefix: Prefix, noise: Tensor) -> Tensor:
        self.noise.copy_(noise)
        self.valid_len.copy_(prefix.valid_len)
        if self.key_bias is not None:
            self.key_bias.copy_(prefix.key_bias)
        self.graph.replay()
        return self.out.clone()
