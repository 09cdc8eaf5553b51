"""Tests for pi0.5 prompt building, state discretisation and tokenization."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.models.tokenizer import (
    PromptTokenizer,
    build_prompt,
    clean_task,
    discretize_state,
)


def _lerobot_bins(s: np.ndarray) -> list[int]:
    """The expression LeRobot's Pi05PrepareStateTokenizerProcessorStep evaluates."""
    return (np.digitize(s, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1).tolist()


# --- discretisation ----------------------------------------------------------------------


def test_discretize_edges():
    w = 2 / 256
    s = np.array([-1.0, -1.0 + w, -1.0 + w - 1e-9, 0.0, 1.0 - 1e-9, 1.0, 1.0 - w], dtype=np.float64)
    assert discretize_state(s) == [0, 1, 0, 128, 255, 255, 255]


def test_discretize_out_of_range_matches_lerobot_by_default():
    s = np.array([-1.5, -1.0000001, 1.5, 7.0])
    # LeRobot does not clip the low side: below -1 gives -1; above 1 saturates at 255.
    assert discretize_state(s) == [-1, -1, 255, 255]
    assert discretize_state(s, clip=True) == [0, 0, 255, 255]


def test_discretize_matches_lerobot_expression_float32():
    rng = np.random.default_rng(0)
    s = rng.uniform(-1.1, 1.1, size=200).astype(np.float32)
    assert discretize_state(s) == _lerobot_bins(s)
    assert discretize_state(torch.from_numpy(s)) == _lerobot_bins(s)


def test_discretize_other_bin_count():
    assert discretize_state(np.array([-1.0, 0.0, 0.99]), bins=4) == [0, 2, 3]


@pytest.mark.parametrize(
    "bad, msg",
    [
        (np.zeros((2, 3)), "1-D"),
        (np.zeros(0), "non-empty"),
        (np.array([0.0, np.nan]), "non-finite"),
        (np.array([np.inf]), "non-finite"),
    ],
)
def test_discretize_rejects(bad, msg):
    with pytest.raises(ValueError, match=msg):
        discretize_state(bad)


# --- prompt ------------------------------------------------------------------------------


def test_build_prompt_format():
    assert build_prompt("pick up the cube", [0, 128, 255]) == "Task: pick up the cube, State: 0 128 255;\nAction: "


def test_build_prompt_cleaning_matches_lerobot():
    # strip first, then '_' -> ' ' and '\n' -> ' '; case is preserved.
    assert clean_task("  Pick_up\nthe Cube \n") == "Pick up the Cube"
    assert clean_task("fold_") == "fold "
    assert build_prompt("  Open_Drawer\n", [-1, 3]) == "Task: Open Drawer, State: -1 3;\nAction: "


def test_build_prompt_empty_state():
    assert build_prompt("x", []) == "Task: x, State: ;\nAction: "


# --- tokenizer ---------------------------------------------------------------------------


@pytest.fixture()
def tok(tiny_tokenizer_path: Path) -> PromptTokenizer:
    return PromptTokenizer(tiny_tokenizer_path)


def test_encode_bos_padding_mask(tok: PromptTokenizer):
    prompt = build_prompt("pick up the red cube", [0, 17, 255])
    ids, mask = tok.encode(prompt)
    assert ids.shape == (200,) and ids.dtype == torch.long
    assert mask.shape == (200,) and mask.dtype == torch.bool
    n = int(mask.sum())
    raw = tok.token_ids(prompt)
    assert n == len(raw)
    assert ids[0].item() == 2 == tok.bos_id  # <bos> first, as PaliGemma's tokenizer adds it
    assert ids[:n].tolist() == raw
    assert 1 not in raw  # no <eos>
    assert mask[:n].all() and not mask[n:].any()  # right padding
    assert (ids[n:] == 0).all()
    assert tok.decode(ids) == prompt


def test_vocab_size(tok: PromptTokenizer):
    assert tok.vocab_size == 300
    ids, _ = tok.encode(build_prompt("stack the bowl", [1, 2]))
    assert int(ids.max()) < tok.vocab_size


def test_encode_batch(tok: PromptTokenizer):
    prompts = [build_prompt("open drawer", [1]), build_prompt("pour water into the cup", [4, 5, 6, 7])]
    ids, mask = tok.encode_batch(prompts)
    assert ids.shape == mask.shape == (2, 200)
    for i, p in enumerate(prompts):
        one_ids, one_mask = tok.encode(p)
        assert torch.equal(ids[i], one_ids) and torch.equal(mask[i], one_mask)
    with pytest.raises(ValueError, match="single str"):
        tok.encode_batch("open drawer")
    with pytest.raises(ValueError, match="at least one"):
        tok.encode_batch([])


def test_encode_task_convenience(tok: PromptTokenizer):
    state = np.array([-1.0, 0.0, 0.5], dtype=np.float32)
    ids, mask = tok.encode_task("wipe_table", state)
    exp_ids, exp_mask = tok.encode(build_prompt("wipe table", discretize_state(state)))
    assert torch.equal(ids, exp_ids) and torch.equal(mask, exp_mask)


def test_too_long_raises_unless_truncate(tiny_tokenizer_path: Path):
    tok = PromptTokenizer(tiny_tokenizer_path, max_length=16)
    prompt = build_prompt("pick up the red cube and place it on the plate", list(range(20)))
    n = len(tok.token_ids(prompt))
    assert n > 16
    with pytest.raises(ValueError, match=f"needs {n} tokens but max_length is 16"):
        tok.encode(prompt)
    ids, mask = tok.encode(prompt, truncate=True)
    assert ids.tolist() == tok.token_ids(prompt)[:16]  # right truncation keeps <bos>
    assert mask.all()
    ids2, _ = PromptTokenizer(tiny_tokenizer_path, max_length=16, truncate=True).encode(prompt)
    assert torch.equal(ids, ids2)


def test_exact_fit_is_not_truncated(tiny_tokenizer_path: Path):
    probe = PromptTokenizer(tiny_tokenizer_path)
    prompt = build_prompt("open the door", [1, 2, 3])
    n = len(probe.token_ids(prompt))
    ids, mask = PromptTokenizer(tiny_tokenizer_path, max_length=n).encode(prompt)
    assert mask.all() and ids.tolist() == probe.token_ids(prompt)


def test_from_checkpoint_dir(tiny_tokenizer_path: Path, tmp_path: Path):
    (tmp_path / "tokenizer").mkdir()
    shutil.copy(tiny_tokenizer_path, tmp_path / "tokenizer" / "tokenizer.model")
    tok = PromptTokenizer.from_checkpoint_dir(tmp_path, max_length=64)
    assert tok.max_length == 64 and tok.vocab_size == 300


def test_from_checkpoint_dir_missing(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"looked for: tokenizer\.model, paligemma_tokenizer\.model"):
        PromptTokenizer.from_checkpoint_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        PromptTokenizer.from_checkpoint_dir(tmp_path / "nope")


def test_bad_model_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not found"):
        PromptTokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="could not load SentencePiece model"):
        PromptTokenizer(junk)


def test_bad_arguments(tiny_tokenizer_path: Path):
    with pytest.raises(ValueError, match="max_length"):
        PromptTokenizer(tiny_tokenizer_path, max_length=0)
    with pytest.raises(ValueError, match="pad_id"):
        PromptTokenizer(tiny_tokenizer_path, pad_id=10_000)
    with pytest.raises(ValueError, match="must be a str"):
        PromptTokenizer(tiny_tokenizer_path).encode(123)  # type: ignore[arg-type]
