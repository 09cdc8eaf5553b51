"""Offline neuron masks of the Action Cache (rMuscle Eq. 1 and §5).

A dense denoising run of a reference call records, for every step t, expert layer l and neuron
n, the contribution ``c = (sum over action tokens |h|) * ||W_down[:, n]||_2``. Per step the top
K = ceil(rho_n * H) neurons are candidates; within a group of steps the candidates are united,
ranked by their summed contribution, and the top K form the group's mask.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..models.gemma import GemmaMLP, Workspace
from ..models.pi05 import Pi05Model, Prefix

Groups = tuple[tuple[int, int], ...]
DEFAULT_GROUPS: Groups = ((0, 5), (5, 10))  # pi0.5, 10 steps: anchors at steps 0 and 5
DEFAULT_GROUP_COUNT = len(DEFAULT_GROUPS)   # rMuscle's choice: two masks track the steps' neurons closer than one


def even_groups(num_steps: int, count: int | None = None) -> Groups:
    """``count`` consecutive groups tiling ``num_steps`` denoising steps, as equal as they come
    (the earlier groups one step longer where they do not divide): ``even_groups(10, 2)`` is
    ``DEFAULT_GROUPS``. ``None``: ``DEFAULT_GROUP_COUNT`` (an option left unset).

    Fewer groups mean fewer dense anchor steps and fewer weight gathers per call, and a mask that
    must serve more steps (rMuscle §4.1 measures one mask over ten steps covering fewer of each
    step's important neurons than two, Figure 9): ``build-cache --mask-groups`` lets the half
    timing and ``eval``'s success measure that trade for a model on a machine (at ``pi05-mw`` one
    group paid in time and lost success: docs/cache.md, "One mask group at pi05-mw").
    """
    if count is None:
        count = DEFAULT_GROUP_COUNT
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= num_steps:
        raise ValueError(f"mask groups must be a whole number from 1 to the {num_steps} denoising steps, got {count!r}")
    size, extra = divmod(num_steps, count)
    bounds = [0]
    for g in range(count):
        bounds.append(bounds[-1] + size + (g < extra))
    return tuple(zip(bounds[:-1], bounds[1:]))


def resolve_groups(groups: Groups | None, num_steps: int) -> Groups:
    """Groups a config holds, for a model of ``num_steps`` steps: checked (``validate_groups``),
    or, left unset (None), rMuscle's ``DEFAULT_GROUP_COUNT`` even groups over those steps."""
    return even_groups(num_steps) if groups is None else validate_groups(groups, num_steps)


def validate_groups(groups: Groups, num_steps: int) -> Groups:
    """Groups must tile [0, num_steps) in order; each one's first step is its dense anchor."""
    groups = tuple((int(a), int(b)) for a, b in groups)
    if not groups or groups[0][0] != 0 or groups[-1][1] != num_steps or any(
            a >= b for a, b in groups) or any(groups[i][1] != groups[i + 1][0] for i in range(len(groups) - 1)):
        raise ValueError(f"mask groups {groups} must tile the {num_steps} denoising steps in order")
    return groups


class ContributionRecorder:
    """A dense ``DenoiseFFN`` that records each neuron's contribution score per step and layer."""

    def __init__(self, model: Pi05Model):
        cfg = model.cfg
        dev = model.action_in_proj.weight.device
        self.scores = torch.zeros(cfg.num_steps, cfg.expert.depth, cfg.expert.mlp_dim, device=dev)
        self.down_norm = torch.stack([layer.mlp.down_t.detach().float().norm(dim=1) for layer in model.expert_layers])
        self._act: Tensor | None = None

    def __call__(self, layer: int, step: int, mlp: GemmaMLP, x: Tensor, ws: Workspace) -> Tensor:
        rows = x.shape[0] * x.shape[1]
        if self._act is None or self._act.shape[0] != rows:
            self._act = torch.empty(rows, mlp.mlp_dim, dtype=x.dtype, device=x.device)
        y = mlp(x, ws, act_out=self._act)
        self.scores[step, layer] = self._act.float().abs().sum(0) * self.down_norm[layer]
        return y


def group_masks(scores: Tensor, groups: Groups, rho_n: float) -> Tensor:
    """[G, depth, K] neuron indices from contribution scores [steps, depth, H] (union, then re-rank)."""
    if not 0.0 < rho_n <= 1.0:
        raise ValueError(f"rho_n must be in (0, 1], got {rho_n}")
    steps, depth, h = scores.shape
    groups = validate_groups(groups, steps)
    k = min(h, math.ceil(rho_n * h))
    out = torch.empty(len(groups), depth, k, dtype=torch.int64, device=scores.device)
    for g, (a, b) in enumerate(groups):
        s = scores[a:b]                                          # [steps in group, depth, H]
        candidates = torch.zeros(depth, h, dtype=torch.bool, device=scores.device)
        candidates.scatter_(1, s.topk(k, dim=-1).indices.transpose(0, 1).reshape(depth, -1), True)
        summed = s.sum(0).masked_fill(~candidates, float("-inf"))
        out[g] = summed.topk(k, dim=-1).indices.sort(dim=-1).values
    return out


@torch.no_grad()
def profile_masks(model: Pi05Model, prefix: Prefix, noise: Tensor, groups: Groups, rho_n: float) -> Tensor:
    """Masks of one call: a dense denoising run over an already prefilled ``prefix`` (batch 1)."""
    rec = ContributionRecorder(model)
    model.denoise(prefix, noise, ffn=rec)
    return group_masks(rec.scores, groups, rho_n)
