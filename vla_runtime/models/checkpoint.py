"""Loading and writing pi0.5 checkpoints in the public layouts (LeRobot ``pi05``, openpi PyTorch).

The loader is strict on purpose: the reference implementation warns about a mismatched
checkpoint and carries on with random weights, which on a robot means random motion. Here every
missing, unexpected or mis-shaped tensor, an unsupported dtype and a truncated file is refused
with a message that names the offending keys. Projections are fused while loading (Q/K/V,
gate/up), and the content hash of the files is recorded: the reference repository of the cache
is tied to it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint_meta import (
    GEMMA_VARIANTS,
    CheckpointError,
    CheckpointMetaError,
    camera_layout,
    check_variants,
    read_meta,
    variant,
    variant_names,
)
from .config import GemmaConfig, Pi05Config, SiglipConfig, config_from_dict, config_to_dict
from .gemma import mlp_block
from .parts import ModelPart, load_parts, part_of
from .pi05 import Pi05Model
from .shared_weights import SharedWeights, load_shared_model

LEROBOT_PREFIX = "model."
_PWE = "paligemma_with_expert."
_VIS = _PWE + "paligemma.model.vision_tower.vision_model."
_LM = _PWE + "paligemma.model.language_model."
_EXP = _PWE + "gemma_expert."
# Older transformers spelled the PaliGemma submodules differently; openpi checkpoints converted
# with them use these names. Mapped to the current spelling before validation.
_ALIASES = (
    (_PWE + "paligemma.language_model.model.", _LM),
    (_PWE + "paligemma.language_model.lm_head.", _PWE + "paligemma.lm_head."),
    (_PWE + "paligemma.vision_tower.", _PWE + "paligemma.model.vision_tower."),
    (_PWE + "paligemma.multi_modal_projector.", _PWE + "paligemma.model.multi_modal_projector."),
)
# The text embedding. PaliGemma ties it to the LM head, but the two tensors are stored separately
# and need not be equal (a fine-tune that trained the embedding). LeRobot's from_pretrained copies
# lm_head into embed_tokens and then loads the file's own embed_tokens over it, so the file's
# embed_tokens is what a loaded model embeds text with; lm_head only when the file has no
# embed_tokens (openpi files saved with tied-weight deduplication may keep either name).
EMBED_KEY = _LM + "embed_tokens.weight"
HEAD_KEY = _PWE + "paligemma.lm_head.weight"
_ACCEPTED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_SIGLIP_HEADS = {1152: 16}
ARCH_KEY = "vla_runtime_arch"


@dataclass(frozen=True)
class Group:
    """One internal tensor and the public tensors it is made of.

    By default the public tensors are concatenated along dim 0 (fused projections); ``fuse`` and
    ``split`` override that for layouts that also reorder (the blocked MLP).
    """

    internal: str
    public: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    fuse: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    split: Callable[[torch.Tensor], list[torch.Tensor]] | None = None

    def to_internal(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.fuse is not None:
            return self.fuse(parts)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def to_public(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.split is not None:
            return self.split(t)
        return list(torch.split(t, [s[0] for s in self.shapes], dim=0))


def _blocked_gate_up(block: int) -> tuple[Callable, Callable]:
    """(gate [H, W], up [H, W]) <-> [H/B, 2B, W] with each block's gate rows then up rows."""

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        gate, up = parts
        h, w = gate.shape
        return torch.cat([gate.view(h // block, block, w), up.view(h // block, block, w)], dim=1)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        nb, _, w = t.shape
        return [t[:, :block].reshape(nb * block, w), t[:, block:].reshape(nb * block, w)]

    return fuse, split


def _transpose(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].t().contiguous()


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: Path
    raw_key: str  # the name as stored in the file


@dataclass
class LoadedCheckpoint:
    model: Pi05Model
    config: Pi05Config
    content_hash: str
    path: Path
    layout: str
    files: list[Path] = field(default_factory=list)
    shared: SharedWeights | None = None  # the mapped file when loaded with share_weights


# --------------------------------------------------------------------------- layout spec
def layout_groups(cfg: Pi05Config, embedding: str = EMBED_KEY) -> list[Group]:
    """Every tensor the model needs, in the LeRobot layout without the ``model.`` prefix.

    ``embedding`` names the tensor the text embedding is read from (``embedding_key``).
    """
    if embedding not in (EMBED_KEY, HEAD_KEY):
        raise ValueError(f"embedding must be {EMBED_KEY} or {HEAD_KEY}, got {embedding!r}")
    g: list[Group] = []

    def add(internal: str, *public: tuple[str, tuple[int, ...]], fuse=None, split=None) -> None:
        g.append(Group(internal, tuple(p for p, _ in public), tuple(s for _, s in public), fuse, split))

    v = cfg.vision
    add("vision.patch_embedding.weight", (_VIS + "embeddings.patch_embedding.weight", (v.width, 3, v.patch_size, v.patch_size)))
    add("vision.patch_embedding.bias", (_VIS + "embeddings.patch_embedding.bias", (v.width,)))
    add("vision.position_embedding", (_VIS + "embeddings.position_embedding.weight", (v.num_patches, v.width)))
    for i in range(v.depth):
        src, dst = f"{_VIS}encoder.layers.{i}.", f"vision.layers.{i}."
        for ln, ours in (("layer_norm1", "ln1"), ("layer_norm2", "ln2")):
            for p in ("weight", "bias"):
                add(f"{dst}{ours}.{p}", (f"{src}{ln}.{p}", (v.width,)))
        add(dst + "qkv_weight", *((f"{src}self_attn.{x}_proj.weight", (v.width, v.width)) for x in "qkv"))
        add(dst + "qkv_bias", *((f"{src}self_attn.{x}_proj.bias", (v.width,)) for x in "qkv"))
        add(dst + "out_proj.weight", (src + "self_attn.out_proj.weight", (v.width, v.width)))
        add(dst + "out_proj.bias", (src + "self_attn.out_proj.bias", (v.width,)))
        add(dst + "fc1.weight", (src + "mlp.fc1.weight", (v.mlp_dim, v.width)))
        add(dst + "fc1.bias", (src + "mlp.fc1.bias", (v.mlp_dim,)))
        add(dst + "fc2.weight", (src + "mlp.fc2.weight", (v.width, v.mlp_dim)))
        add(dst + "fc2.bias", (src + "mlp.fc2.bias", (v.width,)))
    for p in ("weight", "bias"):
        add(f"vision.post_layernorm.{p}", (f"{_VIS}post_layernorm.{p}", (v.width,)))
    proj = _PWE + "paligemma.model.multi_modal_projector.linear."
    add("projector.weight", (proj + "weight", (cfg.vlm.width, v.width)))
    add("projector.bias", (proj + "bias", (cfg.vlm.width,)))
    add("embed_tokens.weight", (embedding, (cfg.vocab_size, cfg.vlm.width)))

    def gemma_layer(src: str, dst: str, c: GemmaConfig, adaptive: bool) -> None:
        add(dst + "attn.qkv_weight", (src + "self_attn.q_proj.weight", (c.q_dim, c.width)),
            (src + "self_attn.k_proj.weight", (c.kv_dim, c.width)), (src + "self_attn.v_proj.weight", (c.kv_dim, c.width)))
        add(dst + "attn.o_weight", (src + "self_attn.o_proj.weight", (c.width, c.q_dim)))
        fuse, split = _blocked_gate_up(mlp_block(c))
        add(dst + "mlp.gate_up", (src + "mlp.gate_proj.weight", (c.mlp_dim, c.width)),
            (src + "mlp.up_proj.weight", (c.mlp_dim, c.width)), fuse=fuse, split=split)
        add(dst + "mlp.down_t", (src + "mlp.down_proj.weight", (c.width, c.mlp_dim)),
            fuse=_transpose, split=lambda t: [t.t()])
        if adaptive:
            for ln, ours in (("input_layernorm", "input_mod"), ("post_attention_layernorm", "post_attn_mod")):
                add(f"{dst}{ours}.weight", (f"{src}{ln}.dense.weight", (3 * c.width, c.width)))
                add(f"{dst}{ours}.bias", (f"{src}{ln}.dense.bias", (3 * c.width,)))
        else:
            add(dst + "input_norm.weight", (src + "input_layernorm.weight", (c.width,)))
            add(dst + "post_attn_norm.weight", (src + "post_attention_layernorm.weight", (c.width,)))

    for i in range(cfg.vlm.depth):
        gemma_layer(f"{_LM}layers.{i}.", f"vlm_layers.{i}.", cfg.vlm, adaptive=False)
    for i in range(cfg.expert.depth):
        gemma_layer(f"{_EXP}model.layers.{i}.", f"expert_layers.{i}.", cfg.expert, adaptive=True)
    ew = cfg.expert.width
    add("expert_final_mod.weight", (_EXP + "model.norm.dense.weight", (3 * ew, ew)))
    add("expert_final_mod.bias", (_EXP + "model.norm.dense.bias", (3 * ew,)))
    for name, shape_w, shape_b in (("action_in_proj", (ew, cfg.action_dim), (ew,)),
                                   ("action_out_proj", (cfg.action_dim, ew), (cfg.action_dim,)),
                                   ("time_mlp_in", (ew, ew), (ew,)), ("time_mlp_out", (ew, ew), (ew,))):
        add(f"{name}.weight", (f"{name}.weight", shape_w))
        add(f"{name}.bias", (f"{name}.bias", shape_b))
    return g


def unused_keys(cfg: Pi05Config) -> dict[str, tuple[int, ...]]:
    """Tensors of the public layout that inference never reads (they are validated, not loaded).

    With ``layout_groups``' default embedding this completes LeRobot's layout; ``lm_head`` may be
    absent from a file that has ``embed_tokens`` (see ``optional_keys``).
    """
    return {
        _LM + "norm.weight": (cfg.vlm.width,),
        HEAD_KEY: (cfg.vocab_size, cfg.vlm.width),
        _EXP + "lm_head.weight": (cfg.vocab_size, cfg.expert.width),
    }


def embedding_key(index: dict[str, TensorInfo] | Iterable[str]) -> str:
    """The tensor the text embedding is read from: ``embed_tokens`` when present, else ``lm_head``."""
    if EMBED_KEY in index:
        return EMBED_KEY
    if HEAD_KEY in index:
        return HEAD_KEY
    raise CheckpointError(f"no text embedding: neither {EMBED_KEY} nor {HEAD_KEY} is in the checkpoint")


def optional_keys(cfg: Pi05Config, embedding: str) -> dict[str, tuple[int, ...]]:
    """Tensors that may be present (shape-checked) or absent: the embedding copy not read."""
    other = HEAD_KEY if embedding == EMBED_KEY else EMBED_KEY
    return {other: (cfg.vocab_size, cfg.vlm.width)}


# --------------------------------------------------------------------------- reading headers
def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check the file holds every byte it declares."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated file ({size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated file: header declares {n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((int(h["data_offsets"][1]) for h in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated file: tensors need {8 + n + end} bytes, file has {size}")
    return {k: TensorInfo(h["dtype"], tuple(h["shape"]), path, k) for k, h in header.items()}


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file or sharded with an index)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_tensor_index(files: Iterable[Path]) -> tuple[dict[str, TensorInfo], str]:
    """All tensors of a checkpoint under canonical names (no ``model.`` prefix), and the layout found."""
    raw: dict[str, TensorInfo] = {}
    for f in files:
        for k, info in _read_header(f).items():
            if k in raw:
                raise CheckpointError(f"tensor {k} appears in two files: {raw[k].file} and {f}")
            raw[k] = info
    prefixed = [k for k in raw if k.startswith(LEROBOT_PREFIX)]
    layout = "lerobot" if prefixed and len(prefixed) == len(raw) else "openpi"
    out: dict[str, TensorInfo] = {}
    for k, info in raw.items():
        name = k[len(LEROBOT_PREFIX):] if layout == "lerobot" else k
        for old, new in _ALIASES:
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = info
    return out, layout


# --------------------------------------------------------------------------- config inference
def infer_config(path: Path, index: dict[str, TensorInfo]) -> Pi05Config:
    """Architecture from ``config.json`` and the tensor shapes (LeRobot does not record depths).

    The variant names in ``config.json`` are checked against the widths the tensors show, and the
    cameras are counted by ``checkpoint_meta.camera_layout`` (an empty camera listed both as an
    input feature and in ``empty_cameras`` counts once).
    """
    try:
        return _infer_config(path, index)
    except CheckpointMetaError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _tensor_widths(index: dict[str, TensorInfo]) -> dict[str, tuple[int, int]]:
    """(width, MLP width) of the VLM and the expert as their first layer's MLP shows them.

    A tower whose tensor is missing is left out: the missing tensor is reported by ``validate``
    (or by the architecture inference) with the others.
    """
    out = {}
    for tower, prefix in (("vlm", _LM + "layers.0."), ("expert", _EXP + "model.layers.0.")):
        key = prefix + "mlp.gate_proj.weight"
        if key in index and len(index[key].shape) == 2:
            mlp_dim, width = index[key].shape
            out[tower] = (width, mlp_dim)
    return out


def _infer_config(path: Path, index: dict[str, TensorInfo]) -> Pi05Config:
    meta = read_meta(path)
    check_variants(meta, _tensor_widths(index))
    if ARCH_KEY in meta:
        return config_from_dict(meta[ARCH_KEY])

    def shape(key: str) -> tuple[int, ...]:
        if key not in index:
            raise CheckpointError(f"cannot infer the architecture: tensor {key} is missing")
        return index[key].shape

    def depth(prefix: str) -> int:
        ids = {int(k[len(prefix):].split(".")[0]) for k in index if k.startswith(prefix)}
        if not ids:
            raise CheckpointError(f"cannot infer the architecture: no tensors under {prefix}")
        return max(ids) + 1

    def gemma(tower: str, prefix: str) -> GemmaConfig:
        # Without a variant name pi0.5's geometry is assumed (both variants share it).
        v = GEMMA_VARIANTS[variant(meta, tower) or ("gemma_2b" if tower == "vlm" else "gemma_300m")]
        mlp, width = shape(prefix + "0.mlp.gate_proj.weight")
        return GemmaConfig(width=width, depth=depth(prefix), mlp_dim=mlp, num_heads=v.num_heads,
                           num_kv_heads=v.num_kv_heads, head_dim=v.head_dim)

    vocab = shape(embedding_key(index))[0]
    vw = shape(_VIS + "embeddings.patch_embedding.weight")
    if vw[0] not in _SIGLIP_HEADS:
        raise CheckpointError(f"unknown SigLIP width {vw[0]} (known: {sorted(_SIGLIP_HEADS)})")
    n_pos = shape(_VIS + "embeddings.position_embedding.weight")[0]
    image_size = int(round(n_pos ** 0.5)) * vw[2]
    vision = SiglipConfig(width=vw[0], depth=depth(_VIS + "encoder.layers."),
                          mlp_dim=shape(_VIS + "encoder.layers.0.mlp.fc1.weight")[0],
                          num_heads=_SIGLIP_HEADS[vw[0]], patch_size=vw[2], image_size=image_size)
    cfg = Pi05Config(
        vision=vision,
        vlm=gemma("vlm", _LM + "layers."),
        expert=gemma("expert", _EXP + "model.layers."),
        vocab_size=vocab,
        # LeRobot spells the chunk chunk_size, openpi action_horizon.
        chunk_size=int(meta.get("chunk_size", meta.get("action_horizon", 50))),
        action_dim=shape("action_in_proj.weight")[1],
        max_state_dim=int(meta.get("max_state_dim", 32)),
        num_steps=int(meta.get("num_inference_steps", 10)),
        max_token_len=int(meta.get("tokenizer_max_length", 200)),
        num_cameras=max(camera_layout(meta).total, 1),
        min_period=float(meta.get("min_period", 4e-3)),
        max_period=float(meta.get("max_period", 4.0)),
        retrieval_layer=min(15, depth(_VIS + "encoder.layers.")),
    )
    try:
        return cfg.validate()
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


# --------------------------------------------------------------------------- validation + load
def validate(cfg: Pi05Config, index: dict[str, TensorInfo], where: Path) -> None:
    """Refuse the checkpoint unless it holds exactly the expected tensors, shapes and dtypes."""
    embedding = embedding_key(index)
    expected: dict[str, tuple[int, ...]] = {}
    for grp in layout_groups(cfg, embedding):
        expected.update(zip(grp.public, grp.shapes))
    expected.update(unused_keys(cfg))
    optional = optional_keys(cfg, embedding)
    expected.update(optional)
    missing = sorted(k for k in expected if k not in index and k not in optional)
    unexpected = sorted(k for k in index if k not in expected)
    misshaped = sorted(f"{k}: expected {expected[k]}, found {index[k].shape}"
                       for k in expected if k in index and index[k].shape != expected[k])
    bad_dtype = sorted(f"{k}: {i.dtype}" for k, i in index.items() if k in expected and i.dtype not in _ACCEPTED_DTYPES)
    problems = []
    for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                         ("mis-shaped tensors", misshaped),
                         (f"unsupported dtypes (accepted: {sorted(_ACCEPTED_DTYPES)})", bad_dtype)):
        if items:
            shown = "\n    ".join(items[:20]) + (f"\n    ... and {len(items) - 20} more" if len(items) > 20 else "")
            problems.append(f"  {title} ({len(items)}):\n    {shown}")
    if problems:
        raise CheckpointError(f"refusing checkpoint {where}:\n" + "\n".join(problems))


def content_hash(files: Iterable[Path], chunk: int = 1 << 24) -> str:
    """sha256 over the checkpoint files' bytes, in name order (ties cache repositories to weights)."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return "sha256:" + h.hexdigest()


def read_checkpoint_layout(path: Path) -> tuple[list[Path], dict[str, TensorInfo], str, Pi05Config]:
    """Files, tensor index, layout and validated architecture of a checkpoint (headers only)."""
    files = checkpoint_files(path)
    index, layout = read_tensor_index(files)
    cfg = infer_config(path, index)
    validate(cfg, index, path)
    return files, index, layout, cfg


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    compute_hash: bool = True, *, share_weights: bool = False,
                    cache_dir: str | Path | None = None,
                    parts: "frozenset[ModelPart] | None" = None) -> LoadedCheckpoint:
    """Load a pi0.5 checkpoint (file or directory) into a ready-to-run ``Pi05Model``.

    With ``share_weights`` (CPU only) the fused weights are not kept in private memory: they are
    mapped from a runtime-layout file in ``cache_dir`` that every process loading the same
    checkpoint maps too (see ``load_shared_checkpoint``; the hash is then always
    computed, it names the file).

    ``parts`` (a pipeline process's role, ``models.parts``): the model holds only those parts,
    the others are released (``Pi05Model.keep_only``). Without sharing, the released parts'
    tensors are never even read, so neither host nor device memory ever holds them; shared, the
    whole file is mapped and the released views dropped (pages of the file this process never
    touches are not resident in it either way).
    """
    path = Path(path)
    if share_weights:
        ck = load_shared_checkpoint(path, dtype=dtype, device=device, cache_dir=cache_dir)
        if parts is not None:
            ck.model.keep_only(parts)
        return ck
    files, index, layout, cfg = read_checkpoint_layout(path)
    keep, read = parts, None if parts is None else load_parts(parts)   # ``parts`` is reused below
    handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
    state: dict[str, torch.Tensor] = {}
    try:
        for grp in layout_groups(cfg, embedding_key(index)):
            if read is not None and part_of(cfg, grp.internal) not in read:
                continue
            parts = [handles[index[k].file].get_tensor(index[k].raw_key) for k in grp.public]
            state[grp.internal] = grp.to_internal(parts).to(device=device, dtype=dtype)
    except Exception as e:  # a damaged payload surfaces here, with the file in the message
        raise CheckpointError(f"{path}: cannot read tensor data ({type(e).__name__}: {e})") from e
    finally:
        handles.clear()
    with torch.device("meta"):
        model = Pi05Model(cfg)
    if read is not None:
        model.keep_only(read)
    model.load_state_dict(state, strict=True, assign=True)
    model.refresh_derived()
    if keep is not None:
        model.keep_only(keep)   # the time conditioning, once the modulation tables are derived
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()   # hand its blocks back to the card (other processes share it)
    model.eval().requires_grad_(False)
    digest = content_hash(files) if compute_hash else "unhashed"
    return LoadedCheckpoint(model, cfg, digest, path, layout, files)


def load_shared_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                           cache_dir: str | Path | None = None) -> LoadedCheckpoint:
    """Load a checkpoint with its weights mapped from the shared runtime-layout file.

    Only the headers are read here (layout, architecture, content hash: it names the file);
    ``shared_weights.load_shared_model`` maps the file, building it with a normal load on first
    use. Returns the same ``LoadedCheckpoint`` as ``load_checkpoint``, with ``shared``
    describing the mapping.
    """
    if torch.device(device).type != "cpu":
        raise ValueError(f"share_weights maps weights into CPU memory; device {device!r} is not supported "
                         "(on GPU one process owns the weights and exports them through CUDA IPC)")
    path = Path(path)
    files, _, layout, cfg = read_checkpoint_layout(path)
    digest = content_hash(files)
    model, info = load_shared_model(
        cfg, digest, dtype, lambda: load_checkpoint(path, dtype=dtype, device="cpu", compute_hash=False).model,
        cache_dir)
    return LoadedCheckpoint(model, cfg, digest, path, layout, files, shared=info)


# --------------------------------------------------------------------------- writing
def save_checkpoint(model: Pi05Model, directory: str | Path, layout: str = "lerobot",
                    extra_config: dict | None = None) -> Path:
    """Write ``model`` in a public layout (unfused tensors, unused heads included) + ``config.json``.

    Used by the tests and the benchmarks to make checkpoints of any preset; the result loads in
    the reference implementation's layout as well as ours.
    """
    if layout not in ("lerobot", "openpi"):
        raise ValueError(f"layout must be 'lerobot' or 'openpi', got {layout!r}")
    cfg = model.cfg
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    prefix = LEROBOT_PREFIX if layout == "lerobot" else ""
    tensors: dict[str, torch.Tensor] = {}
    for grp in layout_groups(cfg):
        for key, part in zip(grp.public, grp.to_public(sd[grp.internal])):
            tensors[prefix + key] = part.detach().to("cpu").contiguous().clone()
    embed = sd["embed_tokens.weight"].detach().cpu()
    for key, shape in unused_keys(cfg).items():
        tensors[prefix + key] = embed.clone() if shape == tuple(embed.shape) else torch.zeros(shape, dtype=embed.dtype)
    save_file(tensors, str(directory / "model.safetensors"))
    meta = {
        "type": "pi05",
        **variant_names(cfg.vlm, cfg.expert),
        "chunk_size": cfg.chunk_size,
        "n_action_steps": cfg.chunk_size,
        "max_state_dim": cfg.max_state_dim,
        "max_action_dim": cfg.action_dim,
        "num_inference_steps": cfg.num_steps,
        "tokenizer_max_length": cfg.max_token_len,
        "image_resolution": [cfg.vision.image_size, cfg.vision.image_size],
        "min_period": cfg.min_period,
        "max_period": cfg.max_period,
        "input_features": {f"observation.images.cam{i}": {"type": "VISUAL", "shape": [3, cfg.vision.image_size, cfg.vision.image_size]}
                           for i in range(cfg.num_cameras)}
        | {"observation.state": {"type": "STATE", "shape": [cfg.max_state_dim]}},
        "output_features": {"action": {"type": "ACTION", "shape": [cfg.action_dim]}},
        ARCH_KEY: config_to_dict(cfg),
    }
    meta.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(meta, indent=2))
    return directory
