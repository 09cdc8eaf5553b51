"""Action Cache (rMuscle §4.1, Eq. 4): non-anchor denoising steps compute only masked neurons.

Steps are split into groups, each opened by a dense anchor step of the *current* call. At the
anchor every expert layer keeps its MLP output ``y_a`` and the activations ``h_a[M]`` of the
group's mask M (from the retrieved reference), and gathers the rows of gate, up and down for M
into compact buffers, once per group. A later step of the group then computes only
``h_t[M]`` and outputs ``y_a + (h_t[M] - h_a[M]) @ W_down[M]``: the neurons outside M keep their
anchor contribution instead of being dropped, and no weight outside M is read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kernels.fallback import gate_up_rows
from ..models.config import Pi05Config
from ..models.gemma import GemmaMLP, Workspace, mlp_block
from .masks import Groups, validate_groups


class ActionCacheBuffers:
    """Static buffers for one engine (batch 1): gathered weights and anchor states per layer."""

    def __init__(self, cfg: Pi05Config, k: int, dtype: torch.dtype, device: torch.device):
        e = cfg.expert
        rows = cfg.chunk_size
        self.k = k
        self.w_gate_up = torch.empty(e.depth, 2 * k, e.width, dtype=dtype, device=device)
        self.w_down = torch.empty(e.depth, k, e.width, dtype=dtype, device=device)
        self.y_anchor = torch.empty(e.depth, rows, e.width, dtype=dtype, device=device)
        self.h_anchor = torch.empty(e.depth, rows, k, dtype=dtype, device=device)
        self.act = torch.empty(rows, e.mlp_dim, dtype=dtype, device=device)
        self.gate_up = torch.empty(rows, 2 * k, dtype=dtype, device=device)
        self.block = mlp_block(e)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w_gate_up, self.w_down, self.y_anchor, self.h_anchor, self.act, self.gate_up))

    def gate_up_rows(self, neurons: Tensor) -> Tensor:
        """Rows of the blocked ``gate_up`` (flattened) holding the gate then the up weights of ``neurons``."""
        return gate_up_rows(neurons, self.block)


class ActionCache:
    """A ``DenoiseFFN`` for one call: dense anchors, masked updates in between."""

    def __init__(self, buffers: ActionCacheBuffers, masks: Tensor, groups: Groups, num_steps: int):
        groups = validate_groups(groups, num_steps)
        if masks.ndim != 3 or masks.shape[0] != len(groups) or masks.shape[2] != buffers.k:
            raise ValueError(f"masks must be [{len(groups)}, depth, {buffers.k}], got {tuple(masks.shape)}")
        self.buf = buffers
        self.masks = masks
        self.group_of = [g for g, (a, b) in enumerate(groups) for _ in range(a, b)]
        self.anchors = {a for a, _ in groups}
        # Decided once per call: the CUDA kernel reads M's weights in place, so no gather is needed.
        self.in_place = kernels.would_use_cupy(buffers.y_anchor, "masked_ffn")

    def __call__(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor:
        buf = self.buf
        if x.shape[0] != 1:
            raise ValueError("the Action Cache serves one observation at a time (batch 1)")
        if step in self.anchors:
            return self._anchor(layer, step, mlp, x, ws)
        kernels.masked_ffn(x[0], mlp.gate_up, mlp.down_t, self.masks[self.group_of[step], layer],
                           h_anchor=buf.h_anchor[layer], y_anchor=buf.y_anchor[layer], out=ws.mlp_out[0],
                           gathered=None if self.in_place else (buf.w_gate_up[layer], buf.w_down[layer]),
                           work=buf.gate_up)
        return ws.mlp_out

    def _anchor(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor:
        buf = self.buf
        y = mlp(x, ws, act_out=buf.act)
        neurons = self.masks[self.group_of[step], layer]
        buf.y_anchor[layer].copy_(y[0])
        torch.index_select(buf.act, 1, neurons, out=buf.h_anchor[layer])
        if self.in_place:
            return y
        torch.index_select(mlp.gate_up.view(-1, mlp.gate_up.shape[-1]), 0, buf.gate_up_rows(neurons),
                           out=buf.w_gate_up[layer])
        torch.index_select(mlp.down_t, 0, neurons, out=buf.w_down[layer])
        return y
