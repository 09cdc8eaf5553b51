"""Prompt construction and tokenization for pi0.5.

pi0.5 does not feed the robot state to the network as a vector. Instead the state,
already normalised to [-1, 1], is quantised into 256 bins and written into the text
prompt, which is then tokenized with the PaliGemma SentencePiece model. This module
reproduces that path exactly as LeRobot 0.6.1 (and openpi before it) does it, so that a
checkpoint trained there sees byte-identical token ids here:

* cleaning:  ``task.strip().replace("_", " ").replace("\\n", " ")`` (case is kept),
* template:  ``"Task: {task}, State: {b0 b1 ...};\\nAction: "``,
* ids:       ``[<bos>] + sentencepiece(prompt)``, no ``<eos>``, right-padded with id 0
  to ``max_length`` (200); the mask is True on real tokens.

The state is discretised at its own dimension, before any padding to 32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import sentencepiece
import torch

DEFAULT_MAX_LENGTH = 200
"""Token budget of the pi0.5 prompt (LeRobot ``PI05Config.tokenizer_max_length``)."""

DEFAULT_STATE_BINS = 256

PALIGEMMA_PAD_ID = 0
"""PaliGemma's ``<pad>`` id; LeRobot pads the prompt with it (openpi pads with 0 too)."""

TOKENIZER_FILENAMES: tuple[str, ...] = (
    "tokenizer.model",
    "paligemma_tokenizer.model",
    "spiece.model",
    "sentencepiece.model",
    "tokenizer/tokenizer.model",
    "assets/paligemma_tokenizer.model",
)
"""Names, relative to a checkpoint directory, tried in order by ``from_checkpoint_dir``."""


def discretize_state(
    state_norm: np.ndarray | torch.Tensor,
    bins: int = DEFAULT_STATE_BINS,
    *,
    clip: bool = False,
) -> list[int]:
    """Quantise a normalised state vector into integer bins for the prompt.

    Bin ``i`` covers ``[-1 + i*w, -1 + (i+1)*w)`` with ``w = 2/bins``; the last bin is
    open above, so anything >= 1 lands in ``bins - 1``.

    LeRobot and openpi do *not* clip the low side: a value below -1 (a state under the
    dataset's 1st percentile, which happens about 1% of the time with quantile stats)
    becomes ``-1`` and is written into the prompt as ``"-1"``. The default reproduces that
    for exact parity with trained checkpoints; ``clip=True`` clamps to ``[0, bins - 1]``.

    Args:
        state_norm: 1-D state already normalised to roughly [-1, 1], unpadded.
        bins: number of bins (256 for pi0.5).
        clip: clamp the result to ``[0, bins - 1]`` instead of matching LeRobot.

    Returns:
        One Python int per state dimension.

    Raises:
        ValueError: if the state is not 1-D, is empty, or has non-finite values.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if isinstance(state_norm, torch.Tensor):
        arr = state_norm.detach().to("cpu", torch.float64).numpy()
    else:
        arr = np.asarray(state_norm, dtype=np.float64)
    # float32 -> float64 is exact, so comparing against float64 edges gives the same
    # bins as LeRobot's digitize on the float32 array.
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D state vector, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError("expected a non-empty state vector, got shape (0,)")
    if not np.all(np.isfinite(arr)):
        bad = np.flatnonzero(~np.isfinite(arr)).tolist()
        raise ValueError(f"state has non-finite values at indices {bad}: {arr[bad].tolist()}")
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    out = np.digitize(arr, bins=edges) - 1
    if clip:
        out = np.clip(out, 0, bins - 1)
    return [int(v) for v in out]


def clean_task(task: str) -> str:
    """Normalise task text the way LeRobot's pi0.5 processor does (case is preserved)."""
    if not isinstance(task, str):
        raise ValueError(f"task must be a str, got {type(task).__name__}")
    return task.strip().replace("_", " ").replace("\n", " ")


def build_prompt(task: str, state_bins: Sequence[int]) -> str:
    """Format the pi0.5 text prompt from a task and discretised state.

    The trailing ``"\\nAction: "`` is part of the training format: the model was taught
    to expect action tokens after it, so it must be reproduced byte for byte.
    """
    state_str = " ".join(str(int(b)) for b in state_bins)
    return f"Task: {clean_task(task)}, State: {state_str};\nAction: "


class PromptTokenizer:
    """SentencePiece tokenizer producing pi0.5's fixed-length prompt ids and mask.

    LeRobot calls the Hugging Face PaliGemma tokenizer with
    ``padding="max_length", padding_side="right", truncation=True``; that tokenizer adds
    ``<bos>`` (id 2) and no ``<eos>``, and pads with ``<pad>`` (id 0). openpi gets the same
    ids from the raw SentencePiece model with ``add_bos=True``, which is what this class
    does, so no ``transformers`` dependency is needed.

    Silent truncation would drop the end of the prompt, including ``"Action: "``, and
    quietly degrade the policy, so over-long prompts raise unless ``truncate=True``
    (which then keeps the first ``max_length`` ids, as LeRobot does).
    """

    def __init__(
        self,
        model_file: str | os.PathLike[str],
        *,
        max_length: int = DEFAULT_MAX_LENGTH,
        truncate: bool = False,
        pad_id: int = PALIGEMMA_PAD_ID,
    ) -> None:
        path = Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model file not found: {path}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"could not load SentencePiece model from {path}: {e}") from e
        if sp.bos_id() < 0:
            raise ValueError(
                f"SentencePiece model {path} defines no <bos> piece; pi0.5 prompts must start with <bos>"
            )
        if not 0 <= pad_id < sp.get_piece_size():
            raise ValueError(f"pad_id must be in [0, {sp.get_piece_size()}), got {pad_id}")
        self.model_file = path
        self.max_length = max_length
        self.truncate = truncate
        self.pad_id = pad_id
        self._sp = sp

    @classmethod
    def from_checkpoint_dir(cls, ckpt_dir: str | os.PathLike[str], **kwargs: object) -> PromptTokenizer:
        """Find the SentencePiece model beside a checkpoint (see ``TOKENIZER_FILENAMES``)."""
        root = Path(ckpt_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {root}")
        for name in TOKENIZER_FILENAMES:
            candidate = root / name
            if candidate.is_file():
                return cls(candidate, **kwargs)  # type: ignore[arg-type]
        raise FileNotFoundError(
            f"no SentencePiece tokenizer model in {root}; looked for: {', '.join(TOKENIZER_FILENAMES)}. "
            "Copy PaliGemma's tokenizer.model (google/paligemma-3b-pt-224) into the checkpoint directory."
        )

    @property
    def vocab_size(self) -> int:
        """Number of pieces; the model's embedding table must have at least this many rows."""
        return int(self._sp.get_piece_size())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    def token_ids(self, text: str) -> list[int]:
        """Unpadded ids: ``<bos>`` followed by the pieces of ``text`` (no ``<eos>``)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self._sp.encode(text, add_bos=True, add_eos=False))

    def encode(self, text: str, *, truncate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenize one prompt into fixed-length ids and mask.

        Returns:
            ``(ids, mask)``: int64 ``[max_length]`` right-padded with ``pad_id`` and bool
            ``[max_length]``, True on real tokens.

        Raises:
            ValueError: if the prompt needs more than ``max_length`` tokens and truncation
                is off.
        """
        truncate = self.truncate if truncate is None else truncate
        ids = self.token_ids(text)
        n = len(ids)
        if n > self.max_length:
            if not truncate:
                raise ValueError(
                    f"prompt needs {n} tokens but max_length is {self.max_length}; shorten the task "
                    f"text or pass truncate=True to keep the first {self.max_length} tokens. "
                    f"Prompt starts: {text[:80]!r}"
                )
            ids = ids[: self.max_length]
            n = self.max_length
        out = torch.full((self.max_length,), self.pad_id, dtype=torch.long)
        out[:n] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(self.max_length, dtype=torch.bool)
        mask[:n] = True
        return out, mask

    def encode_batch(
        self, texts: Sequence[str], *, truncate: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenize several prompts: int64 ``[B, max_length]`` ids and bool mask."""
        if isinstance(texts, str):
            raise ValueError("encode_batch expects a sequence of strings, got a single str; use encode()")
        if len(texts) == 0:
            raise ValueError("encode_batch needs at least one prompt, got 0")
        pairs = [self.encode(t, truncate=truncate) for t in texts]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def encode_task(
        self,
        task: str,
        state_norm: np.ndarray | torch.Tensor,
        *,
        truncate: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convenience: discretise the normalised state, build the prompt, and encode it."""
        return self.encode(build_prompt(task, discretize_state(state_norm)), truncate=truncate)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids`` with padding and special pieces removed (for debugging)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return str(self._sp.decode([int(i) for i in ids if int(i) != self.pad_id]))

    def __repr__(self) -> str:
        return (
            f"PromptTokenizer(model_file={str(self.model_file)!r}, vocab_size={self.vocab_size}, "
            f"max_length={self.max_length}, truncate={self.truncate})"
        )


def train_prompt_tokenizer(prompts: Sequence[str], path: str | os.PathLike[str], vocab_size: int = 300,
                           exact_vocab: bool = True) -> Path:
    """Train a small SentencePiece model laid out like PaliGemma's (tests, demos, synthetic robots).

    Same special ids as PaliGemma/Gemma (pad 0, eos 1, bos 2, unk 3), no dummy prefix, identity
    normalisation (whitespace and newlines kept), digits split, ``"\\n"`` as its own piece. The
    real checkpoints ship the 257152-piece PaliGemma model; nothing is downloaded. With
    ``exact_vocab=False`` the vocabulary may come out smaller when the prompts hold fewer pieces.
    """
    import io

    if not prompts:
        raise ValueError("need at least one prompt to train a tokenizer")
    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(list(prompts)), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, user_defined_symbols=["\n"], character_coverage=1.0,
        num_threads=1, minloglevel=2, hard_vocab_limit=exact_vocab)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buf.getvalue())
    return out
