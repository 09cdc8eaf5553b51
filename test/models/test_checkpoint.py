"""Checkpoint loading in the public layouts: round trips, and every refusal the loader promises."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_runtime.models.checkpoint import (
    CheckpointError,
    checkpoint_files,
    content_hash,
    infer_config,
    layout_groups,
    load_checkpoint,
    read_tensor_index,
    save_checkpoint,
    validate,
)
from vla_runtime.models.config import preset
from vla_runtime.models.pi05 import Pi05Model, init_random_
from vla_runtime.testing.checkpoints import header_only_checkpoint, lerobot_features, public_shapes, write_header_only

WEIGHTS = "model.safetensors"
Q_KEY = "model.paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny_model() -> Pi05Model:
    m = init_random_(Pi05Model(preset("pi05-tiny")), seed=1)
    m.setup_caches(1)
    return m


@pytest.fixture()
def ckpt(tmp_path: Path, tiny_model: Pi05Model) -> Path:
    return save_checkpoint(tiny_model, tmp_path / "ckpt")


def _inputs(cfg):
    g = torch.Generator().manual_seed(0)
    s = cfg.vision.image_size
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_token_len), generator=g)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :9] = True
    return (torch.rand(1, cfg.num_cameras, 3, s, s, generator=g) * 2 - 1,
            torch.ones(1, cfg.num_cameras, dtype=torch.bool), tokens, mask,
            torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=g))


@pytest.mark.parametrize("layout", ["lerobot", "openpi"])
def test_round_trip_gives_identical_actions(tmp_path: Path, tiny_model: Pi05Model, layout: str):
    path = save_checkpoint(tiny_model, tmp_path / layout, layout=layout)
    ck = load_checkpoint(path)
    assert ck.layout == layout
    assert ck.content_hash.startswith("sha256:") and len(ck.content_hash) == 7 + 64
    ck.model.setup_caches(1)
    x = _inputs(tiny_model.cfg)
    with torch.no_grad():
        assert torch.equal(ck.model.sample_actions(*x), tiny_model.sample_actions(*x))


def test_public_layout_has_unfused_keys(ckpt: Path):
    keys = set(load_file(str(ckpt / WEIGHTS)))
    assert Q_KEY in keys
    assert Q_KEY.replace("q_proj", "k_proj") in keys
    assert "model.paligemma_with_expert.gemma_expert.model.layers.0.mlp.gate_proj.weight" in keys
    assert "model.paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.weight" in keys
    assert not any("qkv" in k or "gate_up" in k for k in keys)


def test_loads_bf16_checkpoint_into_fp32(tmp_path: Path, ckpt: Path, tiny_model: Pi05Model):
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(ckpt / WEIGHTS)).items()}
    out = tmp_path / "bf16"
    out.mkdir()
    save_file(tensors, str(out / WEIGHTS))
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    ck = load_checkpoint(out)
    p = ck.model.vlm_layers[0].attn.qkv_weight
    assert p.dtype == torch.float32
    ref = tiny_model.vlm_layers[0].attn.qkv_weight
    torch.testing.assert_close(p, ref.to(torch.bfloat16).float())


def test_content_hash_tracks_the_bytes(tmp_path: Path, ckpt: Path):
    h1 = content_hash(checkpoint_files(ckpt))
    assert h1 == content_hash(checkpoint_files(ckpt))
    tensors = load_file(str(ckpt / WEIGHTS))
    tensors[Q_KEY][0, 0] += 1.0
    save_file(tensors, str(ckpt / WEIGHTS))
    assert content_hash(checkpoint_files(ckpt)) != h1


def _rewrite(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(ckpt / WEIGHTS))


def test_refuses_missing_tensor(ckpt: Path):
    _rewrite(ckpt, lambda t: t.pop(Q_KEY))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\):\s+paligemma_with_expert\..*layers\.0\.self_attn\.q_proj\.weight"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError) as refused:   # the refusal names the checkpoint it refuses
        load_checkpoint(ckpt)
    assert str(refused.value).startswith(f"refusing checkpoint {ckpt}:")


def test_refuses_unexpected_tensor(ckpt: Path):
    _rewrite(ckpt, lambda t: t.__setitem__("model.state_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\):\s+state_proj\.weight"):
        load_checkpoint(ckpt)


def test_refuses_misshaped_tensor(ckpt: Path):
    _rewrite(ckpt, lambda t: t.__setitem__(Q_KEY, t[Q_KEY][:-1].clone()))
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors \(1\):\s+.*q_proj\.weight: expected \(96, 96\), found \(95, 96\)"):
        load_checkpoint(ckpt)


def test_refuses_wrong_dtype(ckpt: Path):
    _rewrite(ckpt, lambda t: t.__setitem__(Q_KEY, t[Q_KEY].to(torch.float64)))
    with pytest.raises(CheckpointError, match=r"unsupported dtypes .*\n.*q_proj\.weight: F64"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("cut", [4, 100, 5000])
def test_refuses_truncated_file(ckpt: Path, cut: int):
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(data[: len(data) - cut] if cut > 8 else data[:cut])
    with pytest.raises(CheckpointError, match="truncated file"):
        load_checkpoint(ckpt)


def test_refuses_corrupt_header(ckpt: Path):
    data = bytearray((ckpt / WEIGHTS).read_bytes())
    data[10:20] = b"\x00" * 10
    (ckpt / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(ckpt)


def test_refuses_missing_files(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path / "empty")


def test_sharded_checkpoint(tmp_path: Path, ckpt: Path, tiny_model: Pi05Model):
    tensors = load_file(str(ckpt / WEIGHTS))
    keys = sorted(tensors)
    half = len(keys) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, ks in shards.items() for k in ks}}))
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    ck = load_checkpoint(out)
    torch.testing.assert_close(ck.model.embed_tokens.weight, tiny_model.embed_tokens.weight)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shards listed in the index are missing"):
        load_checkpoint(out)


def test_full_size_layout_matches_lerobot_reference(tmp_path: Path):
    """The full pi05 preset expects exactly LeRobot's 813 tensors and 4,143,404,816 elements
    (test/data/pi05_lerobot_layout.txt; test_checkpoint_layout.py checks it name by name), and the
    architecture is read back from a LeRobot-style config.json plus the tensor shapes alone."""
    cfg = preset("pi05")
    shapes = public_shapes(cfg)
    assert len(shapes) == 813
    assert sum(math.prod(s) for s in shapes.values()) == 4_143_404_816

    meta = lerobot_features(["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"], 0) | {
        "type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
        "chunk_size": 50, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10,
        "tokenizer_max_length": 200}
    ckdir = header_only_checkpoint(tmp_path / "full", cfg, meta)
    index, layout = read_tensor_index(checkpoint_files(ckdir))
    assert layout == "lerobot"
    inferred = infer_config(ckdir, index)
    assert inferred == cfg
    validate(inferred, index, ckdir)


def test_reduced_depth_is_read_off_the_tensors(tmp_path: Path):
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"), lerobot_features(["c0", "c1", "c2"], 0),
                                   layout="openpi")  # no "model." prefix
    index, layout = read_tensor_index(checkpoint_files(ckdir))
    assert layout == "openpi"
    got = infer_config(ckdir, index)
    assert (got.vision.depth, got.vlm.depth, got.expert.depth) == (2, 2, 2)
    assert got.retrieval_layer == 2


EMB = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
HEAD = "paligemma_with_expert.paligemma.lm_head.weight"


def _text_embedding_by_hand(table: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Gemma's text embedding computed independently of the model: row lookup times sqrt(width)."""
    return table[tokens[0, :n]] * math.sqrt(table.shape[1])


@pytest.mark.parametrize("layout", ["lerobot", "openpi"])
def test_embedding_comes_from_embed_tokens_when_the_two_tensors_differ(tmp_path: Path, tiny_model: Pi05Model,
                                                                       layout: str):
    """A file whose embed_tokens and lm_head differ (a fine-tune that trained the embedding) embeds
    text with embed_tokens, as a LeRobot-loaded model does; lm_head must not leak in."""
    path = save_checkpoint(tiny_model, tmp_path / layout, layout=layout)
    prefix = "model." if layout == "lerobot" else ""
    g = torch.Generator().manual_seed(7)
    _rewrite(path, lambda t: t.__setitem__(prefix + HEAD, torch.randn(t[prefix + HEAD].shape, generator=g)))
    stored = load_file(str(path / WEIGHTS))
    assert (stored[prefix + HEAD] - stored[prefix + EMB]).abs().max() > 1.0  # the two really differ
    ck = load_checkpoint(path)
    assert torch.equal(ck.model.embed_tokens.weight, stored[prefix + EMB])
    # The prefix the VLM sees, against a hand computation from the file's embed_tokens. Same fp32
    # lookup and the same single multiply by sqrt(width): bit-identical, so exact equality.
    images, image_mask, tokens, token_mask, noise = _inputs(tiny_model.cfg)
    with torch.no_grad():
        img, _ = ck.model.embed_images(images)
        prefix_embs = ck.model.build_prefix(img, image_mask, tokens, token_mask).embeds
    n_img, n_text = img.shape[1], int(token_mask.sum())
    assert torch.equal(prefix_embs[0, n_img:n_img + n_text], _text_embedding_by_hand(stored[prefix + EMB], tokens, n_text))
    assert not torch.allclose(prefix_embs[0, n_img:n_img + n_text],
                              _text_embedding_by_hand(stored[prefix + HEAD], tokens, n_text))
    # And the actions are those of the model the file was written from (its embedding is embed_tokens).
    ck.model.setup_caches(1)
    with torch.no_grad():
        assert torch.equal(ck.model.sample_actions(images, image_mask, tokens, token_mask, noise),
                           tiny_model.sample_actions(images, image_mask, tokens, token_mask, noise))


@pytest.mark.parametrize("layout", ["lerobot", "openpi"])
def test_embedding_falls_back_to_lm_head_without_embed_tokens(tmp_path: Path, tiny_model: Pi05Model, layout: str):
    """Only a file without embed_tokens (tied weights saved once) embeds text with lm_head."""
    path = save_checkpoint(tiny_model, tmp_path / layout, layout=layout)
    prefix = "model." if layout == "lerobot" else ""
    g = torch.Generator().manual_seed(8)

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[prefix + HEAD] = torch.randn(t.pop(prefix + EMB).shape, generator=g)

    _rewrite(path, edit)
    ck = load_checkpoint(path)
    assert torch.equal(ck.model.embed_tokens.weight, load_file(str(path / WEIGHTS))[prefix + HEAD])


def test_lm_head_may_be_absent_beside_embed_tokens_but_is_shape_checked_when_present(ckpt: Path, tiny_model):
    """LeRobot's layout has both tensors; a file that saved the tied weights once as embed_tokens
    loads without lm_head (it is never read), and an lm_head present must still have its shape."""
    stored = load_file(str(ckpt / WEIGHTS))
    _rewrite(ckpt, lambda t: t.pop("model." + HEAD))
    ck = load_checkpoint(ckpt)
    assert torch.equal(ck.model.embed_tokens.weight, stored["model." + EMB])
    cfg = tiny_model.cfg
    _rewrite(ckpt, lambda t: t.__setitem__("model." + HEAD, torch.zeros(cfg.vocab_size, cfg.vlm.width + 1)))
    with pytest.raises(CheckpointError, match=rf"mis-shaped tensors \(1\):\s+{HEAD}: expected "
                                              rf"\({cfg.vocab_size}, {cfg.vlm.width}\)"):
        load_checkpoint(ckpt)


def test_refuses_checkpoint_without_a_text_embedding(ckpt: Path):
    _rewrite(ckpt, lambda t: (t.pop("model." + EMB), t.pop("model." + HEAD)))
    with pytest.raises(CheckpointError, match="no text embedding: neither .*embed_tokens.* nor .*lm_head"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("listed", [True, False])
def test_empty_camera_counted_once(tmp_path: Path, listed: bool):
    """2 real + 1 empty camera is 3 slots whether or not config.json also lists the empty one as a
    feature (LeRobot does; counting both gave 4)."""
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"),
                                   lerobot_features(["base_0_rgb", "left_wrist_0_rgb"], 1, listed))
    index, _ = read_tensor_index(checkpoint_files(ckdir))
    assert infer_config(ckdir, index).num_cameras == 3


def test_refuses_listed_empty_camera_beyond_empty_cameras(tmp_path: Path):
    meta = lerobot_features(["base_0_rgb"], 2, listed=True) | {"empty_cameras": 1}
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"), meta)
    index, _ = read_tensor_index(checkpoint_files(ckdir))
    with pytest.raises(CheckpointError, match=r"empty_camera_1.*empty_cameras is 1"):
        infer_config(ckdir, index)


@pytest.mark.parametrize("key, name, width", [("action_expert_variant", "gemma_2b", 1024),
                                              ("paligemma_variant", "gemma_300m", 2048)])
def test_refuses_variant_that_contradicts_the_tensors(tmp_path: Path, key: str, name: str, width: int):
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"), lerobot_features(["base_0_rgb"], 0) | {key: name})
    index, _ = read_tensor_index(checkpoint_files(ckdir))
    with pytest.raises(CheckpointError, match=rf"{key}='{name}' means width \d+ .* but the tensors have width {width}") as e:
        infer_config(ckdir, index)
    assert str(e.value).startswith(f"{ckdir}: ")   # which checkpoint says so


def test_variant_names_that_match_are_accepted(tmp_path: Path):
    meta = lerobot_features(["base_0_rgb"], 0) | {"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
    ckdir = header_only_checkpoint(tmp_path / "d2", preset("pi05-d2"), meta)
    index, _ = read_tensor_index(checkpoint_files(ckdir))
    assert infer_config(ckdir, index).expert.width == 1024


def test_variant_checked_against_our_own_architecture_record_too(ckpt: Path):
    """Our checkpoints record the architecture; a variant name beside it must still be true."""
    meta = json.loads((ckpt / "config.json").read_text())
    assert "paligemma_variant" not in meta  # save_checkpoint names no variant for a tiny model
    (ckpt / "config.json").write_text(json.dumps(meta | {"paligemma_variant": "gemma_2b"}))
    with pytest.raises(CheckpointError, match=r"paligemma_variant='gemma_2b' means width 2048 / MLP 16384, "
                                              r"but the tensors have width 96 / MLP 256"):
        load_checkpoint(ckpt)


# ---------------------------------------------------------------- what config.json says, read without our own record

LISTING = Path(__file__).resolve().parents[1] / "data" / "pi05_lerobot_layout.txt"
# config.json key -> Pi05Config field, for what the tensors cannot tell
META_FIELDS = {"chunk_size": "chunk_size", "max_state_dim": "max_state_dim", "num_inference_steps": "num_steps",
               "tokenizer_max_length": "max_token_len", "min_period": "min_period", "max_period": "max_period"}


def _lerobot_default(key: str) -> float:
    """LeRobot's PI05Config default, as the committed listing of the public configuration prints it."""
    for line in LISTING.read_text().splitlines():
        name, sep, value = line.strip().partition(" = ")
        if sep and name == key:
            return float(value)
    raise KeyError(key)


def _infer(tmp_path: Path, meta: dict, name: str = "d2"):
    ckdir = header_only_checkpoint(tmp_path / name, preset("pi05-d2"), meta)
    index, _ = read_tensor_index(checkpoint_files(ckdir))
    return infer_config(ckdir, index)


def test_config_json_values_are_read_and_lerobot_s_defaults_fill_the_absent_ones(tmp_path: Path):
    cams = lerobot_features(["c0", "c1"], 0)
    given = {"chunk_size": 16, "max_state_dim": 24, "num_inference_steps": 5, "tokenizer_max_length": 48,
             "min_period": 0.01, "max_period": 2.5}
    got = _infer(tmp_path, cams | given, "given")
    assert {f: getattr(got, f) for f in META_FIELDS.values()} == {META_FIELDS[k]: v for k, v in given.items()}
    assert got.num_cameras == 2
    # openpi spells the chunk action_horizon; chunk_size wins when both are there
    assert _infer(tmp_path, cams | {"action_horizon": 12}, "openpi").chunk_size == 12
    assert _infer(tmp_path, cams | {"action_horizon": 12, "chunk_size": 20}, "both").chunk_size == 20
    # nothing said: LeRobot's defaults (from the listing, not from our code), and one camera slot
    bare = _infer(tmp_path, {}, "bare")
    assert {f: getattr(bare, f) for f in META_FIELDS.values()} == {f: _lerobot_default(k) for k, f in META_FIELDS.items()}
    assert bare.num_cameras == 1


def test_what_stops_the_architecture_being_read_is_named(tmp_path: Path):
    def refused(edit, name: str) -> str:
        ckdir = header_only_checkpoint(tmp_path / name, preset("pi05-d2"), lerobot_features(["c0"], 0))
        shapes = {k: tuple(v.shape) for k, v in read_tensor_index(checkpoint_files(ckdir))[0].items()}
        edit(shapes)
        (ckdir / WEIGHTS).unlink()
        write_header_only(ckdir / WEIGHTS, {"model." + k: s for k, s in shapes.items()})
        with pytest.raises(CheckpointError) as e:
            infer_config(ckdir, read_tensor_index(checkpoint_files(ckdir))[0])
        return str(e.value)

    action_in = "action_in_proj.weight"
    assert refused(lambda s: s.pop(action_in), "missing") == \
        f"cannot infer the architecture: tensor {action_in} is missing"
    layers = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers."
    assert refused(lambda s: [s.pop(k) for k in list(s) if k.startswith(layers)], "no_layers") == \
        f"cannot infer the architecture: no tensors under {layers}"
    patch = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert refused(lambda s: s.__setitem__(patch, (1024, 3, 14, 14)), "width") == \
        "unknown SigLIP width 1024 (known: [1152])"
    # tensors whose architecture does not validate: the checkpoint's path, then the reason
    second = "paligemma_with_expert.gemma_expert.model.layers.1."
    message = refused(lambda s: [s.pop(k) for k in list(s) if k.startswith(second)], "depths")
    assert message == f"{tmp_path / 'depths'}: invalid pi0.5 config: VLM depth 2 != expert depth 1: " \
                      "the expert attends layer by layer"


def test_what_a_load_returns_describes_the_files_it_read(ckpt: Path, tiny_model: Pi05Model):
    ck = load_checkpoint(ckpt)
    assert ck.config == tiny_model.cfg and ck.path == ckpt and ck.layout == "lerobot"
    assert ck.files == [ckpt / WEIGHTS] and ck.content_hash == content_hash([ckpt / WEIGHTS])
    assert not ck.model.training and not any(p.requires_grad for p in ck.model.parameters())   # inference only
    assert load_checkpoint(ckpt, compute_hash=False).content_hash == "unhashed"


def test_a_long_refusal_lists_twenty_tensors_of_each_kind_then_counts_the_rest(ckpt: Path):
    """25 tensors missing and one unexpected: the first 20 missing by name, "... and 5 more", then
    the unexpected one, each kind under its own title."""
    names = sorted(k.removeprefix("model.") for k in load_file(str(ckpt / WEIGHTS)) if ".layers." in k)[:25]

    def edit(t: dict[str, torch.Tensor]) -> None:
        for k in names:
            t.pop("model." + k)
        t["model.surplus.weight"] = torch.zeros(2)

    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == (f"refusing checkpoint {ckpt}:\n  missing tensors (25):\n    " + "\n    ".join(names[:20])
                            + "\n    ... and 5 more\n  unexpected tensors (1):\n    surplus.weight")


def test_twenty_refused_tensors_are_all_listed_with_no_count_after(ckpt: Path):
    names = sorted(k.removeprefix("model.") for k in load_file(str(ckpt / WEIGHTS)) if ".layers." in k)[:20]
    _rewrite(ckpt, lambda t: [t.pop("model." + k) for k in names])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == f"refusing checkpoint {ckpt}:\n  missing tensors (20):\n    " + "\n    ".join(names)


# ---------------------------------------------------------------- safetensors headers, read by hand


def _raw_header(path: Path) -> tuple[int, dict]:
    """The safetensors format by its specification: an unsigned little-endian u64 n, then n bytes of JSON."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little", signed=False)
    return n, json.loads(data[8:8 + n])


def _file_of(header: bytes, tail: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + tail


def test_header_and_data_sizes_are_checked_to_the_byte(tmp_path: Path, ckpt: Path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(_file_of(b"{}"))                 # no tensors, header exactly to the end of the file
    assert read_tensor_index([f]) == ({}, "openpi")
    f.write_bytes(_file_of(b"{}")[:-1])           # one byte short of what the header declares
    with pytest.raises(CheckpointError) as e:
        read_tensor_index([f])
    assert str(e.value) == f"{f}: truncated file: header declares 2 bytes, file has 9"
    f.write_bytes((2**63 + 5).to_bytes(8, "little") + b"{}")   # a length past the sign bit is still a length
    with pytest.raises(CheckpointError) as e:
        read_tensor_index([f])
    assert str(e.value) == f"{f}: truncated file: header declares {2**63 + 5} bytes, file has 10"
    # tensor data: the last data offset counts from the end of the header
    weights = ckpt / WEIGHTS
    n, header = _raw_header(weights)
    end = max(h["data_offsets"][1] for k, h in header.items() if k != "__metadata__")
    assert weights.stat().st_size == 8 + n + end
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as e:
        read_tensor_index([weights])
    assert str(e.value) == f"{weights}: truncated file: tensors need {8 + n + end} bytes, file has {8 + n + end - 1}"


def test_file_metadata_is_not_a_tensor(tmp_path: Path, ckpt: Path, tiny_model: Pi05Model):
    tensors = load_file(str(ckpt / WEIGHTS))
    save_file(tensors, str(ckpt / WEIGHTS), metadata={"format": "pt"})
    assert "__metadata__" in _raw_header(ckpt / WEIGHTS)[1]
    index, layout = read_tensor_index([ckpt / WEIGHTS])
    assert layout == "lerobot" and sorted(index) == sorted(k.removeprefix("model.") for k in tensors)
    f = tmp_path / "only_metadata.safetensors"
    f.write_bytes(_file_of(b'{"__metadata__": {"format": "pt"}}'))
    assert read_tensor_index([f]) == ({}, "openpi")


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path: Path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"model.x": torch.zeros(2)}, str(a))
    save_file({"model.x": torch.zeros(2)}, str(b))
    with pytest.raises(CheckpointError) as e:
        read_tensor_index([a, b])
    assert str(e.value) == f"tensor model.x appears in two files: {a} and {b}"


def test_lerobot_layout_only_when_every_tensor_has_the_prefix(tmp_path: Path):
    f = tmp_path / "mixed.safetensors"
    save_file({"model.a.weight": torch.zeros(1), "b.weight": torch.zeros(1)}, str(f))
    index, layout = read_tensor_index([f])
    assert layout == "openpi" and sorted(index) == ["b.weight", "model.a.weight"]   # names left as they are


def test_older_transformers_spellings_load_as_the_current_ones(tmp_path: Path, tiny_model: Pi05Model):
    """openpi checkpoints converted with older transformers name the PaliGemma submodules
    ``paligemma.language_model.model.``, ``paligemma.language_model.lm_head.``,
    ``paligemma.vision_tower.`` and ``paligemma.multi_modal_projector.``."""
    path = save_checkpoint(tiny_model, tmp_path / "new", layout="openpi")
    tensors = load_file(str(path / WEIGHTS))
    current_to_old = {"paligemma_with_expert.paligemma.model.language_model.": "paligemma_with_expert.paligemma.language_model.model.",
                      "paligemma_with_expert.paligemma.lm_head.": "paligemma_with_expert.paligemma.language_model.lm_head.",
                      "paligemma_with_expert.paligemma.model.vision_tower.": "paligemma_with_expert.paligemma.vision_tower.",
                      "paligemma_with_expert.paligemma.model.multi_modal_projector.":
                          "paligemma_with_expert.paligemma.multi_modal_projector."}

    def old_name(k: str) -> str:
        for cur, old in current_to_old.items():
            if k.startswith(cur):
                return old + k[len(cur):]
        return k

    renamed = {old_name(k): t for k, t in tensors.items()}
    assert all(sum(k.startswith(old) for k in renamed) > 0 for old in current_to_old.values())
    old = tmp_path / "old"
    old.mkdir()
    save_file(renamed, str(old / WEIGHTS))
    (old / "config.json").write_text((path / "config.json").read_text())
    a, b = load_checkpoint(path).model.state_dict(), load_checkpoint(old).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_embedding_name_that_is_neither_is_refused():
    with pytest.raises(ValueError, match="embedding must be .*embed_tokens.* or .*lm_head.*, got 'bogus'"):
        layout_groups(preset("pi05-tiny"), "bogus")


# ---------------------------------------------------------------- what save_checkpoint writes, against the public layout


def _listed_config_fields() -> set[str]:
    """PI05Config field names as the committed listing of LeRobot's configuration prints them."""
    return {line.strip().partition(" = ")[0] for line in LISTING.read_text().splitlines() if " = " in line}


def test_a_saved_config_json_speaks_lerobot_s_pi05_config(tmp_path: Path, tiny_model: Pi05Model):
    cfg = tiny_model.cfg
    path = save_checkpoint(tiny_model, tmp_path / "a" / "b" / "ckpt")   # parent folders made as needed
    meta = json.loads((path / "config.json").read_text())
    values = {"chunk_size": cfg.chunk_size, "n_action_steps": cfg.chunk_size, "max_state_dim": cfg.max_state_dim,
              "max_action_dim": cfg.action_dim, "num_inference_steps": cfg.num_steps,
              "tokenizer_max_length": cfg.max_token_len, "min_period": cfg.min_period, "max_period": cfg.max_period,
              "image_resolution": [cfg.vision.image_size] * 2}
    assert set(values) <= _listed_config_fields()          # LeRobot's own names
    assert {k: meta[k] for k in values} == values and meta["type"] == "pi05"
    # features as LeRobot types them (FeatureType VISUAL / STATE / ACTION, in the listing)
    s = cfg.vision.image_size
    assert meta["input_features"] == {**{f"observation.images.cam{i}": {"type": "VISUAL", "shape": [3, s, s]}
                                         for i in range(cfg.num_cameras)},
                                      "observation.state": {"type": "STATE", "shape": [cfg.max_state_dim]}}
    assert meta["output_features"] == {"action": {"type": "ACTION", "shape": [cfg.action_dim]}}
    listing = LISTING.read_text()
    assert "<FeatureType.VISUAL: 'VISUAL'>" in listing and "<FeatureType.STATE: 'STATE'>" in listing \
        and "<FeatureType.ACTION: 'ACTION'>" in listing
    # PaliGemma's LM head is tied to the text embedding; the expert's (another width) is written as zeros
    stored = load_file(str(path / WEIGHTS))
    assert torch.equal(stored["model." + HEAD], stored["model." + EMB])
    expert_head = stored["model.paligemma_with_expert.gemma_expert.lm_head.weight"]
    assert expert_head.shape == (cfg.vocab_size, cfg.expert.width) and not expert_head.any()
    with pytest.raises(ValueError, match="layout must be 'lerobot' or 'openpi', got 'hf'"):
        save_checkpoint(tiny_model, tmp_path / "x", layout="hf")


def test_vocabulary_image_size_and_vision_mlp_are_read_off_the_tensors(tmp_path: Path):
    """What config.json does not say is measured on the tensors, not taken from pi0.5's defaults."""
    d2 = preset("pi05-d2")
    cfg = dataclasses.replace(d2, vocab_size=1000,
                              vision=dataclasses.replace(d2.vision, image_size=448, mlp_dim=2048)).validate()
    ckdir = header_only_checkpoint(tmp_path / "other", cfg, lerobot_features(["c0"], 0))
    got = infer_config(ckdir, read_tensor_index(checkpoint_files(ckdir))[0])
    assert (got.vocab_size, got.vision.image_size, got.vision.mlp_dim, got.vision.patch_size) == (1000, 448, 2048, 14)


def test_a_shared_load_describes_the_files_it_mapped(ckpt: Path, tmp_path: Path, tiny_model: Pi05Model):
    ck = load_checkpoint(ckpt, share_weights=True, cache_dir=tmp_path)
    assert ck.config == tiny_model.cfg and ck.path == ckpt and ck.layout == "lerobot"
    assert ck.files == [ckpt / WEIGHTS] and ck.content_hash == content_hash([ckpt / WEIGHTS])
    assert ck.shared is not None


def test_twenty_one_refused_tensors_show_twenty_and_count_one(ckpt: Path):
    names = sorted(k.removeprefix("model.") for k in load_file(str(ckpt / WEIGHTS)) if ".layers." in k)[:21]
    _rewrite(ckpt, lambda t: [t.pop("model." + k) for k in names])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    assert str(e.value).endswith("\n    ".join(names[:20]) + "\n    ... and 1 more")
