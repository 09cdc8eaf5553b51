"""Each pipeline role's model (``keep_only``) does its job exactly, and only its job.

The reference is the full model loaded normally from the same checkpoint: the vision/cache role
must leave the same prefix K/V (and retrieval features) and rebuild the same reference entry, the
policy role must denoise the same actions from those K/V. The roles run the very same kernels on
the very same weights, so the comparisons are bit-exact (``torch.equal``), for the private load
(released tensors never read) and for the shared mapping (released views dropped) alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vla_runtime.cache.entry import reconstruct_entry
from vla_runtime.models.checkpoint import load_checkpoint
from vla_runtime.models.config import preset
from vla_runtime.models.parts import (ALL_PARTS, ROLE_PARTS, ModelPart, ReleasedModule, ReleasedPartError, part_of,
                                      role_parts, weight_bytes)
from vla_runtime.models.pi05 import Pi05Model, init_random_

SHARING = [False, True]


def _load(ckpt: Path, cache_dir: Path, share: bool, parts=None) -> Pi05Model:
    model = load_checkpoint(ckpt, share_weights=share, cache_dir=cache_dir, parts=parts).model
    model.setup_caches(1)
    return model


def _inputs(cfg, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(1, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_token_len), generator=g)
    token_mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    token_mask[0, :7] = True
    noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=g)
    return images, torch.ones(1, cfg.num_cameras, dtype=torch.bool), tokens, token_mask, noise


def _prefill(model: Pi05Model, images, image_mask, tokens, token_mask):
    """Vision + prefill; the prefix, the retrieval tap and the K/V rows written."""
    image_tokens, tapped = model.embed_images(images, model.cfg.retrieval_layer)
    prefix = model.build_prefix(image_tokens, image_mask, tokens, token_mask)
    model.prefill(prefix)
    p = prefix.length
    kv = [(c.k[:, :, :p].clone(), c.v[:, :, :p].clone()) for c in model.caches]
    return prefix, tapped, kv


@pytest.fixture(scope="module")
def full(tiny_checkpoint_dir: Path, tmp_path_factory):
    """The full model's prefix K/V and actions for one call (the oracle)."""
    model = _load(tiny_checkpoint_dir, tmp_path_factory.mktemp("w"), share=False)
    images, image_mask, tokens, token_mask, noise = _inputs(model.cfg)
    prefix, tapped, kv = _prefill(model, images, image_mask, tokens, token_mask)
    actions = model.denoise(prefix, noise)
    return {"model": model, "prefix": prefix, "tapped": tapped, "kv": kv, "actions": actions,
            "inputs": (images, image_mask, tokens, token_mask), "noise": noise}


def test_every_tensor_of_the_model_belongs_to_one_part():
    model = Pi05Model(preset("pi05-tiny"))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    by_part = {part_of(model.cfg, n) for n in names}
    assert by_part == ALL_PARTS
    with pytest.raises(ValueError, match="belongs to no ModelPart"):
        part_of(model.cfg, "lm_head.weight")


@pytest.mark.parametrize("share", SHARING)
@pytest.mark.parametrize("role", ["vision", "cache"])
def test_prefix_roles_leave_the_full_models_prefix_kv(tiny_checkpoint_dir, tmp_path, full, share, role):
    model = _load(tiny_checkpoint_dir, tmp_path, share, role_parts(role))
    assert model.parts == ROLE_PARTS[role]
    _, tapped, kv = _prefill(model, *full["inputs"])
    assert torch.equal(tapped, full["tapped"])
    for (k, v), (fk, fv) in zip(kv, full["kv"]):
        assert torch.equal(k, fk) and torch.equal(v, fv)
    assert model.workspace is None   # no denoising buffers either


@pytest.mark.parametrize("share", SHARING)
def test_policy_role_denoises_the_same_actions_from_the_prefix_kv(tiny_checkpoint_dir, tmp_path, full, share):
    model = _load(tiny_checkpoint_dir, tmp_path, share, role_parts("policy"))
    assert model.parts == {ModelPart.EXPERT}
    for cache, (k, v) in zip(model.caches, full["kv"]):   # what the policy stage does with a prefix slot
        cache.k[:, :, :k.shape[2]].copy_(k)
        cache.v[:, :, :v.shape[2]].copy_(v)
    assert torch.equal(model.denoise(full["prefix"], full["noise"]), full["actions"])


@pytest.mark.parametrize("share", SHARING)
def test_cache_role_reconstructs_the_same_entry(tiny_checkpoint_dir, tmp_path, full, share):
    model = _load(tiny_checkpoint_dir, tmp_path, share, role_parts("cache"))
    images, image_mask, tokens, token_mask = (t[0] for t in full["inputs"])
    masks = torch.zeros(2, model.cfg.expert.depth, 3, dtype=torch.int64)
    got = reconstruct_entry(model, ("ep", 0), images, image_mask, tokens, token_mask, masks)
    want = reconstruct_entry(full["model"], ("ep", 0), images, image_mask, tokens, token_mask, masks)
    assert torch.equal(got.ffn_in, want.ffn_in) and torch.equal(got.ffn_out, want.ffn_out)


@pytest.mark.parametrize("share", SHARING)
def test_a_released_part_fails_loudly_with_what_the_process_holds(tiny_checkpoint_dir, tmp_path, full, share):
    policy = _load(tiny_checkpoint_dir, tmp_path, share, role_parts("policy"))
    vision = _load(tiny_checkpoint_dir, tmp_path, share, role_parts("vision"))
    images, image_mask, tokens, token_mask = full["inputs"]
    with pytest.raises(ReleasedPartError, match=r"embed_images needs the \['vision'\].*holds: \['expert'\]"):
        policy.embed_images(images)
    with pytest.raises(ReleasedPartError, match="prefill needs the"):
        policy.prefill(full["prefix"])
    with pytest.raises(ReleasedPartError, match="denoise needs the"):
        vision.denoise(full["prefix"], full["noise"])
    # Direct use of a released module, past the phase checks: the placeholder names it.
    with pytest.raises(ReleasedPartError, match=r"'vlm_layers.0'.*'vlm' part"):
        policy.vlm_layers[0].mlp
    with pytest.raises(ReleasedPartError, match=r"'time_mlp_in'.*'time_conditioning' part"):
        policy.time_condition(torch.zeros(1))
    with pytest.raises(ReleasedPartError, match=r"'action_in_proj'.*'expert' part"):
        vision.action_in_proj(torch.zeros(1, vision.cfg.action_dim))
    with pytest.raises(ReleasedPartError, match="modulation tables"):
        policy.refresh_derived()   # the tables cannot be rebuilt without the time conditioning
    with pytest.raises(ValueError, match="already released"):
        policy.keep_only(ALL_PARTS)


@pytest.mark.parametrize("share", SHARING)
def test_roles_hold_only_their_parts_and_together_the_whole_model(tiny_checkpoint_dir, tmp_path, full, share):
    held = {role: _load(tiny_checkpoint_dir, tmp_path, share, role_parts(role)) for role in ROLE_PARTS}
    for model in held.values():
        assert all(t.device.type == "cpu" for t in model.parameters())   # nothing left on the meta device
        released = [m for m in model.modules() if isinstance(m, ReleasedModule)]
        assert released and not any(p for m in released for p in m.parameters())
    time_only = init_random_(Pi05Model(preset("pi05-tiny"))).keep_only({ModelPart.TIME})
    total = weight_bytes(held["vision"]) + weight_bytes(held["policy"]) + weight_bytes(time_only)
    assert total == weight_bytes(full["model"])
    assert weight_bytes(held["cache"]) == weight_bytes(held["vision"])
