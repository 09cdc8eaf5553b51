"""Observation history of K frames with incremental prefill (Reflex §3.1), for models that take one.

Each frame's prefix states depend on that frame alone (frame tokens attend within their frame),
so they are computed once, when the frame arrives, and kept in a preallocated FIFO of K slots.
Per call the window is merged, oldest first, into the contiguous per-layer KV cache (keys
re-rotated to their position in the window: RoPE composes, so a key rotated for its place inside
the frame is rotated once more by the frame's offset) and only the prompt tokens (instruction +
state) are prefilled, attending to every frame. Nothing is concatenated and nothing is allocated
per call; the result equals recomputing the whole window with the same attention structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.layers import Rope
from ..models.pi05 import Pi05Model, Prefix
from .dense import DenseEngine, EngineOutput, ModelInputs
from .timing import PhaseTimer


@dataclass(frozen=True)
class HistoryConfig:
    frames: int = 4            # K: frames in the window
    cameras: int = 1           # cameras per frame (their tokens form one frame block)

    def validate(self, model: Pi05Model) -> "HistoryConfig":
        if self.frames < 1 or self.cameras < 1:
            raise ValueError("history frames and cameras must be >= 1")
        if self.cameras > model.cfg.num_cameras:
            raise ValueError(f"{self.cameras} cameras per frame, the model takes {model.cfg.num_cameras}")
        return self

    def max_prefix(self, model: Pi05Model) -> int:
        """Cache rows the window and the prompt need (the caches are sized for it once)."""
        return self.frames * self.cameras * model.cfg.num_image_tokens + model.cfg.max_token_len


class HistoryWindow:
    """The FIFO of frame states (per layer: keys rotated for their place in the frame, values)."""

    def __init__(self, model: Pi05Model, cfg: HistoryConfig):
        self.model = model
        self.cfg = cfg.validate(model)
        c = model.cfg.vlm
        self.frame_tokens = cfg.cameras * model.cfg.num_image_tokens
        p = next(model.parameters())
        shape = (c.depth, cfg.frames, c.num_kv_heads, self.frame_tokens, c.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.count = 0
        local = torch.arange(self.frame_tokens, device=p.device)[None]
        self._frame_rope = Rope.at(local, c.head_dim, c.rope_base, p.dtype)
        # Rotation by each frame's offset in the window, prepared once.
        self._offset_rope = [Rope.at(torch.full((1, self.frame_tokens), j * self.frame_tokens, device=p.device),
                                     c.head_dim, c.rope_base, p.dtype) for j in range(cfg.frames)]

    @property
    def frames(self) -> int:
        return min(self.count, self.cfg.frames)

    def reset(self) -> None:
        self.count = 0

    @torch.no_grad()
    def push(self, frame_tokens: Tensor) -> None:
        """Prefill one new frame (its image tokens, [1, frame_tokens, W]) and evict the oldest."""
        m = self.model
        if frame_tokens.shape[:2] != (1, self.frame_tokens):
            raise ValueError(f"a frame is [1, {self.frame_tokens}, W], got {tuple(frame_tokens.shape)}")
        if not m.caches:
            raise RuntimeError("KV caches not allocated: call setup_caches(1) first")
        x = frame_tokens
        last = len(m.vlm_layers) - 1
        for i, layer in enumerate(m.vlm_layers):      # cache rows [0, frame) serve as scratch
            x = layer(x, self._frame_rope, None, kv_only=(i == last))
        slot = self.count % self.cfg.frames
        n = self.frame_tokens
        for i, cache in enumerate(m.caches):
            self.k[i, slot].copy_(cache.k[0, :, :n])
            self.v[i, slot].copy_(cache.v[0, :, :n])
        self.count += 1

    def merge(self) -> int:
        """Write the window, oldest frame first, into cache rows [0, frames * frame_tokens)."""
        n, k_total = self.frame_tokens, self.cfg.frames
        for j in range(self.frames):
            slot = (self.count - self.frames + j) % k_total
            rope = self._offset_rope[j]
            rows = slice(j * n, (j + 1) * n)
            for i, cache in enumerate(self.model.caches):
                rope.apply(self.k[i, slot].transpose(0, 1)[None], out=cache.k[0:1, :, rows].transpose(1, 2))
                cache.v[0, :, rows].copy_(self.v[i, slot])
        return self.frames * n

    def prompt_prefix(self, tokens: Tensor, token_mask: Tensor) -> Prefix:
        """The prompt tokens as a prefix that continues after the merged window."""
        m = self.model
        start = self.frames * self.frame_tokens
        n_text = int(token_mask.long().cumsum(-1).argmax(-1).max()) + 1 if bool(token_mask.any()) else 0
        w = m.cfg.vlm.width
        embeds = m.embed_tokens(tokens[:, :n_text]) * (w ** 0.5)
        mask = token_mask[:, :n_text]
        positions = start + mask.long().cumsum(-1) - 1
        key_bias = None
        if not bool(mask.all()):
            full = torch.ones(1, start + n_text, dtype=torch.bool, device=mask.device)
            full[:, start:] = mask
            key_bias = torch.zeros(full.shape, dtype=embeds.dtype, device=mask.device).masked_fill_(
                ~full, torch.finfo(embeds.dtype).min)[:, None, None, :]
        return Prefix(embeds, positions, key_bias, start + mask.long().sum(-1), start=start)


class HistoryEngine(DenseEngine):
    """Calls with a window of the last K observations: vision and VLM work for the newest only."""

    def __init__(self, model: Pi05Model, cfg: HistoryConfig = HistoryConfig()):
        super().__init__(model, max_batch=1)
        model.setup_caches(1, max_prefix=cfg.validate(model).max_prefix(model))
        self.window = HistoryWindow(model, cfg)

    @torch.no_grad()
    def infer(self, inputs: ModelInputs, noise: Tensor | None = None,
              generator: torch.Generator | None = None, select=None) -> EngineOutput:
        """``inputs.images`` holds the newest frame's cameras; older frames come from the window."""
        inputs.validate(self.model)
        if inputs.images.shape[:2] != (1, self.window.cfg.cameras) or not bool(inputs.image_mask.all()):
            raise ValueError(f"a history call takes one frame of {self.window.cfg.cameras} present camera(s)")
        noise = self.make_noise(1, generator) if noise is None else noise.to(self.device, torch.float32)
        timer = PhaseTimer(self.device)
        m = self.model
        with timer.phase("vision"):
            image_tokens, _ = m.embed_images(inputs.images.to(self.device))
        with timer.phase("prefill"):
            self.window.push(image_tokens.to(self.dtype))
            self.window.merge()
            prefix = self.window.prompt_prefix(inputs.tokens.to(self.device), inputs.token_mask.to(self.device))
            m.prefill(prefix)
        with timer.phase("denoise"):
            actions = m.denoise(prefix, noise)
        return EngineOutput(actions, timer.times)


@torch.no_grad()
def full_window_actions(model: Pi05Model, frames: list[Tensor], tokens: Tensor, token_mask: Tensor,
                        noise: Tensor) -> Tensor:
    """The reference: every frame of the window recomputed in one prefill, frames attending only
    within themselves and the prompt attending to all (what the incremental path must equal).

    ``frames``: oldest first, each [1, cameras, 3, S, S].
    """
    image_tokens = torch.cat([model.embed_images(f)[0] for f in frames], dim=1)
    n, per = len(frames), image_tokens.shape[1] // len(frames)
    w = model.cfg.vlm.width
    n_text = int(token_mask.long().cumsum(-1).argmax(-1).max()) + 1
    text = model.embed_tokens(tokens[:, :n_text]) * (w ** 0.5)
    embeds = torch.cat([image_tokens, text], dim=1)
    total = embeds.shape[1]
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for j in range(n):
        allowed[j * per:(j + 1) * per, j * per:(j + 1) * per] = True
    valid = torch.cat([torch.ones(n * per, dtype=torch.bool), token_mask[0, :n_text]])
    allowed[n * per:, :] = valid[None, :]
    g = model.cfg.vlm.num_heads // model.cfg.vlm.num_kv_heads
    bias = torch.zeros(total, total).masked_fill_(~allowed, torch.finfo(embeds.dtype).min)
    bias = bias.repeat_interleave(g, dim=0)[None, None]          # rows are (token, head-in-group)
    positions = torch.cat([torch.arange(n * per), n * per + token_mask[0, :n_text].long().cumsum(-1) - 1])[None]
    prefix = Prefix(embeds, positions, bias, (n * per + token_mask[:, :n_text].long().sum(-1)))
    model.prefill(prefix)
    suffix_bias = torch.zeros(1, 1, 1, total, dtype=embeds.dtype).masked_fill_(~valid[None, None, None, :],
                                                                                torch.finfo(embeds.dtype).min)
    return model.denoise(Prefix(embeds, positions, suffix_bias, prefix.valid_len), noise)
