"""Shared test fixtures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from vla_runtime.models.tokenizer import train_prompt_tokenizer

_WORDS = (
    "pick up the red green blue cube block cup bowl spoon fork drawer open close put place "
    "into onto inside on table left right top bottom towel fold stack push pull slide door "
    "handle bottle pour water wipe move robot arm gripper apple banana carrot plate shelf basket"
).split()


@pytest.fixture(scope="session", autouse=True)
def _weights_cache(tmp_path_factory: pytest.TempPathFactory):
    """Shared fused-weight files go to a per-run folder, never the user's ~/.cache (child
    processes inherit the variable)."""
    import os

    old = os.environ.get("VLA_RUNTIME_CACHE")
    os.environ["VLA_RUNTIME_CACHE"] = str(tmp_path_factory.mktemp("weights_cache"))
    yield
    if old is None:
        os.environ.pop("VLA_RUNTIME_CACHE", None)
    else:
        os.environ["VLA_RUNTIME_CACHE"] = old


@pytest.fixture(autouse=True)
def _scheduling_policy_unchanged():
    """No test may leave this process real-time: every process started afterwards (the stage and
    ROS node processes) would inherit SCHED_FIFO, and two busy real-time processes starve the rest
    of the machine (the SVT-AV1 encoder did this once and hung a whole run). Restored, then failed."""
    import os

    before = os.sched_getscheduler(0), os.sched_getparam(0)
    yield
    after = os.sched_getscheduler(0), os.sched_getparam(0)
    if after != before:
        os.sched_setscheduler(0, *before)
        pytest.fail(f"the test changed this process's CPU scheduling policy from {before} to {after}")


@pytest.fixture(autouse=True)
def _torch_threads():
    """A test that loads a policy with ``engine.threads`` sets torch's process-wide thread count;
    restored after it, so a later test comparing this process with spawned stage processes
    (bit for bit) is not run with another reduction order depending on test order."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _prompt_corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Sentences shaped like pi0.5 prompts, so the tiny vocab covers the template."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        state = " ".join(str(rng.randint(-1, 255)) for _ in range(rng.randint(4, 14)))
        out.append(f"Task: {task}, State: {state};\nAction: ")
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~300-piece SentencePiece model laid out like PaliGemma's tokenizer.

    Same special ids as PaliGemma/Gemma (pad 0, eos 1, bos 2, unk 3), no dummy prefix,
    identity normalisation (whitespace and newlines kept), digits split, and ``"\\n"`` as
    its own piece. Trains in a few tens of milliseconds.
    """
    return train_prompt_tokenizer(_prompt_corpus(), tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_path: Path) -> Path:
    """A complete pi05-tiny checkpoint as a user would bring it: LeRobot-layout weights and
    config.json, the SentencePiece tokenizer, and LeRobot processor files with quantile stats
    (4-dim state, 5-dim action)."""
    import shutil

    import torch

    from vla_runtime.models.checkpoint import save_checkpoint
    from vla_runtime.models.config import preset
    from vla_runtime.models.normalize import save_lerobot_normalization
    from vla_runtime.models.pi05 import Pi05Model, init_random_

    root = tmp_path_factory.mktemp("ckpt") / "pi05-tiny"
    save_checkpoint(init_random_(Pi05Model(preset("pi05-tiny")), seed=4), root)
    shutil.copy(tiny_tokenizer_path, root / "tokenizer.model")

    def feature(dim: int) -> dict[str, torch.Tensor]:
        lo = -torch.linspace(1.0, 2.0, dim)
        return {"q01": lo, "q99": lo + torch.linspace(2.0, 3.0, dim), "mean": torch.zeros(dim), "std": torch.ones(dim)}

    save_lerobot_normalization(root, {"observation.state": feature(4), "action": feature(5)},
                               camera_keys=("observation.images.top", "observation.images.wrist"))
    return root
