"""Which weights of pi0.5 each pipeline process runs, and releasing the rest.

The three processes of the pipeline each run one part of the model: the vision process the
vision tower, the projector, the text embedding and the VLM (its prefix K/V go to the policy
through the prefix ring); the policy process only the action expert's denoising loop, over those
K/V; the cache manager rebuilds reference entries by the same vision + prefill. Holding the whole
model in each is three copies of weights nobody runs; on a GPU (where nothing is shared between
processes) that decides whether full pi0.5 fits a 24 GB card at all.

``ModelPart`` names the groups; ``part_paths`` says which module or buffer belongs to which (every
tensor of the model to exactly one part: the tests check it). ``release`` replaces a released
module by a ``ReleasedModule`` that holds nothing and raises ``ReleasedPartError`` naming the part
and what the process holds when anything touches it, so a role that needs a part it dropped fails
loudly at the first use instead of computing on stale or missing weights.

The time conditioning (time MLP, the adaRMS ``dense`` weights) is a part of its own: denoising
reads only the modulation tables derived from it after loading (``Pi05Model.refresh_derived``),
so the policy process keeps the tables and releases the weights they came from.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Iterator

from torch import Tensor, nn

from .config import Pi05Config
from .layers import KVCache


class ModelPart(str, Enum):
    VISION = "vision"                    # SigLIP tower + projector (embed_images; the retrieval tap)
    TEXT = "text_embedding"              # prompt token embedding (build_prefix)
    VLM = "vlm"                          # PaliGemma decoder layers (prefill)
    EXPERT = "expert"                    # expert attention/MLP, action in/out projections, modulation tables (denoise)
    TIME = "time_conditioning"           # time MLP + adaRMS dense weights: only derive the modulation tables


ALL_PARTS: frozenset[ModelPart] = frozenset(ModelPart)
PREFIX_PARTS: frozenset[ModelPart] = frozenset({ModelPart.VISION, ModelPart.TEXT, ModelPart.VLM})

# What each process of the pipeline runs (``Pi05Model.keep_only(ROLE_PARTS[role])``).
ROLE_PARTS: dict[str, frozenset[ModelPart]] = {
    "vision": PREFIX_PARTS,                   # embed_images + build_prefix + prefill
    "cache": PREFIX_PARTS,                    # reconstruct_entry: the same vision + prefill
    "policy": frozenset({ModelPart.EXPERT}),  # denoise over the prefix K/V read from the slot
}


def role_parts(role: str) -> frozenset[ModelPart]:
    try:
        return ROLE_PARTS[role]
    except KeyError:
        raise ValueError(f"unknown pipeline role {role!r}; known: {sorted(ROLE_PARTS)}") from None


def load_parts(parts: Iterable[ModelPart]) -> frozenset[ModelPart]:
    """Parts to read from a checkpoint to end up holding ``parts``: the expert's modulation tables
    are derived from the time conditioning at load, which is released afterwards."""
    parts = frozenset(parts)
    return parts | {ModelPart.TIME} if ModelPart.EXPERT in parts else parts


class ReleasedPartError(RuntimeError):
    """A process touched a part of the model it released (a role running what it should not)."""


def part_paths(cfg: Pi05Config) -> Iterator[tuple[str, ModelPart, bool]]:
    """(path in ``Pi05Model``, part, is a module) for every module/buffer that belongs to a part.

    Modules are listed at the finest level a role splits them (an expert layer keeps its attention
    and MLP for the policy but its adaRMS ``dense`` weights go with the time conditioning);
    ``is a module`` False marks a buffer owned by a module that stays (derived tables).
    """
    yield "vision", ModelPart.VISION, True
    yield "projector", ModelPart.VISION, True
    yield "embed_tokens", ModelPart.TEXT, True
    for i in range(cfg.vlm.depth):
        yield f"vlm_layers.{i}", ModelPart.VLM, True
    for i in range(cfg.expert.depth):
        yield f"expert_layers.{i}.attn", ModelPart.EXPERT, True
        yield f"expert_layers.{i}.mlp", ModelPart.EXPERT, True
        yield f"expert_layers.{i}.modulation", ModelPart.EXPERT, False
        yield f"expert_layers.{i}.input_mod", ModelPart.TIME, True
        yield f"expert_layers.{i}.post_attn_mod", ModelPart.TIME, True
    yield "action_in_proj", ModelPart.EXPERT, True
    yield "action_out_proj", ModelPart.EXPERT, True
    yield "final_modulation", ModelPart.EXPERT, False
    yield "expert_final_mod", ModelPart.TIME, True
    yield "time_mlp_in", ModelPart.TIME, True
    yield "time_mlp_out", ModelPart.TIME, True


def part_of(cfg: Pi05Config, tensor_name: str) -> ModelPart:
    """The part a tensor (``named_parameters``/``named_buffers`` name, or a checkpoint's internal
    name) belongs to; ValueError for a name no part claims."""
    for path, part, _ in part_paths(cfg):
        if tensor_name == path or tensor_name.startswith(path + "."):
            return part
    raise ValueError(f"tensor {tensor_name!r} belongs to no ModelPart (update models.parts.part_paths)")


class ReleasedModule(nn.Module):
    """Stands where a released module was: holds no tensor, and any use raises ReleasedPartError."""

    def __init__(self, path: str, part: ModelPart, held: frozenset[ModelPart]):
        super().__init__()
        self.released_path = path
        self.released_part = part
        self.held_parts = held

    def _error(self, what: str) -> ReleasedPartError:
        held = ", ".join(sorted(p.value for p in self.held_parts)) or "nothing"
        return ReleasedPartError(
            f"{what} of {self.released_path!r}: the {self.released_part.value!r} part of the model was released "
            f"in this process (it holds: {held}); load it with that part, or in one process, to run this")

    def forward(self, *args, **kwargs):
        raise self._error("call")

    def __getattr__(self, name: str):
        if name.startswith("_"):   # Python/torch internals probing optional attributes
            return super().__getattr__(name)
        raise self._error(f"attribute {name!r}")

    def __iter__(self):
        raise self._error("iteration")

    def extra_repr(self) -> str:
        return f"released {self.released_part.value}: {self.released_path}"


def release(model: nn.Module, cfg: Pi05Config, drop: frozenset[ModelPart], held: frozenset[ModelPart]) -> None:
    """Replace every module of the parts in ``drop`` by a ``ReleasedModule`` and drop their
    buffers; the tensors are freed once nothing else refers to them."""
    for path, part, is_module in part_paths(cfg):
        if part not in drop:
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if isinstance(parent, ReleasedModule):
            continue   # released with its parent
        if is_module:
            setattr(parent, attr, ReleasedModule(path, part, held))
        else:
            parent._buffers[attr] = None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a model holds: parameters and weight-derived buffers, each tensor once
    (the KV caches and the denoising workspace are runtime state, not counted)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, KVCache):
            continue
        for t in (*module._parameters.values(), *module._buffers.values()):
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
