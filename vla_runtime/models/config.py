"""Model configuration for pi0.5 and its size presets.

One frozen dataclass tree describes the whole architecture. The full-size preset matches the
public pi0.5 checkpoints (LeRobot ``pi05`` / openpi PyTorch); the small presets keep every
structural property (one KV head shared by VLM and expert, joint attention, adaptive norms) so
that what passes on them exercises the same code paths as the real model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class SiglipConfig:
    """SigLIP vision tower (so400m/14 at full size)."""

    width: int = 1152
    depth: int = 27
    mlp_dim: int = 4304
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 224
    norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def validate(self) -> None:
        _require(self.width % self.num_heads == 0, f"vision width {self.width} not divisible by {self.num_heads} heads")
        _require(self.image_size % self.patch_size == 0, f"image size {self.image_size} not a multiple of patch {self.patch_size}")
        _require(self.depth >= 1, "vision depth must be >= 1")


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma stack: the PaliGemma language model or the action expert."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    # Neurons per MLP block (see GemmaMLP): a layout choice, not part of the checkpoint.
    mlp_block: int = 2048

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def validate(self) -> None:
        _require(self.depth >= 1, "Gemma depth must be >= 1")
        _require(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        _require(self.head_dim % 2 == 0, "head_dim must be even for RoPE")
        _require(self.mlp_block >= 1, "mlp_block must be >= 1")


@dataclass(frozen=True)
class Pi05Config:
    """The whole policy: vision tower, VLM prefix model, action expert and flow-matching head."""

    vision: SiglipConfig = field(default_factory=SiglipConfig)
    vlm: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=2048, depth=18, mlp_dim=16384))
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=1024, depth=18, mlp_dim=4096))
    vocab_size: int = 257152
    chunk_size: int = 50
    action_dim: int = 32
    max_state_dim: int = 32
    num_steps: int = 10
    max_token_len: int = 200
    num_cameras: int = 3
    min_period: float = 4e-3
    max_period: float = 4.0
    # Which SigLIP layer's output (1-based) serves as the retrieval query (rMuscle uses the 15th of 27).
    retrieval_layer: int = 15

    def validate(self) -> "Pi05Config":
        self.vision.validate()
        self.vlm.validate()
        self.expert.validate()
        _require(self.vlm.depth == self.expert.depth,
                 f"VLM depth {self.vlm.depth} != expert depth {self.expert.depth}: the expert attends layer by layer")
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _require(getattr(self.vlm, name) == getattr(self.expert, name),
                     f"VLM and expert must share attention geometry ({name})")
        _require(self.chunk_size >= 1 and self.action_dim >= 1 and self.num_steps >= 1, "chunk, action dim, steps >= 1")
        _require(self.num_cameras >= 1, "at least one camera")
        _require(self.expert.width % 2 == 0, "expert width must be even for the sin/cos time embedding")
        _require(1 <= self.retrieval_layer <= self.vision.depth, "retrieval_layer must name a vision layer")
        return self

    @property
    def num_image_tokens(self) -> int:
        return self.vision.num_patches

    @property
    def max_prefix_len(self) -> int:
        return self.num_cameras * self.num_image_tokens + self.max_token_len

    def with_depths(self, vision: int, vlm: int, expert: int | None = None) -> "Pi05Config":
        expert = vlm if expert is None else expert
        return replace(self, vision=replace(self.vision, depth=vision), vlm=replace(self.vlm, depth=vlm),
                       expert=replace(self.expert, depth=expert),
                       retrieval_layer=min(self.retrieval_layer, vision)).validate()


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"invalid pi0.5 config: {msg}")


def _tiny() -> Pi05Config:
    return Pi05Config(
        vision=SiglipConfig(width=64, depth=4, mlp_dim=128, num_heads=4, patch_size=14, image_size=56),
        vlm=GemmaConfig(width=96, depth=3, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=24, mlp_block=64),
        expert=GemmaConfig(width=64, depth=3, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=24, mlp_block=64),
        vocab_size=512, chunk_size=10, action_dim=8, max_state_dim=8, num_steps=10,
        max_token_len=64, num_cameras=2, retrieval_layer=2,
    )


def _small() -> Pi05Config:
    return Pi05Config(
        vision=SiglipConfig(width=384, depth=6, mlp_dim=1536, num_heads=6, patch_size=14, image_size=224),
        vlm=GemmaConfig(width=512, depth=6, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=64),
        expert=GemmaConfig(width=256, depth=6, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=64),
        vocab_size=1024, chunk_size=50, action_dim=32, max_state_dim=32, num_steps=10,
        max_token_len=200, num_cameras=3, retrieval_layer=4,
    )


def _metaworld() -> Pi05Config:
    """Trainable from scratch on 2 CPU cores in under an hour (Meta-World, issue 6).

    64x64 images with 8x8 patches (64 tokens per camera: large objects stay several patches
    wide), two cameras, prompts of up to 48 tokens (instruction + 4-dim discretised state with
    split digits: about 33 used), Meta-World's 4-dim action without padding (the config needs none) and 8-action
    chunks (the policy is re-queried every 4 env steps). Widths and depths are what the time
    budget allows; the structure is pi0.5's.
    """
    return Pi05Config(
        vision=SiglipConfig(width=128, depth=3, mlp_dim=512, num_heads=4, patch_size=8, image_size=64),
        vlm=GemmaConfig(width=160, depth=3, mlp_dim=640, num_heads=4, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=128, depth=3, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=32),
        vocab_size=384, chunk_size=8, action_dim=4, max_state_dim=4, num_steps=10,
        max_token_len=48, num_cameras=2, retrieval_layer=2,
    )


def _aloha() -> Pi05Config:
    """The Meta-World preset's widths for ALOHA (training/aloha_demos, trained on CPU): the profile's
    three cameras at 64x64, 14 joints (discretised into a longer prompt), and 20-target chunks
    (0.4 s at 50 Hz; the policy is re-queried every 10 steps)."""
    mw = _metaworld()
    return replace(mw, chunk_size=20, action_dim=14, max_state_dim=14, max_token_len=112, num_cameras=3)


PRESETS: dict[str, Any] = {
    # Full size, as the public checkpoints.
    "pi05": lambda: Pi05Config().validate(),
    # Full width, 2+2+2 layers: the configuration LeRobot parity and speed are measured on.
    "pi05-d2": lambda: Pi05Config().with_depths(vision=2, vlm=2),
    # Same architecture, small: a call well under a second on 2 CPU cores (CPU benchmarks).
    "pi05-small": lambda: _small().validate(),
    # Meta-World policy trained here on CPU (training/train.py).
    "pi05-mw": lambda: _metaworld().validate(),
    # ALOHA transfer-cube policy trained here on CPU (training/aloha_demos + training/train.py).
    "pi05-aloha": lambda: _aloha().validate(),
    # Smallest: unit tests.
    "pi05-tiny": lambda: _tiny().validate(),
}


def preset(name: str) -> Pi05Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def config_to_dict(cfg: Pi05Config) -> dict:
    """The architecture as plain JSON-able data (stored in ``config.json``, keys shared weight files)."""
    return asdict(cfg)


def config_from_dict(d: dict) -> Pi05Config:
    d = dict(d)
    return Pi05Config(vision=SiglipConfig(**d.pop("vision")), vlm=GemmaConfig(**d.pop("vlm")),
                      expert=GemmaConfig(**d.pop("expert")), **d).validate()
