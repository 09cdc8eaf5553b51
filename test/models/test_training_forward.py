"""The training forward computes what the inference path computes (same weights, same velocity).

This is the check that makes training meaningful: a model trained through ``TrainingForward``
is run through ``Pi05Model.prefill``/``denoise`` (and ``Pi05Policy``) at deployment, so the two
must be the same function of the parameters. Random weights, padded prompts and a masked-out
camera exercise the masking and position logic.
"""

from __future__ import annotations

import torch

from vla_runtime.models.config import preset
from vla_runtime.models.layers import Rope, rms_norm, linear
from vla_runtime.models.pi05 import Pi05Model, Prefix, euler_times, init_random_
from vla_runtime.models.training import TrainingForward, flow_matching_loss


def _inputs(cfg, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(batch, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    image_mask = torch.ones(batch, cfg.num_cameras, dtype=torch.bool)
    tokens = torch.randint(4, cfg.vocab_size, (batch, cfg.max_token_len), generator=g)
    token_mask = torch.zeros(batch, cfg.max_token_len, dtype=torch.bool)
    for b in range(batch):  # different prompt lengths: padding handled per row
        token_mask[b, : 9 + 5 * b] = True
    noise = torch.randn(batch, cfg.chunk_size, cfg.action_dim, generator=g)
    return images, image_mask, tokens, token_mask, noise


def _inference_velocity(model: Pi05Model, prefix: Prefix, x_t: torch.Tensor, step: int) -> torch.Tensor:
    """One step of ``Pi05Model.denoise``'s loop body: the velocity the sampler uses at ``step``."""
    cfg = model.cfg
    b, p = x_t.shape[0], prefix.length
    ws = model.workspace.narrow(b)
    positions = prefix.valid_len[:, None] + torch.arange(cfg.chunk_size)
    rope = Rope.at(positions, cfg.expert.head_dim, cfg.expert.rope_base, torch.float32)
    bias = None
    if prefix.key_bias is not None:
        bias = torch.zeros(b, 1, 1, p + cfg.chunk_size)
        bias[..., :p] = prefix.key_bias
    linear(x_t, model.action_in_proj.weight, model.action_in_proj.bias, out=ws.h)
    for i, layer in enumerate(model.expert_layers):
        layer(step, rope, p, bias, ws, index=i)
    fm = model.final_modulation[step]
    normed = rms_norm(ws.h, fm[0], cfg.expert.norm_eps).add(fm[1])
    return linear(normed, model.action_out_proj.weight, model.action_out_proj.bias).clone()


def _model():
    torch.manual_seed(0)
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=3, std=0.05)
    model.setup_caches(2)
    return model


def test_velocity_matches_inference_at_every_schedule_time():
    model = _model()
    cfg = model.cfg
    images, image_mask, tokens, token_mask, noise = _inputs(cfg)
    image_tokens, _ = model.embed_images(images)
    prefix = model.build_prefix(image_tokens, image_mask, tokens, token_mask)
    model.prefill(prefix)
    fwd = TrainingForward(model)
    with torch.no_grad():
        kv = fwd.prefix(images, image_mask, tokens, token_mask)
        for step, t in enumerate(euler_times(cfg.num_steps)):
            x_t = noise * (0.3 + 0.1 * step)
            ref = _inference_velocity(model, prefix, x_t, step)
            got = fwd.velocity(kv, x_t, torch.full((2,), t))
            assert ref.abs().max() > 1e-2  # a non-trivial velocity
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_masked_camera_and_full_sampler_agree():
    """Integrating the training velocity with Euler steps reproduces ``sample_actions``."""
    model = _model()
    cfg = model.cfg
    images, image_mask, tokens, token_mask, noise = _inputs(cfg, seed=1)
    image_mask[1, 0] = False  # row 1 lacks its first camera
    ref = model.sample_actions(images, image_mask, tokens, token_mask, noise)
    fwd = TrainingForward(model)
    with torch.no_grad():
        kv = fwd.prefix(images, image_mask, tokens, token_mask)
        x = noise.clone()
        for t in euler_times(cfg.num_steps):
            x = x + (-1.0 / cfg.num_steps) * fwd.velocity(kv, x, torch.full((2,), t))
    torch.testing.assert_close(x, ref, rtol=1e-4, atol=1e-5)


def test_loss_has_gradients_for_every_used_parameter():
    model = init_random_(Pi05Model(preset("pi05-tiny")), seed=4, std=0.05).train().requires_grad_(True)
    cfg = model.cfg
    images, image_mask, tokens, token_mask, noise = _inputs(cfg)
    loss = flow_matching_loss(TrainingForward(model), images, image_mask, tokens, token_mask,
                              torch.randn(2, cfg.chunk_size, cfg.action_dim), draws=2,
                              generator=torch.Generator().manual_seed(0))
    loss.backward()
    # Parameters that by design do not influence the actions: the last VLM layer's query rows,
    # output projection, MLP and post-attention norm (only its keys/values are read).
    last = f"vlm_layers.{cfg.vlm.depth - 1}."
    unused = {last + n for n in ("attn.o_weight", "post_attn_norm.weight", "mlp.gate_up", "mlp.down_t")}
    for name, p in model.named_parameters():
        if name in unused:
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"
