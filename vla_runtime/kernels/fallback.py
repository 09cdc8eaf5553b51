"""Pure-torch versions of the CUDA kernels: the CPU path, and the oracle the kernels are checked against.

Each function is the computation the model and cache code performed before the kernels existed,
op for op (same in-place ops, same dtype for every intermediate), and reuses the model's own
primitives (``rms_norm``, ``gelu_tanh_``). Routing a call site through ``vla_runtime.kernels``
therefore changes nothing on CPU, bit for bit; ``test/kernels/test_fallback.py`` holds that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.layers import gelu_tanh_, rms_norm


def gate_up_rows(neurons: Tensor, block: int) -> Tensor:
    """Rows of the flattened blocked ``gate_up`` [nb * 2B, W] holding the gate rows, then the up
    rows, of ``neurons`` [..., K] (block c stores the gate rows of neurons [cB, (c+1)B) then their
    up rows): [..., 2K], so one call serves every (group, layer) mask of a reference."""
    gate = (neurons // block) * (2 * block) + neurons % block
    return torch.cat([gate, gate + block], dim=-1)


def gather_masked_weights(gate_up: Tensor, down_t: Tensor, neurons: Tensor,
                          out: tuple[Tensor, Tensor] | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Compact copies ([2K, W] gate then up rows, [K, W] down rows) of the selected neurons' weights
    (into ``out``, the Action Cache's static buffers, when given). ``rows``: ``gate_up_rows`` of
    ``neurons``, when the caller computed it already."""
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    if rows is None:
        rows = gate_up_rows(neurons, gate_up.shape[1] // 2)
    if out is None:
        return flat.index_select(0, rows), down_t.index_select(0, neurons)
    torch.index_select(flat, 0, rows, out=out[0])
    torch.index_select(down_t, 0, neurons, out=out[1])
    return out


def masked_ffn(x: Tensor, gate_up: Tensor, down_t: Tensor, neurons: Tensor, h_anchor: Tensor | None = None,
               y_anchor: Tensor | None = None, out: Tensor | None = None,
               gathered: tuple[Tensor, Tensor] | None = None, work: Tensor | None = None) -> Tensor:
    """``y_anchor + (h[:, M] - h_anchor) @ down_t[M]`` with ``h = gelu_tanh(x gate^T) * (x up^T)``.

    The Action Cache's non-anchor step (rMuscle Eq. 4), exactly as ``ActionCache`` computed it:
    one matmul against the compact gate/up rows into ``work`` [T, 2K], GELU and product in place,
    then one ``addmm`` into ``out``. ``gathered`` passes compact weights prepared once per group
    (the cache does that at the anchor); without it they are gathered here.
    """
    k = neurons.numel()
    w_gate_up, w_down = gathered if gathered is not None else gather_masked_weights(gate_up, down_t, neurons)
    scratch = StepScratch.of(x.new_empty(x.shape[0], 2 * k) if work is None else work)
    return compact_masked_ffn(x, w_gate_up.t(), w_down, scratch, y_anchor, out, h_anchor)


@dataclass(frozen=True)
class StepScratch:
    """The masked step's [T, 2K] gate/up scratch and its gate and up halves, sliced once: at
    ``pi05-mw``'s widths the slicing and indexing around a step took a fifth of it (31-39 µs a
    step before, 25-33 µs after; docs/cache.md)."""

    gate_up: Tensor
    gate: Tensor
    up: Tensor

    @staticmethod
    def of(work: Tensor) -> "StepScratch":
        k = work.shape[1] // 2
        return StepScratch(work, work[:, :k], work[:, k:])


def compact_masked_ffn(x: Tensor, gate_up_t: Tensor, down: Tensor, scratch: StepScratch,
                       y_anchor: Tensor | None = None, out: Tensor | None = None,
                       h_anchor: Tensor | None = None) -> Tensor:
    """``masked_ffn`` over compact weights already gathered (``gate_up_t`` [W, 2K], the transposed
    gate/up rows; ``down`` [K, W]) with every view made beforehand: the Action Cache's step, op for
    op ``masked_ffn``'s, without the per-step indexing around it."""
    torch.mm(x, gate_up_t, out=scratch.gate_up)
    h = gelu_tanh_(scratch.gate).mul_(scratch.up)
    if h_anchor is not None:
        h.sub_(h_anchor)
    if y_anchor is None:
        return torch.mm(h, down, out=out)
    return torch.addmm(y_anchor, h, down, out=out)


def blocked_mlp(x: Tensor, gate_up: Tensor, down_t: Tensor) -> Tensor:
    """``GemmaMLP.forward`` of rows x [R, W] without a workspace: per block of B neurons, gate/up
    projection, GELU times up, and the block's share of the down projection added into the output
    (``mm`` for the first block, ``addmm_`` after), so the output is rounded once per block."""
    b = gate_up.shape[1] // 2
    out = x.new_empty(x.shape[0], x.shape[1])
    gu = x.new_empty(x.shape[0], 2 * b)
    for c in range(gate_up.shape[0]):
        torch.mm(x, gate_up[c].t(), out=gu)
        act = gelu_tanh_(gu[:, :b]).mul_(gu[:, b:])
        down = down_t[c * b:(c + 1) * b]
        if c == 0:
            torch.mm(act, down, out=out)
        else:
            out.addmm_(act, down)
    return out


def selected_row_ffn(x: Tensor, rows: Tensor, gate_up: Tensor, down_t: Tensor, out: Tensor) -> Tensor:
    """``out[rows] = MLP(x[rows])``; the other rows of ``out`` keep what they hold (the reference's
    FFN outputs in the Context Cache). One MLP call over the gathered rows, as the cache did."""
    out.index_copy_(0, rows, blocked_mlp(x.index_select(0, rows), gate_up, down_t))
    return out


def fused_add_rms_norm(residual: Tensor, delta: Tensor | None, scale: Tensor, eps: float,
                       out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``residual += delta`` (in place), then Gemma RMSNorm of it with fp32 statistics.

    The pre-norm residual step of a PaliGemma layer (``x = x + a; h = post_attn_norm(x)``).
    Returns (residual, normed).
    """
    if delta is not None:
        residual.add_(delta)
    return residual, rms_norm(residual, scale, eps, out=out)


def fused_add_ada_rms_norm(residual: Tensor, delta: Tensor | None, gate: Tensor | None, scale: Tensor,
                           shift: Tensor | None, eps: float, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``residual += delta * gate`` (in place), then adaptive RMSNorm ``rms_norm(residual, scale) + shift``.

    The action expert's gated residual followed by the next adaRMS (``ExpertLayer.forward``):
    ``ws.h.addcmul_(y, gate); rms_norm(ws.h, 1 + scale, eps, out=ws.normed).add_(shift)``.
    ``scale`` is the folded (1 + scale) of the modulation table. Returns (residual, normed).
    """
    if delta is not None:
        if gate is None:
            residual.add_(delta)
        else:
            residual.addcmul_(delta, gate)
    normed = rms_norm(residual, scale, eps, out=out)
    if shift is not None:
        normed.add_(shift)
    return residual, normed
