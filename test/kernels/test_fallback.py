"""The torch fallbacks of vla_runtime.kernels against the model and cache code they stand for.

On CPU the dispatch functions run these fallbacks, and the caches call them, so they must be the
old computation bit for bit: the code the Action Cache and Context Cache ran before the kernels
existed is restated below (``_old_*``) and compared with ``torch.equal``. The fallbacks are also
checked against the plain MLP / norm formulas (fp32 tolerance 1e-5): they are the oracle the
CUDA kernels are measured against on a GPU (test/gpu/gpu_checks.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from vla_runtime import kernels
from vla_runtime.cache.action_cache import ActionCache
from vla_runtime.cache.context_cache import ContextCache, token_drift
from vla_runtime.cache.entry import PreparedEntry, reconstruct_entry
from vla_runtime.cache.masks import profile_masks
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.dense import ModelInputs
from vla_runtime.kernels import fallback
from vla_runtime.models.config import preset
from vla_runtime.models.gemma import GemmaMLP
from vla_runtime.models.layers import RMSNorm, Rope, gelu_tanh_, rms_norm
from vla_runtime.models.pi05 import Pi05Model, init_random_

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    """Whatever the machine has, these tests are about the torch path."""
    monkeypatch.setenv(kernels.ENV_BACKEND, "torch")


def _mlp(width: int = 64, mlp_dim: int = 256, block: int = 64, dtype=torch.float32, seed: int = 0) -> GemmaMLP:
    from vla_runtime.models.config import GemmaConfig

    torch.manual_seed(seed)
    mlp = GemmaMLP(GemmaConfig(width=width, depth=1, mlp_dim=mlp_dim, num_heads=4, head_dim=16, mlp_block=block))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.1)
    return mlp.to(dtype).requires_grad_(False)


def _randn(*shape: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- masked FFN (Action Cache)

def _old_action_step(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, h_anchor: torch.Tensor | None,
                     y_anchor: torch.Tensor, work: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """ActionCache's non-anchor step as it was before it went through vla_runtime.kernels
    (``h_anchor`` None: already folded into ``y_anchor`` by the anchor)."""
    k = w_down.shape[0]
    gu = torch.mm(x, w_gate_up.t(), out=work)
    h = gelu_tanh_(gu[:, :k]).mul_(gu[:, k:])
    if h_anchor is not None:
        h.sub_(h_anchor)
    return torch.addmm(y_anchor, h, w_down, out=out)


def _anchor_state(mlp: GemmaMLP, x_anchor: torch.Tensor, neurons: torch.Tensor):
    act = torch.empty(x_anchor.shape[0], mlp.mlp_dim, dtype=x_anchor.dtype)
    y = mlp(x_anchor, act_out=act).clone()
    return y, act.index_select(1, neurons)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_ffn_is_the_old_action_cache_step_bit_for_bit(dtype):
    mlp = _mlp(dtype=dtype)
    t, k = 10, 96
    neurons = torch.randperm(mlp.mlp_dim, generator=torch.Generator().manual_seed(2))[:k].sort().values
    x_anchor, x_t = _randn(t, 64, dtype=dtype, seed=3), _randn(t, 64, dtype=dtype, seed=4)
    y_anchor, h_anchor = _anchor_state(mlp, x_anchor, neurons)
    w_gu, w_d = fallback.gather_masked_weights(mlp.gate_up, mlp.down_t, neurons)
    work = torch.empty(t, 2 * k, dtype=dtype)
    old = _old_action_step(x_t, w_gu, w_d, h_anchor, y_anchor, work, torch.empty(t, 64, dtype=dtype)).clone()
    for gathered in ((w_gu, w_d), None):  # prepared once per group (the cache), or gathered per call
        new = kernels.masked_ffn(x_t, mlp.gate_up, mlp.down_t, neurons, h_anchor=h_anchor, y_anchor=y_anchor,
                                 gathered=gathered, work=work)
        assert torch.equal(new, old)


def test_masked_ffn_follows_eq4_of_the_dense_activations():
    """y_anchor + (h_t[M] - h_a[M]) @ down_t[M], with h from the dense MLP (fp32, 1e-5)."""
    mlp = _mlp()
    neurons = torch.tensor([0, 3, 64, 65, 130, 255])
    x_anchor, x_t = _randn(7, 64, seed=5), _randn(7, 64, seed=6)
    y_anchor, h_anchor = _anchor_state(mlp, x_anchor, neurons)
    act_t = torch.empty(7, mlp.mlp_dim)
    mlp(x_t, act_out=act_t)
    want = y_anchor + (act_t[:, neurons] - h_anchor) @ mlp.down_t[neurons]
    got = kernels.masked_ffn(x_t, mlp.gate_up, mlp.down_t, neurons, h_anchor=h_anchor, y_anchor=y_anchor)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_masked_ffn_over_every_neuron_without_anchor_is_the_mlp():
    mlp = _mlp()
    x = _randn(5, 64, seed=7)
    got = kernels.masked_ffn(x, mlp.gate_up, mlp.down_t, torch.arange(mlp.mlp_dim))
    torch.testing.assert_close(got, mlp(x), atol=1e-5, rtol=1e-5)


def test_gate_up_rows_address_each_neurons_gate_and_up_rows():
    mlp = _mlp()
    b, w = mlp.block, 64
    neurons = torch.tensor([1, 70, 200])
    rows = fallback.gate_up_rows(neurons, b)
    flat = mlp.gate_up.reshape(-1, w)
    for i, n in enumerate(neurons.tolist()):
        assert torch.equal(flat[rows[i]], mlp.gate_up[n // b, n % b])
        assert torch.equal(flat[rows[len(neurons) + i]], mlp.gate_up[n // b, b + n % b])


def test_gate_up_rows_of_stacked_masks_are_each_masks_rows():
    """Every (group, layer) mask at once ([G, depth, K] -> [G, depth, 2K]), as the Action Cache
    computes them once per call: each slice is that mask's own rows."""
    b = _mlp().block
    masks = torch.stack([torch.randperm(4 * b, generator=torch.Generator().manual_seed(s))[:5]
                         for s in range(6)]).view(2, 3, 5)
    rows = fallback.gate_up_rows(masks, b)
    assert rows.shape == (2, 3, 10)
    for g in range(2):
        for layer in range(3):
            assert torch.equal(rows[g, layer], fallback.gate_up_rows(masks[g, layer], b))


# ----------------------------------------------------------------------------- selected-row FFN (Context Cache)

def _old_context_ffn(x: torch.Tensor, idx: torch.Tensor, pv: int, ref_out: torch.Tensor, mlp: GemmaMLP) -> torch.Tensor:
    """ContextCache's FFN step as it was before it went through vla_runtime.kernels."""
    xv, xt = x[0, :pv], x[0, pv:]
    y_rows = mlp(torch.cat([xv.index_select(0, idx), xt]))
    out = torch.empty_like(x)
    out[0, :pv] = ref_out
    out[0, :pv].index_copy_(0, idx, y_rows[:idx.numel()])
    out[0, pv:] = y_rows[idx.numel():]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_selected_row_ffn_is_the_old_context_cache_step_bit_for_bit(dtype):
    mlp = _mlp(width=96, mlp_dim=256, block=64, dtype=dtype)
    pv, pt = 12, 4
    x = _randn(1, pv + pt, 96, dtype=dtype, seed=8)
    ref_in, ref_out = _randn(1, pv, 96, dtype=dtype, seed=9), _randn(1, pv, 96, dtype=dtype, seed=10)
    entry = PreparedEntry(("e", 0), ref_in, ref_out, torch.tensor([True]), None)
    cache = ContextCache(entry, rho_p=0.4)
    with torch.no_grad():
        new = cache(0, mlp, x)
    idx = token_drift(x[0, :pv], ref_in[0]).topk(math.ceil(0.4 * pv), sorted=False).indices
    assert torch.equal(new, _old_context_ffn(x, idx, pv, ref_out[0], mlp))


@pytest.mark.parametrize("dtype", DTYPES)
def test_selected_row_ffn_scatters_the_mlp_of_chosen_rows_and_keeps_the_rest(dtype):
    mlp = _mlp(dtype=dtype)
    x = _randn(9, 64, dtype=dtype, seed=11)
    rows = torch.tensor([7, 0, 4])
    out = torch.full((9, 64), 3.0, dtype=dtype)
    kernels.selected_row_ffn(x, rows, mlp.gate_up, mlp.down_t, out=out)
    assert torch.equal(out[rows], mlp(x[rows]))
    keep = [i for i in range(9) if i not in rows.tolist()]
    assert torch.all(out[keep] == 3.0)


def test_blocked_mlp_is_gemma_mlp_bit_for_bit():
    mlp = _mlp(width=64, mlp_dim=256, block=64)
    x = _randn(6, 64, seed=12)
    assert torch.equal(fallback.blocked_mlp(x, mlp.gate_up, mlp.down_t), mlp(x))


# ----------------------------------------------------------------------------- norms

@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_is_the_gemma_layer_residual_step(dtype):
    """GemmaLayer: ``x = x + a; h = post_attn_norm(x)``."""
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    norm.refresh()
    x, a = _randn(2, 5, 64, dtype=dtype, seed=13), _randn(2, 5, 64, dtype=dtype, seed=14)
    want_x = x + a
    want_h = norm(want_x)
    res, normed = kernels.fused_add_rms_norm(x.clone(), a, norm.scale, 1e-6)
    assert torch.equal(res, want_x) and torch.equal(normed, want_h)
    plain = kernels.fused_add_rms_norm(x.clone(), None, norm.scale, 1e-6)[1]
    assert torch.equal(plain, rms_norm(x, norm.scale, 1e-6))


def test_fused_add_rms_norm_matches_the_formula_in_fp32():
    x, a = _randn(3, 64, seed=15), _randn(3, 64, seed=16)
    scale = 1.0 + 0.1 * _randn(64, seed=17)
    s = x + a
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    torch.testing.assert_close(kernels.fused_add_rms_norm(x.clone(), a, scale, 1e-6)[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_ada_rms_norm_is_the_expert_layer_step(dtype):
    """ExpertLayer: ``h.addcmul_(y, gate); rms_norm(h, 1 + scale, eps, out=normed).add_(shift)``,
    with the modulation table of a real expert layer."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=3)
    m = model.expert_layers[0].modulation[4]
    eps = model.cfg.expert.norm_eps
    w = model.cfg.expert.width
    h, y = _randn(1, 10, w, dtype=dtype, seed=18), _randn(1, 10, w, dtype=dtype, seed=19)
    want_h = h.clone().addcmul_(y, m[0, 2])
    want_n = rms_norm(want_h, m[1, 0], eps, out=torch.empty_like(h)).add_(m[1, 1])
    res, normed = kernels.fused_add_ada_rms_norm(h.clone(), y, m[0, 2], m[1, 0], m[1, 1], eps,
                                                 out=torch.empty_like(h))
    assert torch.equal(res, want_h) and torch.equal(normed, want_n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_replay_an_expert_layer_bit_for_bit(dtype):
    """The expert layer's forward restated with the fused ops gives its residual stream exactly."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=5).to(dtype)
    model.setup_caches(1)
    cfg, layer, ws = model.cfg, model.expert_layers[1], model.workspace.narrow(1)
    t, start = cfg.chunk_size, 20
    rope = Rope.at(start + torch.arange(t)[None], cfg.expert.head_dim, cfg.expert.rope_base, dtype)
    h0 = _randn(1, t, cfg.expert.width, dtype=dtype, seed=20)
    with torch.no_grad():
        ws.h.copy_(h0)
        layer(3, rope, start, None, ws)
        want = ws.h.clone()
        ws.h.copy_(h0)
        m, eps = layer.modulation[3], cfg.expert.norm_eps
        _, n = kernels.fused_add_ada_rms_norm(ws.h, None, None, m[0, 0], m[0, 1], eps, out=ws.normed)
        a = layer.attn(n, rope, start, None, ws)
        _, n = kernels.fused_add_ada_rms_norm(ws.h, a, m[0, 2], m[1, 0], m[1, 1], eps, out=ws.normed)
        ws.h.addcmul_(layer.mlp(n, ws), m[1, 2])
    assert torch.equal(ws.h, want)


# ----------------------------------------------------------------------------- the caches, end to end

def _inputs(cfg, seed: int, base: torch.Tensor | None = None) -> ModelInputs:
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(1, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    if base is not None:
        images = (base + 0.3 * (images - base)).clamp(-1, 1)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :12] = True
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_token_len), generator=torch.Generator().manual_seed(0))
    return ModelInputs(images, torch.ones(1, cfg.num_cameras, dtype=torch.bool), tokens, mask)


def test_cached_engine_actions_are_unchanged_by_the_kernel_dispatch(monkeypatch):
    """The cached engine through vla_runtime.kernels (fallbacks) vs with the caches' old FFN code."""
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=7)
    cfg = model.cfg
    ref = _inputs(cfg, 1)
    cur = _inputs(cfg, 2, base=ref.images)
    model.setup_caches(1)
    entry = reconstruct_entry(model, ("ep", 0), ref.images[0], ref.image_mask[0], ref.tokens[0], ref.token_mask[0],
                              None)
    image_tokens, _ = model.embed_images(ref.images)
    prefix = model.build_prefix(image_tokens, ref.image_mask, ref.tokens, ref.token_mask)
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.prefill(prefix)
        entry.masks = profile_masks(model, prefix, noise, CacheConfig().validate(cfg.num_steps).groups, 0.5)
    engine = CachedEngine(model, CacheConfig(rho_p=0.4, rho_n=0.5))
    new = engine.infer(cur, noise=noise, select=lambda f, i: entry).actions

    def old_action_call(self, layer, step, mlp, x, ws):
        if step in self.anchors:
            return self._anchor(layer, step, mlp, x, ws)
        b = self.buf
        # what the group's anchor gathered (its gate/up rows kept transposed, as a step reads them)
        w_gate_up_t, w_down = self.gathered[self.group_of[step]][layer]
        _old_action_step(x[0], w_gate_up_t.t(), w_down, None, b.y_anchor[layer], b.gate_up, ws.mlp_out[0])   # h_a folded
        return ws.mlp_out

    def old_context_call(self, layer, mlp, x):
        pv = self.entry.visual_tokens
        k = min(pv, math.ceil(self.rho_p * pv))
        idx = token_drift(x[0, :pv], self.entry.ffn_in[layer]).topk(k, sorted=False).indices
        self.recomputed.append(k)
        return _old_context_ffn(x, idx, pv, self.entry.ffn_out[layer], mlp)

    monkeypatch.setattr(ActionCache, "__call__", old_action_call)
    monkeypatch.setattr(ContextCache, "__call__", old_context_call)
    old = engine.infer(cur, noise=noise, select=lambda f, i: entry).actions
    assert torch.equal(new, old)
