"""Context Cache (``vla_runtime.cache.context_cache``): the drift measure, the ratio's bounds and
the shapes of prefill it serves. Its output against the dense engine and the plain formulas is
in test/cache/test_dual_cache.py and test/engine/test_cached.py; these tests pin the boundaries
the mutation run (docs/mutation.md) found unchecked.
"""

from __future__ import annotations

import pytest
import torch

from vla_runtime.cache.context_cache import DRIFT_EPS, ContextCache, token_drift
from vla_runtime.cache.entry import PreparedEntry
from vla_runtime.models.config import preset
from vla_runtime.models.gemma import GemmaMLP

PV = 6


def plain_drift(x: list[float], ref: list[float]) -> float:
    """RMS(x - ref) / max(RMS(x), eps) of one token, written out."""
    n = len(x)
    num = (sum((a - b) ** 2 for a, b in zip(x, ref)) / n) ** 0.5
    return num / max((sum(a * a for a in x) / n) ** 0.5, DRIFT_EPS)


def test_token_drift_is_relative_per_token_over_the_last_dimension():
    """Tokens of very different norms, so that a drift not divided by each token's own RMS, or
    reduced over another dimension, ranks them differently. Leading dimensions are kept (a
    [B, T, W] input gives [B, T]). float32 on both sides of a 8-term mean: rtol 1e-5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g) * torch.tensor([0.1, 1.0, 10.0, 100.0, 1.0])[None, :, None]
    ref = x + torch.randn(2, 5, 8, generator=g)
    x[1, 4] = 0.0                                           # a zero token: the eps floor, no division by 0
    got = token_drift(x, ref)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    want = torch.tensor([[plain_drift(x[b, t].tolist(), ref[b, t].tolist()) for t in range(5)] for b in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(token_drift(x[0], ref[0]), want[0], rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("rho", [0.0, -0.5, 1.5, 2.0])
def test_rho_outside_zero_one_is_refused_and_named(rho):
    entry = entry_of(torch.zeros(1, PV, 4), 0.0)
    with pytest.raises(ValueError, match=rf"rho_p must be in \(0, 1\], got {rho}"):
        ContextCache(entry, rho_p=rho)


@pytest.fixture
def mlp() -> GemmaMLP:
    torch.manual_seed(0)
    m = GemmaMLP(preset("pi05-tiny").vlm)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def entry_of(ref_in: torch.Tensor, fill: float) -> PreparedEntry:
    """A one-layer reference whose FFN outputs are all ``fill`` (so a reused row is recognisable)."""
    return PreparedEntry(("e", 0), ref_in, torch.full_like(ref_in, fill), torch.tensor([True]), None)


def test_context_cache_scatters_selected_rows_over_reference_outputs(mlp):
    pv, pt, w = 10, 3, mlp.down_t.shape[1]
    ref_in = torch.randn(1, pv, w)
    x = ref_in.clone()
    x[0, [2, 7]] += 5.0  # two tokens drift a lot
    x = torch.cat([x, torch.randn(1, pt, w)], 1)
    entry = entry_of(ref_in, 9.0)
    with torch.no_grad():
        out = ContextCache(entry, rho_p=0.2)(0, mlp, x)
        dense = mlp(x)
    assert set(token_drift(x[0, :pv], ref_in[0]).topk(2).indices.tolist()) == {2, 7}
    torch.testing.assert_close(out[0, [2, 7]], dense[0, [2, 7]])
    torch.testing.assert_close(out[0, pv:], dense[0, pv:])   # instruction/state rows always recomputed
    keep = [i for i in range(pv) if i not in (2, 7)]
    assert torch.all(out[0, keep] == 9.0)                     # others reuse the reference output


def test_a_prefill_of_visual_tokens_only_is_served(mlp):
    """No instruction or state rows (the boundary: exactly ``visual_tokens`` rows): the most
    drifted token is recomputed, the others keep the reference output."""
    entry = entry_of(torch.randn(1, PV, mlp.down_t.shape[1]), 7.0)
    x = entry.ffn_in.clone()
    x[0, 3] += 4.0
    with torch.no_grad():
        out = ContextCache(entry, rho_p=1 / PV)(0, mlp, x)
        dense = mlp(x)
    torch.testing.assert_close(out[0, 3], dense[0, 3])
    assert torch.all(out[0, [0, 1, 2, 4, 5]] == 7.0)


def test_wrong_prefill_shapes_are_refused_saying_why(mlp):
    entry = entry_of(torch.randn(1, PV, mlp.down_t.shape[1]), 7.0)
    cache = ContextCache(entry, rho_p=0.5)
    w = entry.ffn_in.shape[-1]
    with pytest.raises(ValueError, match=r"the Context Cache serves one observation at a time \(batch 1\)"):
        cache(0, mlp, torch.zeros(2, PV + 2, w))
    with pytest.raises(ValueError, match=r"the Context Cache needs the visual tokens in the prefill"):
        cache(0, mlp, torch.zeros(1, PV - 1, w))
