"""Train a small pi0.5 policy of our architecture with flow matching on recorded episode bags.

Why here (``training/``, not the runtime API): training is an offline job that produces a
checkpoint; the runtime only loads checkpoints. The output is in the public layout the runtime
loads unchanged (``model.safetensors`` + ``config.json``, LeRobot normalisation files, a
SentencePiece tokenizer), so the trained policy goes through exactly the deployed path.

Data: bags written by ``training/metaworld_demos`` (or a robot recording with the same topics), or
with ``--robot-profile`` bags in a robot profile's own layout (``training/aloha_demos``, a robot's
recording; the state is assembled by joint name as the policy node does): one frame per policy
call (cameras, state, instruction) and the commanded action at every control tick on an action
topic; the target of frame ``i`` is the chunk of ``chunk_size`` actions from
the frame's tick on. The state enters as pi0.5 does it: quantile-normalised, discretised into the
prompt.

Training: ``models.training.TrainingForward`` (the same parameters as inference, differentiable),
flow-matching loss with ``draws`` noise/time samples per image (the prefix is the expensive part),
flow times drawn among the sampler's 10 schedule times by default (the only times the 10-step
Euler sampler evaluates), AdamW with warm-up and a cosine decay over the *time budget* (or the
step budget, whichever is reached first), so a run always ends with a decayed learning rate and
an exported checkpoint by its deadline. A training state is saved every few minutes;
``--resume`` continues from it (weights, optimiser, step, elapsed time, random streams).

``--init-from RUN`` starts a new run (new data, fresh optimiser and schedule) from the weights of
an earlier run directory, keeping its normalisation statistics and tokenizer so the weights keep
meaning what they meant: the DAgger round (expert-labelled states the policy visited, recorded
by ``metaworld_demos --policy``) fine-tunes the policy on the old and new episodes together.
Unsuccessful episodes are skipped unless their ``demos.json`` says they carry DAgger labels.

    python -m vla_runtime.training.train --demos /tmp/mw/demos --out /tmp/mw/ckpt \\
        --export /tmp/mw/checkpoint --minutes 55
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..io.bags import BagTopics, list_episode_bags, profile_topics, read_episode, read_joint_series
from ..models.checkpoint import load_checkpoint, save_checkpoint
from ..models.config import Pi05Config, preset
from ..models.normalize import MODE_QUANTILES, Stats, make_normalizer, save_lerobot_normalization
from ..models.pi05 import Pi05Model, init_random_
from ..models.tokenizer import PromptTokenizer, build_prompt, discretize_state, train_prompt_tokenizer
from ..models.training import TrainingForward, flow_matching_loss
from ..nodes.profile import load_profile
from .recording import keeps_failed_episodes

STATE_FILE = "train_state.pt"
#: Settings a resumed run takes from its command line instead of the saved run.
RESUME_OVERRIDES = ("export", "max_steps", "minutes", "threads", "log_every", "save_minutes", "export_minutes")
DATA_CACHE = "dataset.npz"
SAMPLING_MODES = ("frames", "tasks")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; stored with the training state and checked on resume."""

    demos: str
    out: str
    export: str | None = None
    preset: str = "pi05-mw"
    cameras: tuple[str, ...] = ("corner", "topview")
    action_topic: str = "/action_command"
    call_period: float = 0.05          # seconds between recorded frames (policy calls)
    control_dt: float = 0.0125         # seconds between recorded actions (control ticks)
    batch: int = 32
    draws: int = 4
    lr: float = 3e-4
    min_lr_frac: float = 0.05
    weight_decay: float = 0.01
    warmup: int = 200
    max_steps: int = 100_000
    minutes: float = 55.0
    time_mode: str = "schedule"
    sampling: str = "frames"           # "tasks": each task equally likely per draw, whatever its frame count
    shift: int = 3                     # random image shift in pixels (augmentation), 0 = off
    grad_clip: float = 1.0
    val_fraction: float = 0.05
    save_minutes: float = 4.0
    log_every: int = 20
    seed: int = 0
    threads: int = 2
    export_dtype: str = "float16"
    init_std: float = 0.02
    ema_decay: float = 0.999           # exported weights: exponential moving average (0 = off)
    export_minutes: float = 15.0       # also export the current weights this often (0 = only at the end)
    init_from: str | None = None       # a run directory: start from its weights, statistics and tokenizer
    robot_profile: str | None = None   # bags in a robot profile's layout (its topics, joints by name)

    def validate(self) -> "TrainConfig":
        cfg = preset(self.preset)
        if len(self.cameras) != cfg.num_cameras:
            raise ValueError(f"preset {self.preset} takes {cfg.num_cameras} cameras, got {self.cameras}")
        if self.robot_profile is not None:
            names = tuple(c.name for c in load_profile(self.robot_profile).cameras)
            if names != tuple(self.cameras):
                raise ValueError(f"the cameras {self.cameras} are not the profile's {names} (in its order)")
        if self.batch < 1 or self.draws < 1 or self.max_steps < 1 or self.minutes <= 0:
            raise ValueError("batch, draws, max_steps >= 1 and minutes > 0")
        if self.time_mode not in ("schedule", "uniform"):
            raise ValueError("time_mode must be 'schedule' or 'uniform'")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}")
        if self.export_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError("export_dtype must be float32, float16 or bfloat16")
        if not 0 <= self.ema_decay < 1:
            raise ValueError("ema_decay must be in [0, 1)")
        if not 0 <= self.val_fraction < 0.5 or self.shift < 0:
            raise ValueError("val_fraction in [0, 0.5) and shift >= 0")
        if self.init_from is not None:
            for f in (STATE_FILE, DATA_CACHE, "tokenizer.model"):
                if not (Path(self.init_from) / f).is_file():
                    raise FileNotFoundError(f"--init-from {self.init_from}: {f} missing (not a training run directory)")
        return self

    @property
    def model_config(self) -> Pi05Config:
        return preset(self.preset)


# ------------------------------------------------------------------------------------ data
@dataclass
class DemoData:
    """All frames of all episodes in memory (small images: a few hundred MB at most)."""

    images: np.ndarray        # [N, C, S, S, 3] uint8
    states: np.ndarray        # [N, state_dim] float32, raw
    chunks: np.ndarray        # [N, chunk, action_dim] float32, raw
    episode: np.ndarray       # [N] episode index
    task: np.ndarray          # [N] index into tasks
    tasks: list[str]
    all_actions: np.ndarray   # [M, action_dim] every recorded action (statistics)

    def save(self, path: Path) -> None:
        np.savez(path, images=self.images, states=self.states, chunks=self.chunks, episode=self.episode,
                 task=self.task, tasks=np.array(self.tasks), all_actions=self.all_actions)

    @staticmethod
    def load(path: Path) -> "DemoData":
        z = np.load(path)
        return DemoData(z["images"], z["states"], z["chunks"], z["episode"], z["task"],
                        [str(t) for t in z["tasks"]], z["all_actions"])


def action_chunks(frame_times: np.ndarray, action_t: np.ndarray, actions: np.ndarray, chunk: int,
                  dt: float) -> np.ndarray:
    """The ``chunk`` actions from each frame's control tick on; past the end, the last action."""
    start = np.rint(frame_times / dt).astype(np.int64)
    ticks = np.rint(action_t / dt).astype(np.int64)
    if np.any(np.diff(ticks) != 1) or ticks[0] != 0:
        raise ValueError("the action series must have one action per control tick from t = 0")
    idx = np.minimum(start[:, None] + np.arange(chunk)[None, :], len(actions) - 1)
    return actions[idx].astype(np.float32)


def load_demos(cfg: TrainConfig, log=print) -> DemoData:
    """Read every successful episode bag under ``cfg.demos`` into arrays."""
    mcfg = cfg.model_config
    topics = (profile_topics(load_profile(cfg.robot_profile)) if cfg.robot_profile else
              BagTopics(cameras={c: f"/cameras/{c}/image_raw" for c in cfg.cameras}))
    images, states, chunks, episode, task_idx, all_actions = [], [], [], [], [], []
    tasks: list[str] = []
    bags = list_episode_bags(cfg.demos)
    skipped = 0
    for e, path in enumerate(bags):
        ep = read_episode(path, topics, cfg.call_period)
        if ep.success is False and not keeps_failed_episodes(path, Path(cfg.demos)):
            skipped += 1
            continue
        series = read_joint_series(path, cfg.action_topic)
        times = np.array([f.t for f in ep.frames])
        chunks.append(action_chunks(times, series.t, series.values, mcfg.chunk_size, cfg.control_dt))
        all_actions.append(series.values.astype(np.float32))
        for f in ep.frames:
            img = [f.images[c] for c in cfg.cameras]
            if img[0].shape[:2] != (mcfg.vision.image_size,) * 2:
                raise ValueError(f"{path}: images are {img[0].shape[:2]}, the preset takes "
                                 f"{mcfg.vision.image_size}x{mcfg.vision.image_size}")
            images.append(np.stack(img))
            states.append(f.state)
        if ep.task not in tasks:
            tasks.append(ep.task)
        episode += [e] * len(ep.frames)
        task_idx += [tasks.index(ep.task)] * len(ep.frames)
        if (e + 1) % 100 == 0:
            log(f"read {e + 1}/{len(bags)} bags")
    log(f"{len(bags) - skipped} episodes ({skipped} unsuccessful skipped), {len(images)} frames, tasks {tasks}")
    return DemoData(np.stack(images), np.stack(states).astype(np.float32), np.concatenate(chunks),
                    np.asarray(episode), np.asarray(task_idx), tasks, np.concatenate(all_actions))


def quantile_stats(x: np.ndarray) -> dict[str, torch.Tensor]:
    """LeRobot's per-dimension statistics (pi0.5 normalises with q01/q99)."""
    t = torch.from_numpy(np.asarray(x, np.float32))
    q = lambda p: torch.quantile(t, p, dim=0)  # noqa: E731
    return {"mean": t.mean(0), "std": t.std(0), "min": t.min(0).values, "max": t.max(0).values,
            "q01": q(0.01), "q99": q(0.99), "q10": q(0.10), "q90": q(0.90), "count": torch.tensor([float(len(t))])}


def dataset_stats(data: DemoData) -> Stats:
    return {"observation.state": quantile_stats(data.states), "action": quantile_stats(data.all_actions)}


def prompts_for(data: DemoData, stats: Stats) -> list[str]:
    norm = make_normalizer(stats, "observation.state", MODE_QUANTILES)
    s = norm.normalize(torch.from_numpy(data.states))
    return [build_prompt(data.tasks[int(k)], discretize_state(row)) for k, row in zip(data.task, s)]


@dataclass
class Tensors:
    """Model-ready training tensors (normalised actions, tokenized prompts)."""

    images: torch.Tensor      # [N, C, 3, S, S] uint8
    tokens: torch.Tensor      # [N, L] int64
    token_mask: torch.Tensor  # [N, L] bool
    actions: torch.Tensor     # [N, chunk, action_dim] normalised, padded
    episode: np.ndarray


def to_tensors(data: DemoData, stats: Stats, tok: PromptTokenizer, mcfg: Pi05Config) -> Tensors:
    ids, masks = [], []
    for p in prompts_for(data, stats):
        i, m = tok.encode(p)
        ids.append(i)
        masks.append(m)
    act = make_normalizer(stats, "action", MODE_QUANTILES).normalize(torch.from_numpy(data.chunks))
    if act.shape[-1] < mcfg.action_dim:
        act = torch.nn.functional.pad(act, (0, mcfg.action_dim - act.shape[-1]))
    imgs = torch.from_numpy(data.images).permute(0, 1, 4, 2, 3).contiguous()
    return Tensors(imgs, torch.stack(ids), torch.stack(masks), act.float().contiguous(), data.episode)


def model_images(u8: torch.Tensor, shift: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [B, C, 3, S, S] -> float [-1, 1] as ``models.preprocess`` maps an S x S image; with
    ``shift`` > 0 each image is translated by up to ``shift`` pixels (edge replicated)."""
    x = u8.float() / 255.0 * 2.0 - 1.0
    if shift <= 0:
        return x
    b, c, ch, h, w = x.shape
    flat = torch.nn.functional.pad(x.view(b * c, ch, h, w), (shift,) * 4, mode="replicate")
    off = torch.randint(0, 2 * shift + 1, (b * c, 2), generator=generator)
    out = torch.stack([flat[i, :, dy:dy + h, dx:dx + w] for i, (dy, dx) in enumerate(off.tolist())])
    return out.view(b, c, ch, h, w)


# ------------------------------------------------------------------------------------ training
class BatchSampler:
    """Draws training frames, uniformly over frames or over tasks first.

    DAgger rounds add most frames where the policy is weakest (failed episodes run to the step
    limit), so uniform frames let the long, hard tasks crowd out the short ones; drawing the task
    first keeps every task's share of the updates at 1/T.
    """

    def __init__(self, frames: torch.Tensor, task_of_frame: np.ndarray, mode: str) -> None:
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {mode!r}")
        self.frames, self.mode = frames, mode
        tasks = task_of_frame[frames.numpy()]
        order = np.argsort(tasks, kind="stable")             # the frames grouped by task, in their order
        self.tasks, counts = np.unique(tasks, return_counts=True)
        self.grouped = frames[torch.from_numpy(order)]
        self.counts = torch.from_numpy(counts)
        self.starts = torch.cumsum(self.counts, 0) - self.counts

    def __call__(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        if self.mode == "frames":
            return self.frames[torch.randint(0, len(self.frames), (batch,), generator=generator)]
        which = torch.randint(0, len(self.counts), (batch,), generator=generator)
        within = (torch.rand(batch, generator=generator) * self.counts[which]).long()
        return self.grouped[self.starts[which] + within]


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine to ``min_lr_frac`` over the step or time budget (the nearer)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, max(step / cfg.max_steps, elapsed_s / (cfg.minutes * 60.0)))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_checkpoint(model: Pi05Model, stats: Stats, tokenizer_file: Path, out: Path, cfg: TrainConfig,
                      info: dict) -> Path:
    """Public layout: weights (``export_dtype``), normalisation files, tokenizer, training card."""
    dtype = getattr(torch, cfg.export_dtype)
    m = copy.deepcopy(model).to(dtype)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint(m, tmp, extra_config={"vla_runtime_training": info})
    save_lerobot_normalization(tmp, stats, camera_keys=tuple(f"observation.images.{c}" for c in cfg.cameras))
    shutil.copy(tokenizer_file, tmp / "tokenizer.model")
    (tmp / "training.json").write_text(json.dumps(info, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def train(cfg: TrainConfig, resume: bool = False, log=print) -> dict:
    cfg = cfg.validate()
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    mcfg = cfg.model_config
    state_path = out / STATE_FILE
    saved = None
    if resume:
        if not state_path.exists():
            raise FileNotFoundError(f"--resume: no training state at {state_path}")
        saved = torch.load(state_path, weights_only=False)
        if saved["config"]["demos"] != cfg.demos or saved["config"]["preset"] != cfg.preset:
            raise ValueError("--resume with different demos or preset than the saved run")
        # The saved run's settings win, except the budget and where things go: a resumed run may
        # be given more time (the cosine schedule then stretches from where it is).
        keep = {k: getattr(cfg, k) for k in RESUME_OVERRIDES}
        cfg = TrainConfig(**{**saved["config"], "cameras": tuple(saved["config"]["cameras"]), **keep}).validate()

    # Data, statistics and tokenizer: computed once per run and kept in ``out`` for resuming.
    cache = out / DATA_CACHE
    if cache.exists():
        data = DemoData.load(cache)
        log(f"loaded cached dataset {cache}: {len(data.states)} frames")
    else:
        t0 = time.time()
        data = load_demos(cfg, log)
        data.save(cache)
        log(f"dataset read in {time.time() - t0:.0f}s")
    # An initialised run keeps the statistics and tokenizer its weights were trained with.
    init = Path(cfg.init_from) if cfg.init_from else None
    stats = dataset_stats(DemoData.load(init / DATA_CACHE) if init else data)
    tok_file = out / "tokenizer.model"
    if init and not tok_file.exists():
        shutil.copyfile(init / "tokenizer.model", tok_file)
    if not tok_file.exists():
        corpus = prompts_for(data, stats)
        train_prompt_tokenizer(corpus, tok_file, vocab_size=mcfg.vocab_size, exact_vocab=False)
    tok = PromptTokenizer(tok_file, max_length=mcfg.max_token_len)
    tensors = to_tensors(data, stats, tok, mcfg)
    longest = int(tensors.token_mask.sum(-1).max())
    log(f"prompt tokens: longest {longest} of {mcfg.max_token_len}; vocabulary {tok.vocab_size}")

    gen = torch.Generator().manual_seed(cfg.seed)
    episodes = np.unique(tensors.episode)
    n_val = int(round(len(episodes) * cfg.val_fraction))
    val_eps = set(np.random.default_rng(cfg.seed).choice(episodes, n_val, replace=False).tolist()) if n_val else set()
    is_val = np.isin(tensors.episode, list(val_eps))
    train_idx = torch.from_numpy(np.flatnonzero(~is_val))
    val_idx = torch.from_numpy(np.flatnonzero(is_val))[:64]
    log(f"{len(train_idx)} training frames, {int(is_val.sum())} validation frames ({n_val} episodes)")
    sample = BatchSampler(train_idx, data.task, cfg.sampling)
    if cfg.sampling == "tasks":
        log("sampling tasks equally: " + ", ".join(f"{data.tasks[int(t)]} {int(n)} frames"
                                                   for t, n in zip(sample.tasks, sample.counts)))

    model = init_random_(Pi05Model(mcfg), seed=cfg.seed, std=cfg.init_std)
    with torch.no_grad():  # pi0.5-style start: zero-initialised norms and adaptive modulation
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "_mod." in name:
                p.zero_()
    model.train().requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, elapsed, history = 0, 0.0, []
    ema_model = copy.deepcopy(model).requires_grad_(False) if cfg.ema_decay > 0 else model
    if saved is not None:
        model.load_state_dict(saved["model"])
        if cfg.ema_decay > 0:
            ema_model.load_state_dict(saved["ema"])
        opt.load_state_dict(saved["optimizer"])
        step, elapsed, history = saved["step"], saved["elapsed"], saved["history"]
        gen.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        log(f"resumed at step {step}, {elapsed / 60:.1f} min trained")
    elif init is not None:
        start = torch.load(init / STATE_FILE, weights_only=False)
        if start["config"]["preset"] != cfg.preset:
            raise ValueError(f"--init-from {init}: preset {start['config']['preset']}, this run {cfg.preset}")
        model.load_state_dict(start["ema"] if cfg.ema_decay > 0 else start["model"])
        if cfg.ema_decay > 0:
            ema_model.load_state_dict(start["ema"])
        log(f"initialised from {init} (step {start['step']}, {start['elapsed'] / 60:.1f} min trained): "
            "its weights, statistics and tokenizer")
    fwd = TrainingForward(model)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {cfg.preset}: {n_params / 1e6:.2f}M parameters; batch {cfg.batch} x {cfg.draws} draws; "
        f"budget {cfg.minutes} min / {cfg.max_steps} steps")

    def save_state() -> None:
        _atomic_save({"config": asdict(cfg), "model": model.state_dict(), "ema": ema_model.state_dict(),
                      "optimizer": opt.state_dict(),
                      "step": step, "elapsed": elapsed, "history": history, "generator": gen.get_state(),
                      "torch_rng": torch.get_rng_state()}, state_path)

    def val_loss() -> float:
        if len(val_idx) == 0:
            return float("nan")
        g = torch.Generator().manual_seed(1234)  # same noise every time: comparable numbers
        ema_model.eval()
        with torch.no_grad():  # the weights that get exported
            loss = flow_matching_loss(TrainingForward(ema_model), model_images(tensors.images[val_idx]),
                                      torch.ones(len(val_idx), mcfg.num_cameras, dtype=torch.bool),
                                      tensors.tokens[val_idx], tensors.token_mask[val_idx], tensors.actions[val_idx],
                                      draws=4, time_mode=cfg.time_mode, generator=g)
        model.train()  # ema_model and model are one object when EMA is off
        return float(loss)

    budget_s = cfg.minutes * 60.0
    ema = first_loss = None
    t_run = time.time() - elapsed          # elapsed includes earlier sessions
    last_save = last_export = time.time()
    window_t, window_n = time.time(), 0
    while step < cfg.max_steps and elapsed < budget_s:
        for g_ in opt.param_groups:
            g_["lr"] = lr_at(cfg, step, elapsed)
        idx = sample(cfg.batch, gen)
        imgs = model_images(tensors.images[idx], cfg.shift, gen)
        tmask = tensors.token_mask[idx]
        used = int(tmask.sum(-1).max())  # right padding nobody attends to: cut it (same result)
        loss = flow_matching_loss(fwd, imgs, torch.ones(cfg.batch, mcfg.num_cameras, dtype=torch.bool),
                                  tensors.tokens[idx, :used], tmask[:, :used], tensors.actions[idx],
                                  draws=cfg.draws, time_mode=cfg.time_mode, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if cfg.ema_decay > 0:  # warm-up of the decay so early weights are not averaged in for long
            d = min(cfg.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(list(ema_model.parameters()), list(model.parameters()), 1 - d)
        step += 1
        window_n += cfg.batch
        elapsed = time.time() - t_run
        loss_value = loss.item()
        first_loss = loss_value if first_loss is None else first_loss
        ema = loss_value if ema is None else 0.98 * ema + 0.02 * loss_value
        if step % cfg.log_every == 0 or step == 1:
            rate = window_n / max(time.time() - window_t, 1e-9)
            window_t, window_n = time.time(), 0
            eta = min(budget_s - elapsed, (cfg.max_steps - step) * cfg.batch / max(rate, 1e-9))
            log(f"step {step} loss {loss_value:.4f} (ema {ema:.4f}) lr {opt.param_groups[0]['lr']:.2e} "
                f"{rate:.1f} samples/s elapsed {elapsed / 60:.1f} min ETA {max(eta, 0) / 60:.1f} min")
        if step % (cfg.log_every * 25) == 0:
            v = val_loss()
            history.append({"step": step, "minutes": round(elapsed / 60, 2), "train_ema": ema, "val": v})
            log(f"step {step} validation loss {v:.4f}")
        if time.time() - last_save > cfg.save_minutes * 60:
            save_state()
            last_save = time.time()
            log(f"saved training state at step {step} to {state_path}")
        if cfg.export and cfg.export_minutes > 0 and time.time() - last_export > cfg.export_minutes * 60:
            export_checkpoint(ema_model, stats, tok_file, Path(cfg.export), cfg,
                              {"preset": cfg.preset, "steps": step, "train_minutes": round(elapsed / 60, 1),
                               "partial": True, "tasks": data.tasks, "cameras": list(cfg.cameras)})
            last_export = time.time()
            log(f"exported intermediate checkpoint (step {step}) to {cfg.export}")
    v = val_loss()
    history.append({"step": step, "minutes": round(elapsed / 60, 2), "train_ema": ema, "val": v})
    save_state()
    info = {"preset": cfg.preset, "steps": step, "train_minutes": round(elapsed / 60, 1),
            "first_train_loss": first_loss, "final_train_loss_ema": ema, "final_val_loss": v, "frames": int(len(train_idx)),
            "episodes": int(len(episodes) - n_val), "tasks": data.tasks, "cameras": list(cfg.cameras),
            "parameters": n_params, "config": asdict(cfg), "history": history}
    log(f"done: {step} steps in {elapsed / 60:.1f} min, validation loss {v:.4f}")
    if cfg.export:
        path = export_checkpoint(ema_model, stats, tok_file, Path(cfg.export), cfg, info)
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        load_checkpoint(path)  # refuse to report success on a checkpoint the runtime cannot load
        log(f"exported checkpoint to {path} ({size:.1f} MB)")
    return info


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig(demos="", out="")
    p = argparse.ArgumentParser(prog="train", description="train a small pi0.5 policy with flow matching")
    p.add_argument("--demos", required=True, help="directory of episode bags (training.metaworld_demos output)")
    p.add_argument("--out", required=True, help="run directory: training state, dataset cache, tokenizer")
    p.add_argument("--export", default=None, help="write the final checkpoint (public layout) here")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out (its settings win)")
    p.add_argument("--init-from", default=None, help="start from an earlier run directory's weights, statistics "
                                                     "and tokenizer (fresh optimiser and schedule; e.g. DAgger)")
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--cameras", default=None, help=f"camera names in model order (default: the robot profile's, "
                                                   f"else {','.join(d.cameras)})")
    p.add_argument("--robot-profile", default=None, help="bags recorded in this robot profile's layout (its "
                                                         "camera and joint-state topics; e.g. training.aloha_demos)")
    for name in ("batch", "draws", "warmup", "max_steps", "shift", "seed", "threads", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "minutes", "weight_decay", "save_minutes", "call_period", "control_dt", "val_fraction",
                 "ema_decay", "export_minutes"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--time-mode", default=d.time_mode, choices=("schedule", "uniform"))
    p.add_argument("--export-dtype", default=d.export_dtype, choices=("float32", "float16", "bfloat16"))
    p.add_argument("--sampling", default=d.sampling, choices=SAMPLING_MODES,
                   help="draw frames uniformly, or each task equally often (after DAgger rounds)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cameras = (a.cameras.split(",") if a.cameras else
               [c.name for c in load_profile(a.robot_profile).cameras] if a.robot_profile else TrainConfig.cameras)
    cfg = TrainConfig(demos=a.demos, out=a.out, export=a.export, preset=a.preset, cameras=tuple(cameras),
                      batch=a.batch, draws=a.draws, warmup=a.warmup, max_steps=a.max_steps, shift=a.shift,
                      seed=a.seed, threads=a.threads, log_every=a.log_every, lr=a.lr, minutes=a.minutes,
                      weight_decay=a.weight_decay, save_minutes=a.save_minutes, call_period=a.call_period,
                      control_dt=a.control_dt, val_fraction=a.val_fraction, time_mode=a.time_mode,
                      export_dtype=a.export_dtype, ema_decay=a.ema_decay, export_minutes=a.export_minutes,
                      init_from=a.init_from, sampling=a.sampling, robot_profile=a.robot_profile)
    train(cfg, resume=a.resume, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
