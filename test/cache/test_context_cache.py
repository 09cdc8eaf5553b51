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


def mlp_row_reorder_bound(mlp: GemmaMLP, x: torch.Tensor) -> torch.Tensor:
    """First-order worst case, per output element, of how far a float32 ``mlp(x)`` of one token
    can be from the exact value whatever order its sums run in: a length-n dot product is within
    ``n * u * sum|a_k b_k|`` (u the unit roundoff); the gate/up errors go through gelu and the
    product (their derivatives) into the down projection; a few u for each elementwise op."""
    u = torch.finfo(torch.float32).eps / 2
    b = mlp.gate_up.shape[1] // 2
    gate, up_w = (mlp.gate_up[:, :b].reshape(-1, x.numel()).double(),
                  mlp.gate_up[:, b:].reshape(-1, x.numel()).double())
    down = mlp.down_t.double()
    x64 = x.detach().double()
    n_in, n_mid = x.numel(), down.shape[0]
    with torch.enable_grad():
        g = (gate @ x64).detach().requires_grad_(True)
        act_g = torch.nn.functional.gelu(g, approximate="tanh")
        (slope,) = torch.autograd.grad(act_g.sum(), g)
    with torch.no_grad():
        up = up_w @ x64
        err_g = n_in * u * (gate.abs() @ x64.abs())
        err_up = n_in * u * (up_w.abs() @ x64.abs())
        act_g = act_g.detach()
        act = act_g * up
        err_act = slope.abs() * up.abs() * err_g + act_g.abs() * err_up + 4 * u * act.abs()
        return (n_mid * u * (down.abs().t() @ act.abs()) + down.abs().t() @ err_act).float()


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
    # the drifted rows and the instruction/state rows (always recomputed) are a 5-row GEMM here, rows
    # of a 13-row GEMM in ``dense``: each side within ``mlp_row_reorder_bound`` of exact (the rows
    # reach |y| ~ 90; with MKL_CBWR=COMPATIBLE the two differ by 3.1e-5, past assert_close's 1e-5)
    for r in [2, 7, *range(pv, pv + pt)]:
        with torch.no_grad():
            bound = mlp_row_reorder_bound(mlp, x[0, r])
        assert torch.all((out[0, r] - dense[0, r]).abs() <= 2 * bound), r
    with torch.no_grad():                                   # the bound tells a drifted input apart
        undrifted = mlp(ref_in)
    for r in (2, 7):
        assert torch.all((dense[0, r] - undrifted[0, r]).abs() > 2 * mlp_row_reorder_bound(mlp, x[0, r])), r
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
        bound = mlp_row_reorder_bound(mlp, x[0, 3])
    # the recomputed row is a 1-row GEMM, the dense one a row of a 6-row GEMM: each may sum in
    # its own order (a CI machine differed by 1.5e-5), so each side is within ``bound`` of exact
    assert torch.all((out[0, 3] - dense[0, 3]).abs() <= 2 * bound)
    with torch.no_grad():                                   # the bound tells the drifted input apart
        assert torch.all((dense[0, 3] - mlp(entry.ffn_in)[0, 3]).abs() > 2 * bound)
    assert torch.all(out[0, [0, 1, 2, 4, 5]] == 7.0)


def test_wrong_prefill_shapes_are_refused_saying_why(mlp):
    entry = entry_of(torch.randn(1, PV, mlp.down_t.shape[1]), 7.0)
    cache = ContextCache(entry, rho_p=0.5)
    w = entry.ffn_in.shape[-1]
    with pytest.raises(ValueError, match=r"the Context Cache serves one observation at a time \(batch 1\)"):
        cache(0, mlp, torch.zeros(2, PV + 2, w))
    with pytest.raises(ValueError, match=r"the Context Cache needs the visual tokens in the prefill"):
        cache(0, mlp, torch.zeros(1, PV - 1, w))
