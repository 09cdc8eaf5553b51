"""The dense (exact) engine: one pi0.5 call from model-ready tensors to an action chunk.

Who decides vs who computes: this engine decides the schedule (phases, batch capacity, noise,
whether a phase replays a captured CUDA graph); ``Pi05Model`` computes. The cached engine of
the muscle-memory cache swaps individual phases and keeps this contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

import torch
from torch import Tensor

from ..models.gemma import DenoiseFFN, PrefillFFN
from ..models.pi05 import Pi05Model, Prefix
from .graphs import Backend, GraphCache
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
    """Exact pi0.5 inference: vision, prefill once, denoise over static buffers.

    With ``cuda_graphs`` (default on a CUDA device) every phase is captured per static shape and
    replayed (``engine.graphs``): vision per camera count, prefill per prefix layout, the whole
    denoising loop per prefix length; the cached engine's Context and Action Caches are captured
    too (fixed rho, so their shapes are static). ``graph_backend="eager"`` runs the same capture
    discipline without CUDA (tests).
    """

    def __init__(self, model: Pi05Model, max_batch: int = 1, tap_retrieval_features: bool = False,
                 cuda_graphs: bool | None = None, graph_backend: Backend | None = None, graph_capacity: int = 8):
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_batch = max_batch
        self.tap_layer = self.cfg.retrieval_layer if tap_retrieval_features else None
        model.setup_caches(max_batch)
        use = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        backend = graph_backend or ("cuda" if self.device.type == "cuda" else "eager")
        self.graphs: GraphCache | None = GraphCache(backend, self.device, graph_capacity) if use else None
        self._static: dict[str, Tensor] = {}

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs is not None

    def disable_graphs(self) -> None:
        """Run eagerly from now on (e.g. after a capture failed on a new driver)."""
        self.graphs = None
        self._static.clear()

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
            image_tokens, tapped = self._vision(inputs.images.to(self.device))
        reference = None
        if select is not None:
            with timer.phase("retrieve"):
                reference = select(tapped, inputs)
        with timer.phase("prefill"):
            prefix = m.build_prefix(image_tokens.to(self.dtype), inputs.image_mask.to(self.device),
                                    inputs.tokens.to(self.device), inputs.token_mask.to(self.device))
            self._prefill(prefix, reference, inputs)
        with timer.phase("denoise"):
            actions = self._denoise(prefix, noise, reference)
        return EngineOutput(actions, timer.times, tapped, reference)

    # ------------------------------------------------------------ hooks of the cached engine
    def _prefill_ffn(self, reference: object | None, inputs: ModelInputs) -> PrefillFFN | None:
        """The dense engine runs every FFN; cached engines substitute the Context Cache here."""
        return None

    def _denoise_ffn(self, reference: object | None) -> DenoiseFFN | None:
        """The dense engine runs every FFN; cached engines substitute the Action Cache here."""
        return None

    def _prefill_ffn_static(self, reference: object | None, inputs: ModelInputs) -> StaticFFN:
        """For a captured prefill: (key, builder) of an FFN over static buffers, which the cached
        engine refills with this call's reference first. Dense: no FFN."""
        return None, _no_ffn

    def _denoise_ffn_static(self, reference: object | None) -> StaticFFN:
        """For a captured denoising loop: as ``_prefill_ffn_static``."""
        return None, _no_ffn

    # ------------------------------------------------------------ phases
    def _vision(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        m = self.model
        if self.graphs is None:
            return m.embed_images(images, self.tap_layer)
        static = self._buffer(f"images{tuple(images.shape)}", images)
        phase = self.graphs.get(("vision", tuple(images.shape)), lambda: lambda: m.embed_images(static, self.tap_layer))
        static.copy_(images)
        tokens, tapped = phase.replay()
        # the features outlive this call (retrieval, the caller): not the graph's output buffer
        return tokens, None if tapped is None else tapped.clone()

    def _prefill(self, prefix: Prefix, reference: object | None, inputs: ModelInputs) -> None:
        m = self.model
        if self.graphs is None:
            m.prefill(prefix, ffn=self._prefill_ffn(reference, inputs))
            return
        ffn_key, build_ffn = self._prefill_ffn_static(reference, inputs)
        bias = prefix.key_bias is not None
        shape = (tuple(prefix.embeds.shape), prefix.start, bias)
        static = self._static_prefix(prefix, shape)

        def build():
            ffn = build_ffn()
            return lambda: m.prefill(static, ffn=ffn)
        phase = self.graphs.get(("prefill", shape, ffn_key), build)
        self._fill_prefix(static, prefix)
        phase.replay()

    def _denoise(self, prefix: Prefix, noise: Tensor, reference: object | None = None) -> Tensor:
        m = self.model
        if self.graphs is None:
            return m.denoise(prefix, noise, ffn=self._denoise_ffn(reference))
        ffn_key, build_ffn = self._denoise_ffn_static(reference)
        bias = prefix.key_bias is not None
        b = noise.shape[0]
        key = ("denoise", b, prefix.length, bias, ffn_key)
        static_noise = self._buffer(f"noise{b}", noise)
        valid_len = self._buffer(f"valid_len{b}", prefix.valid_len)
        key_bias = self._buffer(f"denoise_bias{b},{prefix.length}", prefix.key_bias) if bias else None
        stub = Prefix(torch.empty(b, prefix.length, 0, device=self.device), prefix.positions, key_bias, valid_len)

        def build():
            ffn = build_ffn()
            return lambda: m.denoise(stub, static_noise, ffn=ffn)
        phase = self.graphs.get(key, build)
        static_noise.copy_(noise)
        valid_len.copy_(prefix.valid_len)
        if key_bias is not None:
            key_bias.copy_(prefix.key_bias)
        return phase.replay().clone()

    # ------------------------------------------------------------ static buffers
    def _buffer(self, name: str, like: Tensor) -> Tensor:
        """A persistent buffer shaped like ``like`` (made once per name; graphs read its address)."""
        t = self._static.get(name)
        if t is None:
            t = self._static[name] = torch.empty_like(like, device=self.device)
        return t

    def _static_prefix(self, prefix: Prefix, shape: Hashable) -> Prefix:
        tag = f"prefix{shape}"
        return Prefix(self._buffer(tag + "embeds", prefix.embeds), self._buffer(tag + "positions", prefix.positions),
                      None if prefix.key_bias is None else self._buffer(tag + "bias", prefix.key_bias),
                      self._buffer(tag + "valid_len", prefix.valid_len), prefix.start)

    @staticmethod
    def _fill_prefix(static: Prefix, prefix: Prefix) -> None:
        static.embeds.copy_(prefix.embeds)
        static.positions.copy_(prefix.positions)
        static.valid_len.copy_(prefix.valid_len)
        if static.key_bias is not None:
            static.key_bias.copy_(prefix.key_bias)


StaticFFN = tuple[Hashable, Callable[[], object | None]]


def _no_ffn() -> None:
    return None
