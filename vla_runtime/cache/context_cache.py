"""Context Cache (rMuscle §4.1, Eq. 2-3): reuse a reference's VLM FFN outputs for visual tokens.

At every VLM layer the current post-norm FFN inputs of the visual tokens are compared with the
reference's; only the ceil(rho_p * Pv) tokens that drifted most (relative RMS of the difference)
go through gate/up/activation/down, and their outputs are scattered into a buffer holding the
reference outputs. Instruction and state tokens are always recomputed, attention stays dense.
The choice looks at FFN inputs only, so deciding costs no FFN work. The recompute-and-scatter
runs through ``vla_runtime.kernels.selected_row_ffn`` (a CUDA kernel with CuPy, else the torch
fallback: one MLP call over the gathered rows, as before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels import selected_row_ffn
from ..models.gemma import GemmaMLP
from .entry import PreparedEntry

DRIFT_EPS = 1e-6


def token_drift(x: Tensor, ref: Tensor) -> Tensor:
    """Per-token ``RMS(x - ref) / max(RMS(x), eps)`` over the feature dimension, in fp32.

    Computed as a ratio of L2 norms (the RMS's 1/sqrt(n) cancels; the floor scales with it):
    five operations per VLM layer instead of nine, which at ``pi05-mw``'s widths is what the
    drift costs."""
    xf, rf = x.float(), ref.float()
    den = torch.linalg.vector_norm(xf, dim=-1).clamp_min_(DRIFT_EPS * math.sqrt(x.shape[-1]))
    return torch.linalg.vector_norm(xf - rf, dim=-1).div_(den)


@dataclass
class ContextCache:
    """A ``PrefillFFN`` for one call (batch of one) against one prepared reference."""

    entry: PreparedEntry
    rho_p: float
    recomputed: list[int] = field(default_factory=list)  # visual rows recomputed per layer (diagnostics)

    def __post_init__(self) -> None:
        if not 0.0 < self.rho_p <= 1.0:
            raise ValueError(f"rho_p must be in (0, 1], got {self.rho_p}")

    def __call__(self, layer: int, mlp: GemmaMLP, x: Tensor) -> Tensor:
        if x.shape[0] != 1:
            raise ValueError("the Context Cache serves one observation at a time (batch 1)")
        if x.shape[1] < self.entry.visual_tokens:
            raise ValueError("the Context Cache needs the visual tokens in the prefill (no history window)")
        pv = self.entry.visual_tokens
        k = min(pv, math.ceil(self.rho_p * pv))
        idx = token_drift(x[0, :pv], self.entry.ffn_in[layer]).topk(k, sorted=False).indices
        rows = torch.cat([idx, torch.arange(pv, x.shape[1], dtype=idx.dtype, device=idx.device)])
        out = torch.empty_like(x)
        out[0, :pv] = self.entry.ffn_out[layer]
        selected_row_ffn(x[0], rows, mlp.gate_up, mlp.down_t, out=out[0])
        self.recomputed.append(k)
        return out
