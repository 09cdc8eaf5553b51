"""Offline neuron masks (``vla_runtime.cache.masks``): the group tiling rule, the mask of a group
against a plain-Python reading of rMuscle Eq. 1 and §5, and the contribution recorder.

The Eq. 4 use of the masks and the recorder's formula are in test/cache/test_dual_cache.py; these
tests pin the boundaries the mutation run (docs/mutation.md) found unchecked.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from vla_runtime.cache.masks import DEFAULT_GROUPS, ContributionRecorder, even_groups, group_masks, validate_groups
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_


def plain_group_mask(scores: torch.Tensor, a: int, b: int, layer: int, k: int) -> list[int]:
    """One group's mask for one layer, written out: each step's top-k neurons are candidates,
    the union is ranked by the score summed over the group's steps, the top k kept, ascending."""
    candidates: set[int] = set()
    for step in range(a, b):
        row = scores[step, layer].tolist()
        candidates |= set(sorted(range(len(row)), key=lambda n: -row[n])[:k])
    summed = {n: sum(float(scores[s, layer, n]) for s in range(a, b)) for n in candidates}
    return sorted(sorted(candidates, key=lambda n: -summed[n])[:k])


def test_group_masks_follow_the_plain_rule_per_layer_and_group():
    """Several steps, layers and groups, so that each layer's candidates must come from that
    layer's own per-step top k (not another layer's, not another step's). The scores are a random
    permutation of distinct values, so there are no ties and the mask is unique."""
    steps, depth, h, rho = 6, 3, 20, 0.2
    g = torch.Generator().manual_seed(1)
    scores = torch.randperm(steps * depth * h, generator=g).float().reshape(steps, depth, h)
    groups = ((0, 2), (2, 5), (5, 6))
    k = math.ceil(rho * h)
    masks = group_masks(scores, groups, rho)
    assert masks.shape == (3, depth, k) and masks.dtype == torch.int64
    for gi, (a, b) in enumerate(groups):
        for layer in range(depth):
            assert masks[gi, layer].tolist() == plain_group_mask(scores, a, b, layer, k), (gi, layer)


def test_a_neuron_never_in_a_steps_top_k_stays_out_however_large_its_sum():
    """Union first, then re-rank: neuron 2 scores 6 at both steps (sum 12, the largest sum) but is
    never in a single step's top 2, so it is not a candidate."""
    scores = torch.tensor([[[9., 8., 6., 0., 0.]], [[0., 0., 6., 9., 7.]]])
    assert group_masks(scores, ((0, 2),), rho_n=2 / 5)[0, 0].tolist() == [0, 3]


@pytest.mark.parametrize("rho", [0.0, -0.1, 1.5, 2.0])
def test_rho_outside_zero_one_is_refused_and_named(rho):
    with pytest.raises(ValueError, match=rf"rho_n must be in \(0, 1\], got {rho}"):
        group_masks(torch.rand(2, 1, 4), ((0, 2),), rho)


def test_rho_one_keeps_every_neuron():
    masks = group_masks(torch.rand(2, 2, 5), ((0, 1), (1, 2)), 1.0)
    assert masks.tolist() == [[list(range(5))] * 2] * 2


@pytest.mark.parametrize("groups", [
    ((0, 3), (3, 6), (6, 10)),   # three groups (a check of neighbours must compare g with g + 1)
    ((0, 10),),
    ((0, 1), (1, 10)),
])
def test_groups_tiling_the_steps_in_order_are_accepted(groups):
    assert validate_groups(groups, 10) == groups


@pytest.mark.parametrize("groups", [
    (),                            # no group at all
    ((1, 5), (5, 10)),             # does not start at step 0
    ((0, 5), (5, 9)),              # stops short of the last step
    ((0, 5), (5, 5), (5, 10)),     # an empty group (its anchor would be a step of the next group)
    ((0, 5), (6, 10)),             # a hole
    ((0, 6), (5, 10)),             # an overlap
])
def test_groups_not_tiling_the_steps_are_refused_naming_them(groups):
    with pytest.raises(ValueError, match=rf"mask groups {re.escape(str(groups))} must tile the 10 denoising steps"):
        validate_groups(groups, 10)


@pytest.mark.parametrize("steps,count", [(10, 1), (10, 2), (10, 3), (10, 10), (7, 3), (1, 1)])
def test_even_groups_tile_the_steps_with_sizes_one_apart(steps, count):
    """``count`` groups that tile the steps (the validator's rule), longest first, no two sizes
    more than one step apart: each group's anchor as far from the next as the count allows."""
    groups = even_groups(steps, count)
    assert validate_groups(groups, steps) == groups and len(groups) == count
    sizes = [b - a for a, b in groups]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_two_even_groups_of_ten_steps_are_the_default():
    assert even_groups(10, 2) == even_groups(10, None) == DEFAULT_GROUPS
    assert even_groups(10, 1) == ((0, 10),)


@pytest.mark.parametrize("count", [0, -1, 11, 2.0, True, "2"])
def test_a_group_count_outside_one_to_the_steps_is_refused_naming_it(count):
    with pytest.raises(ValueError, match=rf"from 1 to the 10 denoising steps, got {re.escape(repr(count))}"):
        even_groups(10, count)


def test_recorder_follows_eq1_when_the_row_count_changes():
    """The recorder keeps one activation buffer; a call with another row count (batch 2 after
    batch 1) must get a buffer of its own size. Scores follow Eq. 1: sum over rows of |h| times
    the down column's norm. Same float32 kernels on both sides, one summation order apart over
    at most 2 x chunk rows: rtol 1e-5."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=3)
    cfg = model.cfg
    model.setup_caches(2)
    rec = ContributionRecorder(model)
    mlp = model.expert_layers[0].mlp
    g = torch.Generator().manual_seed(0)
    for step, batch in ((0, 1), (1, 2), (2, 1)):
        x = torch.randn(batch, cfg.chunk_size, cfg.expert.width, generator=g)
        with torch.no_grad():
            rec(0, step, mlp, x, model.workspace.narrow(batch))
            act = torch.empty(batch * cfg.chunk_size, cfg.expert.mlp_dim)
            mlp(x, act_out=act)
        torch.testing.assert_close(rec.scores[step, 0], act.abs().sum(0) * mlp.down_t.norm(dim=1),
                                   rtol=1e-5, atol=0.0)
