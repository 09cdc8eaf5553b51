"""From a robot observation (camera images, joint state, instruction) to an action chunk.

Input-side work of pi0.5 around the engine: images resized with padding and scaled to
[-1, 1], the state normalised with the checkpoint's quantiles, discretised into the prompt
``Task: ..., State: ...;\\nAction: `` and tokenized; on the way out the actions are cut to the
robot's dimension and unnormalised. Every input is validated first, so a bad message gives a
clear error and never reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from ..models.checkpoint import load_checkpoint
from ..models.norm_source import NormSource, checkpoint_normalizers
from ..models.normalize import Normalizer
from ..models.parts import ModelPart
from ..models.preprocess import ImagePreprocessor
from ..models.shared_weights import SharedWeights
from ..models.tokenizer import PromptTokenizer, build_prompt, discretize_state
from .dense import DenseEngine, EngineOutput, ModelInputs
from .timing import PhaseTimes


@dataclass
class Observation:
    images: Mapping[str, np.ndarray | Tensor]   # camera name -> HxWx3 uint8 RGB (or float [0, 1])
    state: np.ndarray | Tensor                  # [state_dim] raw joint state
    task: str                                   # instruction


@dataclass
class PolicyOutput:
    actions: np.ndarray          # [chunk, action_dim] in robot units
    times: PhaseTimes
    engine: EngineOutput


class Pi05Policy:
    def __init__(self, engine: DenseEngine, tokenizer: PromptTokenizer, state_norm: Normalizer,
                 action_norm: Normalizer, camera_names: list[str],
                 images: ImagePreprocessor | None = None):
        cfg = engine.cfg
        if len(camera_names) > cfg.num_cameras:
            raise ValueError(f"{len(camera_names)} cameras named, the model takes {cfg.num_cameras}")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces, the model embeds {cfg.vocab_size}")
        if state_norm.dim > cfg.max_state_dim or action_norm.dim > cfg.action_dim:
            raise ValueError("state/action statistics are wider than the model's padded dimensions")
        if tokenizer.max_length != cfg.max_token_len:
            raise ValueError(f"tokenizer max_length {tokenizer.max_length} != model's {cfg.max_token_len}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.state_norm = state_norm
        self.action_norm = action_norm
        self.camera_names = list(camera_names)
        self.checkpoint_hash: str | None = None  # set when built from a checkpoint directory
        self.shared_weights: SharedWeights | None = None  # set when built with share_weights
        self.norm_source: NormSource | None = None  # set when built from a checkpoint directory
        size = cfg.vision.image_size
        self.images = images or ImagePreprocessor(size=(size, size))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, camera_names: list[str], max_batch: int = 1,
                        dtype: torch.dtype = torch.float32, device: str = "cpu", share_weights: bool = False,
                        weights_cache_dir: str | Path | None = None, norm_asset: str | None = None,
                        parts: "frozenset[ModelPart] | None" = None) -> "Pi05Policy":
        """Build a policy from a checkpoint directory.

        ``norm_asset`` chooses the statistics of an openpi checkpoint (``assets/<norm_asset>``);
        it may be left out when there is only one (``models.norm_source``).

        ``share_weights`` (CPU): map the fused weights from a file shared by every process that
        loads this checkpoint instead of holding a private copy (``models.shared_weights``);
        the file lives in ``weights_cache_dir`` (default ``$VLA_RUNTIME_CACHE`` or
        ``~/.cache/vla_runtime/weights``). Actions are bit-identical either way.

        ``parts``: hold only these parts of the model (a pipeline process's role, ``models.parts``);
        None holds everything.
        """
        ck = load_checkpoint(ckpt_dir, dtype=dtype, device=device, share_weights=share_weights,
                             cache_dir=weights_cache_dir, parts=parts)
        state_norm, action_norm, norm_source = checkpoint_normalizers(ckpt_dir, norm_asset)
        tok = PromptTokenizer.from_checkpoint_dir(ckpt_dir, max_length=ck.config.max_token_len)
        policy = cls(DenseEngine(ck.model, max_batch=max_batch), tok, state_norm, action_norm, camera_names)
        policy.checkpoint_hash = ck.content_hash
        policy.shared_weights = ck.shared
        policy.norm_source = norm_source
        return policy

    @property
    def state_dim(self) -> int:
        return self.state_norm.dim

    def prepare(self, obs: Observation) -> ModelInputs:
        """Validate and convert one observation into model inputs (batch of one)."""
        unknown = sorted(set(obs.images) - set(self.camera_names))
        if unknown:
            raise ValueError(f"unknown camera(s) {unknown}; configured: {self.camera_names}")
        state = self._check_state(obs.state)
        if not isinstance(obs.task, str) or not obs.task.strip():
            raise ValueError("the instruction (task) must be a non-empty string")
        cams, mask = [], []
        for name in self.camera_names:
            img = obs.images.get(name)
            if img is None:  # absent camera: masked out (and skipped entirely by the engine)
                cams.append(self.images.blank())
                mask.append(False)
            else:
                try:
                    cams.append(self.images(img))
                except ValueError as e:
                    raise ValueError(f"camera {name!r}: {e}") from None
                mask.append(True)
        if not any(mask):
            raise ValueError(f"no camera image in the observation (expected some of {self.camera_names})")
        state_n = self.state_norm.normalize(state)
        ids, tmask = self.tokenizer.encode(build_prompt(obs.task, discretize_state(state_n)))
        return ModelInputs(images=torch.stack(cams)[None], image_mask=torch.tensor([mask]),
                           tokens=ids[None], token_mask=tmask[None])

    def _check_state(self, state: np.ndarray | Tensor) -> Tensor:
        try:
            t = torch.as_tensor(np.asarray(state) if not isinstance(state, Tensor) else state)
        except (TypeError, ValueError):
            raise ValueError(f"state must be a numeric vector, got {np.asarray(state).dtype}") from None
        if t.ndim != 1 or t.shape[0] != self.state_dim:
            raise ValueError(f"state must be a vector of {self.state_dim} values, got shape {tuple(t.shape)}")
        if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"state must be a numeric vector, got {t.dtype}")
        t = t.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise ValueError("state contains NaN or Inf")
        return t

    def predict(self, obs: Observation, noise: Tensor | None = None,
                generator: torch.Generator | None = None) -> PolicyOutput:
        out = self.engine.infer(self.prepare(obs), noise=noise, generator=generator)
        actions = self.action_norm.unnormalize(out.actions[0].float().cpu())
        return PolicyOutput(actions.numpy(), out.times, out)

