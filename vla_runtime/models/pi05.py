"""pi0.5: SigLIP + PaliGemma prefix, Gemma action expert, flow matching with Euler steps.

The model computes; it does not decide. ``Pi05Model`` exposes the three phases the engines
schedule separately:

1. ``embed_images``  - vision tower and projector, one camera batch at a time;
2. ``prefill``       - the VLM over the prefix (images, instruction+state prompt), once per call,
                       writing every layer's keys/values into preallocated caches;
3. ``denoise``       - ``num_steps`` Euler steps of the expert over the action tokens only,
                       attending to that cache, inside static buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import Pi05Config
from .gemma import DenoiseFFN, ExpertLayer, GemmaLayer, PrefillFFN, Workspace, modulation_table
from .layers import KVCache, RMSNorm, Rope, linear, rms_norm, sincos_time_embedding
from .parts import ALL_PARTS, ModelPart, ReleasedPartError, release
from .siglip import SiglipVisionTower


@dataclass
class Prefix:
    """A prefix ready for prefill: embeddings without padding, their positions and key mask.

    ``start`` > 0 means cache rows [0, start) already hold keys/values (an observation history
    merged by ``engine.history``) and ``embeds`` fill rows [start, start + T).
    """

    embeds: Tensor              # [B, T, W_vlm]
    positions: Tensor           # [B, T] int64
    key_bias: Tensor | None     # [B, 1, 1, start + T] additive (0 / -inf-ish) or None when all valid
    valid_len: Tensor           # [B] number of valid prefix tokens (where suffix positions start)
    start: int = 0

    @property
    def length(self) -> int:
        return self.start + self.embeds.shape[1]


def euler_times(num_steps: int) -> list[float]:
    """Flow times visited by the sampler, t_k = 1 - k/steps, rounded to fp32 as the reference does."""
    dt = -1.0 / num_steps
    return [float(torch.tensor(1.0 + k * dt, dtype=torch.float32)) for k in range(num_steps)]


class Pi05Model(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        vw, ew = cfg.vlm.width, cfg.expert.width
        self.vision = SiglipVisionTower(cfg.vision)
        self.projector = nn.Linear(cfg.vision.width, vw)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, vw)
        self.vlm_layers = nn.ModuleList(GemmaLayer(cfg.vlm) for _ in range(cfg.vlm.depth))
        self.expert_layers = nn.ModuleList(ExpertLayer(cfg.expert) for _ in range(cfg.expert.depth))
        self.expert_final_mod = nn.Linear(ew, 3 * ew)
        self.action_in_proj = nn.Linear(cfg.action_dim, ew)
        self.action_out_proj = nn.Linear(ew, cfg.action_dim)
        self.time_mlp_in = nn.Linear(ew, ew)
        self.time_mlp_out = nn.Linear(ew, ew)
        self.register_buffer("final_modulation", torch.zeros(0), persistent=False)
        self.caches: list[KVCache] = []
        self.workspace: Workspace | None = None
        self.dt = -1.0 / cfg.num_steps
        self.parts: frozenset[ModelPart] = ALL_PARTS   # what this instance holds (``keep_only``)

    # ----------------------------------------------------------------- parts held
    def keep_only(self, parts: "frozenset[ModelPart] | set[ModelPart]") -> "Pi05Model":
        """Release every part of the model not in ``parts`` (``models.parts``): its modules are
        replaced by placeholders that raise ``ReleasedPartError`` when used, and its tensors are
        freed once nothing else refers to them. One-way: a released part cannot come back.

        A pipeline process calls this right after loading with its role's parts; KV caches
        already allocated stay attached to the layers that remain.
        """
        parts = frozenset(ModelPart(p) for p in parts)
        missing = parts - self.parts
        if missing:
            raise ValueError(f"cannot keep {sorted(p.value for p in missing)}: already released "
                             f"(this model holds {sorted(p.value for p in self.parts)})")
        release(self, self.cfg, self.parts - parts, parts)
        self.parts = parts
        return self

    def require(self, *parts: ModelPart, phase: str) -> None:
        """Refuse to run ``phase`` without its parts (a clear error instead of a placeholder's
        from deep inside the phase)."""
        lacking = [p.value for p in parts if p not in self.parts]
        if lacking:
            raise ReleasedPartError(f"{phase} needs the {lacking} part(s) of the model, released in this "
                                    f"process (it holds: {sorted(p.value for p in self.parts)})")

    # ----------------------------------------------------------------- derived state
    @torch.no_grad()
    def refresh_derived(self) -> None:
        """Recompute everything derived from the weights (folded norm scales, time modulation).

        Called after loading or initialising weights; the loader does it for you. A model without
        the expert (``keep_only``) has no modulation tables to derive; one with the expert needs
        the time conditioning its tables come from.
        """
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.refresh()
        if ModelPart.EXPERT not in self.parts:
            return
        self.require(ModelPart.TIME, phase="deriving the expert's modulation tables")
        cond = self.time_condition(torch.tensor(euler_times(self.cfg.num_steps), device=self.action_in_proj.weight.device))
        for layer in self.expert_layers:
            layer.set_modulation(cond)
        self.final_modulation = modulation_table(self.expert_final_mod, cond)

    def time_condition(self, t: Tensor) -> Tensor:
        """adaRMS condition of the flow time: sin/cos embedding -> MLP with SiLU after both layers."""
        w = self.time_mlp_in.weight
        emb = sincos_time_embedding(t, self.cfg.expert.width, self.cfg.min_period, self.cfg.max_period).to(w.dtype)
        return torch.nn.functional.silu(self.time_mlp_out(torch.nn.functional.silu(self.time_mlp_in(emb))))

    def setup_caches(self, batch: int, dtype: torch.dtype | None = None, max_prefix: int | None = None) -> None:
        """Allocate the per-layer KV caches and the denoising workspace, once.

        ``max_prefix`` overrides the longest prefix (default: all cameras + the longest prompt),
        e.g. for an observation history window.
        Only the layers this model holds get the caches, and the workspace exists only with the
        expert (``keep_only``).
        """
        cfg = self.cfg
        p = next(self.parameters())   # every parameter has the runtime dtype and device
        dtype = dtype or p.dtype
        max_len = (cfg.max_prefix_len if max_prefix is None else max_prefix) + cfg.chunk_size
        self.caches = [KVCache(batch, cfg.vlm.num_kv_heads, max_len, cfg.vlm.head_dim, dtype, p.device)
                       for _ in range(cfg.vlm.depth)]
        for part, layers in ((ModelPart.VLM, self.vlm_layers), (ModelPart.EXPERT, self.expert_layers)):
            if part in self.parts:
                for cache, layer in zip(self.caches, layers):
                    layer.attn.cache = cache
        self.workspace = None
        if ModelPart.EXPERT in self.parts:
            self.workspace = Workspace.allocate(cfg.expert, batch, cfg.chunk_size, max_len, dtype, p.device)

    @property
    def batch_capacity(self) -> int:
        return 0 if not self.caches else self.caches[0].k.shape[0]

    # ----------------------------------------------------------------- phase 1: vision
    def embed_images(self, images: Tensor, tap_layer: int | None = None,
                     on_tap: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor | None]:
        """images [B, N, 3, H, W] in [-1, 1] -> ([B, N * patches, W_vlm], tapped vision features or None).

        ``on_tap``: called with the tapped features ([B, N, patches, width]) as soon as the tower
        computed them, while its later layers still run (``SiglipVisionTower.forward``)."""
        self.require(ModelPart.VISION, phase="embed_images")
        b, n = images.shape[:2]
        tap = None if on_tap is None else (lambda t: on_tap(t.view(b, n, *t.shape[1:])))
        feats, tapped = self.vision(images.flatten(0, 1).to(self.projector.weight.dtype), tap_layer, tap)
        tokens = self.projector(feats)
        tokens = tokens.view(b, n * tokens.shape[1], tokens.shape[2])
        if tapped is not None:
            tapped = tapped.view(b, n, *tapped.shape[1:])
        return tokens, tapped

    # ----------------------------------------------------------------- phase 2: prefill
    def build_prefix(self, image_tokens: Tensor, image_mask: Tensor, tokens: Tensor, token_mask: Tensor) -> Prefix:
        """Lay out [camera tokens..., prompt tokens] without the padding nobody attends to.

        Cameras masked out in every batch row and trailing prompt padding are dropped: masked keys
        contribute exactly zero to attention and positions count only valid tokens, so the result
        is identical to running the padded prefix, for less work.
        """
        self.require(ModelPart.TEXT, phase="build_prefix")
        b, n_img_tokens, w = image_tokens.shape
        per_cam = self.cfg.num_image_tokens
        n_cams = n_img_tokens // per_cam
        keep_cams = [c for c in range(n_cams) if bool(image_mask[:, c].any())]
        n_text = int(token_mask.long().sum(-1).max()) if token_mask.numel() else 0
        if n_text > 0:
            last = token_mask.long().cumsum(-1).argmax(-1).max()  # furthest last-valid position
            n_text = int(last) + 1
        length = len(keep_cams) * per_cam + n_text
        embeds = torch.empty(b, length, w, dtype=image_tokens.dtype, device=image_tokens.device)
        mask = torch.empty(b, length, dtype=torch.bool, device=image_tokens.device)
        for i, c in enumerate(keep_cams):
            embeds[:, i * per_cam:(i + 1) * per_cam] = image_tokens[:, c * per_cam:(c + 1) * per_cam]
            mask[:, i * per_cam:(i + 1) * per_cam] = image_mask[:, c:c + 1]
        off = len(keep_cams) * per_cam
        if n_text:
            torch.mul(self.embed_tokens(tokens[:, :n_text]), math.sqrt(w), out=embeds[:, off:])
            mask[:, off:] = token_mask[:, :n_text]
        positions = mask.long().cumsum(-1) - 1
        key_bias = None if bool(mask.all()) else _key_bias(mask, embeds.dtype)
        return Prefix(embeds, positions, key_bias, mask.long().sum(-1))

    def prefill(self, prefix: Prefix, ffn: PrefillFFN | None = None) -> None:
        """Run the VLM over the prefix, filling every layer's KV cache rows [0, P).

        The last layer only writes keys/values: its attention output and MLP feed nothing.
        ``ffn`` replaces the MLP call of layers 0..depth-2 (Context Cache, reference recording).
        """
        self.require(ModelPart.VLM, phase="prefill")
        self._check_capacity(prefix.embeds.shape[0], prefix.length)
        rope = Rope.at(prefix.positions, self.cfg.vlm.head_dim, self.cfg.vlm.rope_base, prefix.embeds.dtype)
        x = prefix.embeds
        last = len(self.vlm_layers) - 1
        for i, layer in enumerate(self.vlm_layers):
            x = layer(x, rope, prefix.key_bias, kv_only=(i == last), ffn=ffn, index=i, start=prefix.start)

    # ----------------------------------------------------------------- phase 3: denoise
    def denoise(self, prefix: Prefix, noise: Tensor, ffn: DenoiseFFN | None = None) -> Tensor:
        """Integrate the flow from t=1 (noise) to t=0 with Euler steps; returns [B, chunk, action_dim].

        Only the action expert runs here, over ``chunk`` tokens per step, attending to the prefix
        keys/values left by ``prefill``; the residual stream lives in the static workspace.
        """
        self.require(ModelPart.EXPERT, phase="denoise")
        cfg = self.cfg
        b, p = noise.shape[0], prefix.length
        self._check_capacity(b, p)
        ws = self.workspace.narrow(b)
        if noise.shape[1:] != (cfg.chunk_size, cfg.action_dim):
            raise ValueError(f"noise must be [B, {cfg.chunk_size}, {cfg.action_dim}], got {tuple(noise.shape)}")
        dtype = ws.h.dtype
        positions = prefix.valid_len[:, None] + torch.arange(cfg.chunk_size, device=noise.device)
        rope = Rope.at(positions, cfg.expert.head_dim, cfg.expert.rope_base, dtype)
        bias = None
        if prefix.key_bias is not None:
            bias = torch.zeros(b, 1, 1, p + cfg.chunk_size, dtype=dtype, device=noise.device)
            bias[..., :p] = prefix.key_bias
        x_t = noise.to(torch.float32).clone()
        v_t = torch.empty_like(x_t)
        for step in range(cfg.num_steps):
            linear(x_t if dtype == torch.float32 else x_t.to(dtype), self.action_in_proj.weight,
                   self.action_in_proj.bias, out=ws.h)
            for i, layer in enumerate(self.expert_layers):
                layer(step, rope, p, bias, ws, ffn=ffn, index=i)
            fm = self.final_modulation[step]
            normed = rms_norm(ws.h, fm[0], cfg.expert.norm_eps, out=ws.normed).add_(fm[1])
            if dtype == torch.float32:
                linear(normed, self.action_out_proj.weight, self.action_out_proj.bias, out=v_t)
            else:
                v_t.copy_(linear(normed, self.action_out_proj.weight, self.action_out_proj.bias))
            x_t.add_(v_t.mul_(self.dt))
        return x_t

    # ----------------------------------------------------------------- helpers
    def _check_capacity(self, batch: int, prefix_len: int) -> None:
        if not self.caches:
            raise RuntimeError("KV caches not allocated: call setup_caches(batch) first")
        if batch > self.batch_capacity:
            raise ValueError(f"batch {batch} exceeds the allocated capacity {self.batch_capacity}")
        if prefix_len + self.cfg.chunk_size > self.caches[0].max_len:
            raise ValueError(f"prefix of {prefix_len} tokens exceeds the cache "
                             f"({self.caches[0].max_len - self.cfg.chunk_size})")

    def sample_actions(self, images: Tensor, image_mask: Tensor, tokens: Tensor, token_mask: Tensor,
                       noise: Tensor) -> Tensor:
        """All three phases in one call (the engines time them separately)."""
        image_tokens, _ = self.embed_images(images)
        prefix = self.build_prefix(image_tokens, image_mask, tokens, token_mask)
        self.prefill(prefix)
        return self.denoise(prefix, noise)


def _key_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias.masked_fill_(~mask, torch.finfo(dtype).min)
    return bias[:, None, None, :]


@torch.no_grad()
def init_random_(model: Pi05Model, seed: int = 0, std: float = 0.02) -> Pi05Model:
    """Seeded random weights (tests, benchmarks of sizes with no checkpoint at hand).

    Every tensor gets a non-trivial value, norms included, so no code path is tested on
    zeros or ones that would hide a wrong formula.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.refresh_derived()
    return model.eval().requires_grad_(False)
