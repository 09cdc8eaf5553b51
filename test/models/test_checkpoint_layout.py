"""The checkpoint mapping against the public LeRobot pi05 layout itself, not save-then-load.

``test/data/pi05_lerobot_layout.txt`` is LeRobot's own state_dict listing (names and shapes,
origin in its first line). The tests read it, check that the loader expects exactly those
tensors at full size, then write a pi05-tiny checkpoint tensor by tensor under the listing's
names, each holding values known from its name, load it, and compare every internal weight with
what the public tensor(s) that should feed it hold. The expected mapping is written out here from
the public model's semantics (attention rows q then k then v, ``down(gelu(gate x) * up x)``),
without ``layout_groups``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vla_runtime.models.checkpoint import LEROBOT_PREFIX, load_checkpoint, save_checkpoint
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.checkpoints import public_shapes

LISTING = Path(__file__).resolve().parents[1] / "data" / "pi05_lerobot_layout.txt"
_VIS = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
_LM = "paligemma_with_expert.paligemma.model.language_model."
_EXP = "paligemma_with_expert.gemma_expert.model."
Shape = tuple[int, ...]


def parse_listing(text: str) -> tuple[dict[str, int], dict[str, list[tuple[str, Shape]]], dict[str, Shape]]:
    """(tensors per layer prefix, per-layer suffixes with shapes of layer 0, other keys' shapes).

    Prefixes and keys lose the ``model.`` prefix; layer prefixes end in ``layers.``."""
    counts: dict[str, int] = {}
    layer: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    other: dict[str, tuple[int, ...]] = {}
    section: str | None = None
    shape = r"\(([\d, ]*)\)"

    def dims(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.replace(" ", "").split(",") if x)

    for line in text.splitlines():
        if m := re.fullmatch(r"\s+(\d+)\s+model\.(\S+layers\.)N\.\*", line):
            counts[m[2]] = int(m[1])
        elif m := re.fullmatch(r"model\.(\S+layers\.)0\.\*", line):
            section = m[1]
            layer[section] = []
        elif line.startswith("Other non-layer keys"):
            section = "other"
        elif not line.strip():
            section = None
        elif section == "other" and (m := re.fullmatch(rf"\s+model\.(\S+)\s+{shape}", line)):
            other[m[1]] = dims(m[2])
        elif section is not None and section != "other" and (m := re.fullmatch(rf"\s+(\S+)\s+{shape}\s+\S+", line)):
            layer[section].append((m[1], dims(m[2])))
    return counts, layer, other


@pytest.fixture(scope="module")
def listing():
    return parse_listing(LISTING.read_text())


def listing_keys(listing, depths: dict[str, int]) -> set[str]:
    """Every public key of the listing for the given depth per layer prefix."""
    _, layer, other = listing
    keys = set(other)
    for prefix, suffixes in layer.items():
        keys |= {f"{prefix}{i}.{s}" for i in range(depths[prefix]) for s, _ in suffixes}
    return keys


def test_listing_is_complete(listing):
    counts, layer, other = listing
    assert set(counts) == set(layer) == {_VIS + "encoder.layers.", _LM + "layers.", _EXP + "layers."}
    assert {p: counts[p] // len(layer[p]) for p in counts} == {
        _VIS + "encoder.layers.": 27, _LM + "layers.": 18, _EXP + "layers.": 18}
    assert all(counts[p] % len(layer[p]) == 0 for p in counts)
    assert sum(counts.values()) + len(other) == int(re.search(r"num state_dict entries: (\d+)", LISTING.read_text())[1])


def test_full_size_loader_expects_exactly_the_listed_tensors(listing):
    """Names and shapes of the full pi05 preset equal LeRobot's, tensor by tensor."""
    counts, layer, other = listing
    want = dict(other)
    for prefix, suffixes in layer.items():
        for i in range(counts[prefix] // len(suffixes)):
            want |= {f"{prefix}{i}.{s}": shape for s, shape in suffixes}
    got = public_shapes(preset("pi05"))
    assert sorted(set(got) ^ set(want)) == []
    assert {k: got[k] for k in want if got[k] != want[k]} == {}


def _known_tensor(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Values determined by the key's name alone (a seed from its hash): distinct per tensor and
    per element, so any swap, transpose or reorder of rows shows."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.fixture(scope="module")
def known(listing, tmp_path_factory):
    """A pi05-tiny checkpoint written from known values under the listing's names, and its load."""
    cfg = preset("pi05-tiny")
    depths = {_VIS + "encoder.layers.": cfg.vision.depth, _LM + "layers.": cfg.vlm.depth,
              _EXP + "layers.": cfg.expert.depth}
    shapes = public_shapes(cfg)
    keys = listing_keys(listing, depths)
    assert keys == set(shapes), sorted(keys ^ set(shapes))
    d = tmp_path_factory.mktemp("known")
    save_checkpoint(init_random_(Pi05Model(cfg)), d)           # only for its config.json
    tensors = {k: _known_tensor(k, shapes[k]) for k in sorted(keys)}
    save_file({LEROBOT_PREFIX + k: t for k, t in tensors.items()}, str(d / "model.safetensors"))
    return tensors, load_checkpoint(d, compute_hash=False).model


def _attention(pub: dict, src: str, weight_or_bias: str = "weight") -> torch.Tensor:
    return torch.cat([pub[f"{src}self_attn.{x}_proj.{weight_or_bias}"] for x in ("q", "k", "v")])


def test_every_internal_weight_holds_what_its_public_tensor_feeds(known):
    pub, model = known
    sd = model.state_dict()
    expect: dict[str, torch.Tensor] = {
        "vision.patch_embedding.weight": pub[_VIS + "embeddings.patch_embedding.weight"],
        "vision.patch_embedding.bias": pub[_VIS + "embeddings.patch_embedding.bias"],
        "vision.position_embedding": pub[_VIS + "embeddings.position_embedding.weight"],
        "vision.post_layernorm.weight": pub[_VIS + "post_layernorm.weight"],
        "vision.post_layernorm.bias": pub[_VIS + "post_layernorm.bias"],
        "projector.weight": pub["paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight"],
        "projector.bias": pub["paligemma_with_expert.paligemma.model.multi_modal_projector.linear.bias"],
        "embed_tokens.weight": pub[_LM + "embed_tokens.weight"],
        "expert_final_mod.weight": pub[_EXP + "norm.dense.weight"],
        "expert_final_mod.bias": pub[_EXP + "norm.dense.bias"],
    }
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        for p in ("weight", "bias"):
            expect[f"{name}.{p}"] = pub[f"{name}.{p}"]
    for i in range(model.cfg.vision.depth):
        src, dst = f"{_VIS}encoder.layers.{i}.", f"vision.layers.{i}."
        expect[dst + "qkv_weight"] = _attention(pub, src)
        expect[dst + "qkv_bias"] = _attention(pub, src, "bias")
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("out_proj", "self_attn.out_proj"),
                             ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            for p in ("weight", "bias"):
                expect[f"{dst}{ours}.{p}"] = pub[f"{src}{theirs}.{p}"]
    for tower, prefix, depth in (("vlm_layers", _LM + "layers.", model.cfg.vlm.depth),
                                 ("expert_layers", _EXP + "layers.", model.cfg.expert.depth)):
        for i in range(depth):
            src, dst = f"{prefix}{i}.", f"{tower}.{i}."
            expect[dst + "attn.qkv_weight"] = _attention(pub, src)
            expect[dst + "attn.o_weight"] = pub[src + "self_attn.o_proj.weight"]
            expect[dst + "mlp.down_t"] = pub[src + "mlp.down_proj.weight"].t()
            if tower == "vlm_layers":
                expect[dst + "input_norm.weight"] = pub[src + "input_layernorm.weight"]
                expect[dst + "post_attn_norm.weight"] = pub[src + "post_attention_layernorm.weight"]
            else:
                for ours, theirs in (("input_mod", "input_layernorm"), ("post_attn_mod", "post_attention_layernorm")):
                    for p in ("weight", "bias"):
                        expect[f"{dst}{ours}.{p}"] = pub[f"{src}{theirs}.dense.{p}"]
    blocked = {k for k in sd if k.endswith("mlp.gate_up")}           # checked by function below
    assert set(expect) | blocked == set(sd), sorted(set(sd) ^ (set(expect) | blocked))
    wrong = [k for k, t in expect.items() if not torch.equal(sd[k], t)]
    assert wrong == []


@pytest.mark.parametrize("tower", ["vlm_layers", "expert_layers"])
def test_blocked_mlp_computes_the_public_gate_up_down(known, tower):
    """The fused gate/up layout is internal (blocked by neurons); what must hold is the function:
    the layer's MLP equals down(gelu_tanh(gate x) * up x) of the public tensors.

    Tolerance: both sides sum the same products in another order (blocks of neurons vs one
    matmul). With x ~ N(0, 1) and weights 0.1 N(0, 1), pre-activations and activations are O(1)
    and outputs are sums of H <= 256 terms of size ~0.1, |y| ~ 2; float32 rounding of a reordered
    sum of n random-sign terms is typically sqrt(n) * u * |y| = 16 * 6e-8 * 2 ~ 2e-6. 1e-5 allows
    5x that; a wrong row order changes outputs by O(|y|)."""
    pub, model = known
    prefix = _LM + "layers." if tower == "vlm_layers" else _EXP + "layers."
    for i, layer in enumerate(getattr(model, tower)):
        src = f"{prefix}{i}."
        x = torch.randn(5, layer.mlp.down_t.shape[1], generator=torch.Generator().manual_seed(i))
        want = (F.gelu(x @ pub[src + "mlp.gate_proj.weight"].t(), approximate="tanh")
                * (x @ pub[src + "mlp.up_proj.weight"].t())) @ pub[src + "mlp.down_proj.weight"].t()
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp(x), want, atol=1e-5, rtol=1e-5)
