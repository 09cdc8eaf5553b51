"""Action Cache (rMuscle §4.1, Eq. 4): non-anchor denoising steps compute only masked neurons.

Steps are split into groups, each opened by a dense anchor step of the *current* call. At the
anchor every expert layer keeps its MLP output ``y_a`` and the activations ``h_a[M]`` of the
group's mask M (from the retrieved reference), and gathers the rows of gate, up and down for M
into compact buffers, once per group. A later step of the group then computes only
``h_t[M]`` and outputs ``y_a + (h_t[M] - h_a[M]) @ W_down[M]``: the neurons outside M keep their
anchor contribution instead of being dropped, and no weight outside M is read. Where the torch
fallback runs (CPU), the anchor keeps ``y_a - h_a[M] @ W_down[M]`` instead of ``y_a``, so a step
adds ``h_t[M] @ W_down[M]`` to it with no subtraction: at the widths a CPU runs, each operation's
dispatch costs about as much as its arithmetic (the CUDA kernel fuses the subtraction).

The compact buffers are kept per (group, layer) across calls with the neuron set they hold: a
call whose reference repeats the last one's masks (in closed loop most consecutive calls pick the
same reference call while the robot moves slowly through it) reads them as they are instead of
gathering again. At the widths where the fallback runs (CPU) the gathers are a sizeable part of
what the masked steps save.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..kernels.fallback import StepScratch, compact_masked_ffn, gate_up_rows, gather_masked_weights
from ..models.config import Pi05Config
from ..models.gemma import GemmaMLP, Workspace
from .masks import Groups, validate_groups


class ActionCacheBuffers:
    """Static buffers for one engine (batch 1): anchor states per layer and, for the torch fallback,
    the gathered weights per (group, layer).

    A (group, layer)'s gathered weights are allocated at its first gather (a CUDA kernel reads M's
    weights in place and never needs them) and remember what they were gathered from: the neuron
    set and the weight tensors (storage and in-place version), so a gather is skipped only when it
    would copy the very same rows again.
    """

    def __init__(self, cfg: Pi05Config, k: int, dtype: torch.dtype, device: torch.device):
        e = cfg.expert
        rows = cfg.chunk_size
        self.k = k
        self.width = e.width
        self.y_anchor = torch.empty(e.depth, rows, e.width, dtype=dtype, device=device)
        self.h_anchor = torch.empty(e.depth, rows, k, dtype=dtype, device=device)
        self.act = torch.empty(rows, e.mlp_dim, dtype=dtype, device=device)
        self.gate_up = torch.empty(rows, 2 * k, dtype=dtype, device=device)
        # views made once, not per step (at the CPU's widths the indexing cost a fifth of a step)
        self.scratch = StepScratch.of(self.gate_up)
        self.y_rows = self.y_anchor.unbind(0)     # per layer
        self.h_rows = self.h_anchor.unbind(0)
        self._gathered: dict[tuple[int, int], _Gathered] = {}
        self.gathers = 0                         # gathers done (diagnostics: the others were reused)

    def nbytes(self) -> int:
        fixed = sum(t.nbytes for t in (self.y_anchor, self.h_anchor, self.act, self.gate_up))
        return fixed + sum(g.gate_up.nbytes + g.down.nbytes for g in self._gathered.values())

    def gathered_weights(self, group: int, layer: int, mlp: GemmaMLP, neurons: Tensor,
                         rows: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Compact gate/up [2K, W] and down [K, W] rows of ``neurons`` in ``mlp``, gathered into the
        (group, layer) buffers unless they already hold exactly these rows. ``rows()`` gives the
        gate/up rows to gather (``gate_up_rows`` of ``neurons``), asked only when a gather runs."""
        g = self._gathered.get((group, layer))
        if g is None:
            like = self.y_anchor
            g = self._gathered[(group, layer)] = _Gathered(like.new_empty(2 * self.k, self.width),
                                                           like.new_empty(self.k, self.width))
        source = (mlp.gate_up.data_ptr(), mlp.gate_up._version, mlp.down_t.data_ptr(), mlp.down_t._version)
        if g.source != source or g.neurons is None or not torch.equal(g.neurons, neurons):
            g.source = None                      # a failed gather must not leave a stale claim
            gather_masked_weights(mlp.gate_up, mlp.down_t, neurons, out=(g.gate_up, g.down),
                                  rows=None if rows is None else rows())
            g.source, g.neurons = source, neurons.clone()
            self.gathers += 1
        return g.gate_up, g.down

    def gather_ahead(self, mlps: Sequence[GemmaMLP], masks: Tensor) -> int:
        """Gather every (group, layer)'s compact weights for ``masks`` [groups, depth, K] now, before
        the call that will use them: the call's anchors then find them in place and gather nothing.

        Why: the pipeline knows the call's reference once the vision process has chosen it, a
        prefill (milliseconds) before the policy process denoises; the policy process is idle
        meanwhile, so gathering then takes the gathers off the call's path (at ``pi05-mw`` on a
        CPU they cost the Action Cache what its masked steps save). Returns the gathers done (0
        where a CUDA kernel reads the weights in place and nothing needs gathering)."""
        if masks.ndim != 3 or masks.shape[1] != len(mlps) or masks.shape[2] != self.k:
            raise ValueError(f"masks must be [groups, {len(mlps)}, {self.k}], got {tuple(masks.shape)}")
        if kernels.would_use_cupy(self.y_anchor, "masked_ffn"):
            return 0
        before = self.gathers
        rows = gate_up_rows(masks, mlps[0].block)
        for group in range(masks.shape[0]):
            for layer, mlp in enumerate(mlps):
                self.gathered_weights(group, layer, mlp, masks[group, layer], rows=lambda: rows[group, layer])
        return self.gathers - before


@dataclass
class _Gathered:
    """One (group, layer)'s compact weights and what they were gathered from."""

    gate_up: Tensor
    down: Tensor
    source: tuple[int, int, int, int] | None = None    # (data_ptr, version) of gate_up, then of down_t
    neurons: Tensor | None = None


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
        # what each (group, layer)'s anchor gathered, for the group's later steps: the gate/up rows
        # transposed ([W, 2K], what a step multiplies by) and the down rows
        self.gathered: list[list[tuple[Tensor, Tensor] | None]] = [[None] * masks.shape[1] for _ in groups]
        self._gate_up_rows: Tensor | None = None   # of every mask at once, at the call's first gather

    def __call__(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor:
        buf = self.buf
        if x.shape[0] != 1:
            raise ValueError("the Action Cache serves one observation at a time (batch 1)")
        if step in self.anchors:
            return self._anchor(layer, step, mlp, x, ws)
        group = self.group_of[step]
        if self.in_place:
            kernels.masked_ffn(x[0], mlp.gate_up, mlp.down_t, self.masks[group, layer], h_anchor=buf.h_rows[layer],
                               y_anchor=buf.y_rows[layer], out=ws.mlp_out[0])
        else:   # the anchor folded h_a[M] into y_anchor: no subtraction per step
            gate_up_t, down = self.gathered[group][layer]
            compact_masked_ffn(x[0], gate_up_t, down, buf.scratch, y_anchor=buf.y_rows[layer], out=ws.mlp_out[0])
        return ws.mlp_out

    def _anchor(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor:
        buf = self.buf
        if step == 0 and layer == 0:   # a call begins: a captured phase replays over masks rewritten in place
            self._gate_up_rows = None
        y = mlp(x, ws, act_out=buf.act)
        group = self.group_of[step]
        neurons = self.masks[group, layer]
        torch.index_select(buf.act, 1, neurons, out=buf.h_rows[layer])
        if self.in_place:
            buf.y_rows[layer].copy_(y[0])
        else:
            gate_up, down = buf.gathered_weights(group, layer, mlp, neurons, rows=lambda: self._rows(mlp)[group, layer])
            self.gathered[group][layer] = (gate_up.t(), down)
            torch.addmm(y[0], buf.h_rows[layer], down, alpha=-1, out=buf.y_rows[layer])
        return y

    def _rows(self, mlp: GemmaMLP) -> Tensor:
        """[groups, depth, 2K] gate/up rows of every mask (the expert's layers share one block
        size): one index computation per call instead of one per gather."""
        if self._gate_up_rows is None:
            self._gate_up_rows = gate_up_rows(self.masks, mlp.block)
        return self._gate_up_rows
