"""Prepared reference entries: a stored call expanded into the states the caches reuse.

The repository keeps only compact inputs per reference call (images, prompt, state, masks).
Before a reference can serve the Context Cache, its VLM FFN inputs and outputs for the visual
tokens are rebuilt by one dense prefill of those inputs (rMuscle's online reconstruction): that
is a ``PreparedEntry``. Entries live in the sliding working set, never on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.gemma import GemmaMLP
from ..models.pi05 import Pi05Model

EntryKey = tuple[str, int]  # (episode id, call index)


@dataclass
class PreparedEntry:
    key: EntryKey
    ffn_in: Tensor        # [depth - 1, Pv, W] post-norm FFN inputs of the visual tokens, per VLM layer
    ffn_out: Tensor       # [depth - 1, Pv, W] their FFN outputs
    image_mask: Tensor    # [N] bool: the camera layout the states were recorded with
    masks: Tensor | None  # [G, expert depth, K] int64 neuron indices (Action Cache), None: dense denoising
    retrieval: Tensor | None = None       # the stored call's retrieval features (published with the entry)
    state_history: Tensor | None = None   # [L, D] its joint history (the rerank)

    @property
    def visual_tokens(self) -> int:
        return self.ffn_in.shape[1]

    def nbytes(self) -> int:
        n = self.ffn_in.nbytes + self.ffn_out.nbytes + self.image_mask.nbytes
        return n + (0 if self.masks is None else self.masks.nbytes)


class RecordingFFN:
    """A dense MLP that also keeps the visual rows' inputs and outputs of every layer."""

    def __init__(self, layers: int, visual_tokens: int, width: int, dtype: torch.dtype, device: torch.device):
        self.ffn_in = torch.empty(layers, visual_tokens, width, dtype=dtype, device=device)
        self.ffn_out = torch.empty_like(self.ffn_in)

    def __call__(self, layer: int, mlp: GemmaMLP, x: Tensor) -> Tensor:
        y = mlp(x)
        pv = self.ffn_in.shape[1]
        self.ffn_in[layer].copy_(x[0, :pv])
        self.ffn_out[layer].copy_(y[0, :pv])
        return y


@torch.no_grad()
def reconstruct_entry(model: Pi05Model, key: EntryKey, images: Tensor, image_mask: Tensor, tokens: Tensor,
                      token_mask: Tensor, masks: Tensor | None) -> PreparedEntry:
    """Dense vision + prefill of one stored call, recording the reference FFN states.

    images [N, 3, S, S] in [-1, 1], image_mask [N], tokens/token_mask [L]. Uses (and overwrites)
    the model's KV caches, so it must not interleave with a call in flight on the same model.
    """
    image_tokens, _ = model.embed_images(images[None])
    prefix = model.build_prefix(image_tokens, image_mask[None], tokens[None], token_mask[None])
    pv = int(image_mask.sum()) * model.cfg.num_image_tokens
    rec = RecordingFFN(model.cfg.vlm.depth - 1, pv, model.cfg.vlm.width, prefix.embeds.dtype, prefix.embeds.device)
    model.prefill(prefix, ffn=rec)
    return PreparedEntry(key, rec.ffn_in, rec.ffn_out, image_mask.clone(),
                         None if masks is None else masks.to(device=prefix.embeds.device, dtype=torch.int64))
