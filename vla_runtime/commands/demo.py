"""``vla-runtime demo-data``: a self-contained robot to try the runtime on, with nothing downloaded.

Writes (1) a checkpoint directory of a small pi0.5 preset with random weights, in the public
LeRobot layout, with a SentencePiece tokenizer trained on the demo's prompts and LeRobot
normalisation files computed from the demo's joint states; (2) recorded episodes of a repeated
task as rosbag2 bags (synthetic scenes), split into references and held-out episodes. Random
weights exercise every code path and give honest speed figures; the *quality* of a random
policy's actions means nothing (the closed-loop demo with a trained policy is separate).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..io.bags import BagTopics, write_episode_bag
from ..models.checkpoint import save_checkpoint
from ..models.config import preset
from ..models.normalize import save_lerobot_normalization
from ..models.pi05 import Pi05Model, init_random_
from ..models.tokenizer import train_prompt_tokenizer
from ..sim.scenes import JOINTS_PER_ARM, SceneConfig, joint_names, make_episodes

DEMO_TASK = "pick up the red block and put it in the bowl"
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DemoSpec:
    preset: str = "pi05-small"
    episodes: int = 8
    held_out: int = 2
    cameras: tuple[str, ...] = ("top", "wrist")
    steps_per_episode: int = 120
    task: str = DEMO_TASK
    seed: int = 0
    checkpoint_dtype: str = "float32"   # of the stored weights: full pi05 in float32 (and its copy while
    #                                     saving) does not fit a 24 GB machine, bfloat16 does

    def validate(self) -> "DemoSpec":
        if self.episodes < 2 or not 1 <= self.held_out < self.episodes:
            raise ValueError("need at least 2 episodes and 1 <= held_out < episodes")
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"checkpoint_dtype must be one of {sorted(CHECKPOINT_DTYPES)}, got {self.checkpoint_dtype!r}")
        return self


def demo_topics(cameras: tuple[str, ...]) -> BagTopics:
    return BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in cameras})


def _prompt_corpus(tasks: list[str], state_dim: int, n: int = 800, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Task: {tasks[i % len(tasks)]}, State: {' '.join(str(rng.randint(-1, 255)) for _ in range(state_dim))};"
            "\nAction: " for i in range(n)]


def write_random_checkpoint(ckpt: Path, cfg, tasks: list[str], states: np.ndarray, actions: np.ndarray,
                            cameras: tuple[str, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """A loadable checkpoint in the public layout with random weights: tokenizer trained on the
    prompts of ``tasks``, normalisation statistics of ``states``/``actions`` ([N, D] each).

    ``dtype``: of the stored tensors. The model is built directly in it (never in fp32 first), so
    full pi0.5 in bfloat16 can be written on a machine that cannot hold two fp32 copies of it."""
    with torch.device("meta"):
        model = Pi05Model(cfg)
    save_checkpoint(init_random_(model.to(dtype).to_empty(device="cpu"), seed=seed), ckpt)
    vocab = min(cfg.vocab_size, 400)
    train_prompt_tokenizer(_prompt_corpus(tasks, states.shape[1]), ckpt / "tokenizer.model", vocab_size=vocab,
                           exact_vocab=False)

    def stats(x: np.ndarray) -> dict[str, torch.Tensor]:
        t = torch.from_numpy(np.asarray(x)).float()
        return {"mean": t.mean(0), "std": t.std(0), "min": t.min(0).values, "max": t.max(0).values,
                "q01": torch.quantile(t, 0.01, dim=0), "q99": torch.quantile(t, 0.99, dim=0),
                "count": torch.tensor([float(len(t))])}
    save_lerobot_normalization(ckpt, {"observation.state": stats(states), "action": stats(actions)},
                               camera_keys=tuple(f"observation.images.{c}" for c in cameras))


def make_demo(out: str | Path, spec: DemoSpec = DemoSpec(), log=print) -> dict:
    spec = spec.validate()
    out = Path(out)
    cfg = preset(spec.preset)
    if len(spec.cameras) > cfg.num_cameras:
        raise ValueError(f"{len(spec.cameras)} cameras, preset {spec.preset} takes {cfg.num_cameras}")
    scene = SceneConfig(image_size=cfg.vision.image_size, cameras=spec.cameras, task=spec.task,
                        steps_per_episode=spec.steps_per_episode, seed=spec.seed)
    log(f"rendering {spec.episodes} episodes of {spec.task!r} ...")
    episodes = make_episodes(scene, spec.episodes, seed=spec.seed)
    states = np.concatenate([np.stack([f.state for f in ep.frames]) for ep in episodes])

    ckpt = out / "checkpoint"
    log(f"writing {spec.preset} checkpoint (random weights, {spec.checkpoint_dtype}) to {ckpt} ...")
    write_random_checkpoint(ckpt, cfg, [spec.task], states, states, spec.cameras, seed=spec.seed,
                            dtype=CHECKPOINT_DTYPES[spec.checkpoint_dtype])

    topics = demo_topics(spec.cameras)
    split = {"references": episodes[: spec.episodes - spec.held_out], "held_out": episodes[spec.episodes - spec.held_out:]}
    for name, eps in split.items():
        for ep in eps:
            path = out / "episodes" / name / ep.episode_id
            if path.exists():
                raise FileExistsError(f"{path} exists; choose an empty --out")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_episode_bag(path, ep, topics, joint_names=joint_names(ep.state_dim // JOINTS_PER_ARM))
        log(f"wrote {len(eps)} {name} bag(s) to {out / 'episodes' / name}")
    info = {"checkpoint": str(ckpt), "references": str(out / "episodes" / "references"),
            "held_out": str(out / "episodes" / "held_out"), "cameras": list(spec.cameras),
            # One joint-state topic here; kept a string, the form build-cache's --state-topic takes.
            "topics": {"cameras": topics.cameras, "joint_states": topics.joint_states[0],
                       "instruction": topics.instruction}, "task": spec.task, "preset": spec.preset}
    (out / "demo.json").write_text(json.dumps(info, indent=2))
    return info
