"""Runs under LeRobot 0.6.1 (its own Python 3.12 venv): write a small dataset with LeRobot itself,
then read every frame back with ``LeRobotDataset[i]`` and save what it returned.

Called by ``bench/lerobot_dataset_parity.py``; not imported by the package. Writes into --out:
``ds/`` (the dataset, LeRobotDataset.create / add_frame / save_episode / finalize, LeRobot's
default video encoder), ``lerobot_frames.npz`` (per frame: each camera as uint8 HWC, state,
action, timestamp, episode and frame index, task index) and ``lerobot_timing.json`` (seconds
LeRobot took to return every item, decoding included).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset

H, W = 96, 128
VIDEO = ("observation.images.top", "observation.images.wrist")
IMAGE = "observation.images.side"
TASKS = ("pick up the cube", "open the drawer")


def frame_image(k: int, episode: int, camera: int) -> np.ndarray:
    """A gradient with a moving square: smooth enough for the codec, different on every frame."""
    yy, xx = np.mgrid[0:H, 0:W]
    img = np.stack([(xx * 2 + 9 * camera) % 256, (yy * 2 + 5 * episode) % 256,
                    np.full_like(xx, (40 * camera + 3 * k) % 256)], -1).astype(np.uint8)
    x0 = (7 * k + 11 * episode) % (W - 16)
    img[20:36, x0:x0 + 16] = (250, 40 * camera, 20)
    return img


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--backend", default="pyav", help="LeRobot's video_backend for reading (pyav or torchcodec)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = args.out / "ds"
    cam = {"shape": (H, W, 3), "names": ["height", "width", "channels"]}
    vec = {"dtype": "float32", "shape": (6,), "names": [f"j{i}" for i in range(6)]}
    features = {**{k: {"dtype": "video", **cam} for k in VIDEO}, IMAGE: {"dtype": "image", **cam},
                "observation.state": vec, "action": dict(vec)}
    ds = LeRobotDataset.create(repo_id="local/vla_runtime_parity", fps=args.fps, features=features, root=root,
                               robot_type="parity", use_videos=True)
    rng = np.random.default_rng(0)
    for e in range(args.episodes):
        for k in range(args.frames):
            ds.add_frame({**{key: frame_image(k, e, c) for c, key in enumerate((*VIDEO, IMAGE))},
                          "observation.state": rng.normal(size=6).astype(np.float32),
                          "action": rng.normal(size=6).astype(np.float32), "task": TASKS[e % 2]})
        ds.save_episode()
    ds.finalize()

    back = LeRobotDataset("local/vla_runtime_parity", root=root, video_backend=args.backend)
    t0 = time.perf_counter()
    items = [back[i] for i in range(len(back))]
    seconds = time.perf_counter() - t0
    out: dict[str, np.ndarray] = {}
    for key in (*VIDEO, IMAGE):
        # LeRobot returns CHW float32 = uint8 / 255: round(x * 255) is the decoded byte again
        out[key] = np.stack([(it[key].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for it in items])
    for key in ("observation.state", "action"):
        out[key] = np.stack([it[key].numpy() for it in items])
    for key in ("timestamp", "episode_index", "frame_index", "task_index"):
        out[key] = np.array([float(it[key]) for it in items])
    out["task"] = np.array([it["task"] for it in items])
    np.savez(args.out / "lerobot_frames.npz", **out)
    (args.out / "lerobot_timing.json").write_text(json.dumps({
        "items": len(items), "cameras": len(VIDEO) + 1, "video_cameras": len(VIDEO), "seconds": seconds,
        "backend": args.backend, "fps": args.fps, "size": [H, W]}))
    print(f"LeRobot: {len(items)} items in {seconds:.2f} s ({args.backend})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
