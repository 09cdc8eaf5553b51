"""Our LeRobot dataset reader against LeRobot 0.6.1's own ``LeRobotDataset[i]``, frame by frame.

Not part of CI (it needs LeRobot in its own Python 3.12 virtualenv, as ``bench/lerobot_parity.py``).

    python bench/lerobot_dataset_parity.py --work /tmp/dsparity            # venv reused or built, then runs
    python bench/lerobot_dataset_parity.py --work /tmp/dsparity --reuse    # reuse DIR from a previous run

Steps: (1) ``bench/lerobot_dataset_oracle.py`` runs under LeRobot: it writes a dataset with
``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize`` (LeRobot's default
AV1 video for two cameras, one inline image camera, two tasks), reads every item back with
``LeRobotDataset[i]`` and saves what it returned; (2) this script reads the same dataset with
:class:`vla_runtime.io.lerobot_dataset.LeRobotDatasetReader` and writes DIR/dataset_parity.json:
the largest pixel difference per camera, state/action/timestamp/task agreement, and the decode
speed of both (camera frames per second).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from lerobot_parity import ensure_lerobot_venv  # noqa: E402

from vla_runtime.io.lerobot_dataset import LeRobotDatasetReader  # noqa: E402

VIDEO = ("observation.images.top", "observation.images.wrist")
IMAGE = "observation.images.side"


def ensure_dataset_extra(py: Path) -> None:
    """LeRobot's dataset code needs its ``dataset`` extra (datasets, pandas, av), which
    ``lerobot[pi]`` does not pull in."""
    if subprocess.run([str(py), "-c", "import datasets, av"], capture_output=True).returncode != 0:
        print("installing lerobot[dataset]==0.6.1 into the LeRobot venv ...", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "lerobot[dataset]==0.6.1"], check=True)


def read_ours(work: Path) -> tuple[dict[str, np.ndarray], float, int]:
    """Every frame of every episode in index order, and the seconds it took."""
    t0 = time.perf_counter()
    reader = LeRobotDatasetReader(work / "ds")
    cols: dict[str, list[np.ndarray]] = {}
    for index in reader.episodes:
        table = reader.rows(index, [IMAGE, "observation.state", "action"])
        every = list(range(table.num_rows))
        for key in (*VIDEO, IMAGE):
            cols.setdefault(key, []).append(np.stack(reader.images(index, key, table, every)))
        for key in ("observation.state", "action"):
            cols.setdefault(key, []).append(reader.vectors(table, key).astype(np.float32))
        cols.setdefault("timestamp", []).append(table.column("timestamp").to_numpy().astype(np.float64))
        cols.setdefault("task", []).append(np.array([reader.tasks[i] for i in table.column("task_index").to_pylist()]))
    seconds = time.perf_counter() - t0
    out = {k: np.concatenate(v) for k, v in cols.items()}
    return out, seconds, len(reader.episodes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsparity"))
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lerobot/venv"))
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--backend", default="pyav", help="LeRobot's video backend (pyav, or torchcodec where it loads)")
    ap.add_argument("--reuse", action="store_true", help="skip the LeRobot run, reuse DIR")
    args = ap.parse_args()
    work = args.work
    if not args.reuse:
        if (work / "ds").exists():
            raise SystemExit(f"{work / 'ds'} exists: remove it or pass --reuse")
        py = ensure_lerobot_venv(args.venv)
        ensure_dataset_extra(py)
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(py), str(ROOT / "bench" / "lerobot_dataset_oracle.py"), "--out", str(work),
                        "--episodes", str(args.episodes), "--frames", str(args.frames), "--backend", args.backend],
                       check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    theirs = dict(np.load(work / "lerobot_frames.npz"))
    timing = json.loads((work / "lerobot_timing.json").read_text())
    ours, seconds, episodes = read_ours(work)
    n = len(theirs["timestamp"])
    if len(ours["timestamp"]) != n:
        raise SystemExit(f"frame count differs: ours {len(ours['timestamp'])}, LeRobot {n}")
    info = json.loads((work / "ds" / "meta" / "info.json").read_text())
    pixels = {}
    for key in (*VIDEO, IMAGE):
        d = np.abs(ours[key].astype(np.int16) - theirs[key].astype(np.int16))
        pixels[key] = {"max_abs_diff": int(d.max()), "mean_abs_diff": float(d.mean()),
                       "frames_identical": int((d.reshape(n, -1).max(1) == 0).sum()), "frames": n,
                       "codec": info["features"][key].get("info", {}).get("video.codec", "png (inline)")}
    cams = len(VIDEO) + 1
    result = {
        "frames": n, "episodes": episodes, "codebase_version": info["codebase_version"],
        "pixels": pixels,
        "state_max_abs_diff": float(np.abs(ours["observation.state"] - theirs["observation.state"]).max()),
        "action_max_abs_diff": float(np.abs(ours["action"] - theirs["action"]).max()),
        "timestamp_max_abs_diff": float(np.abs(ours["timestamp"] - theirs["timestamp"]).max()),
        "tasks_equal": bool((ours["task"] == theirs["task"]).all()),
        "decode": {
            "ours_camera_frames_per_s": n * cams / seconds, "ours_seconds": seconds,
            "lerobot_camera_frames_per_s": timing["items"] * timing["cameras"] / timing["seconds"],
            "lerobot_seconds": timing["seconds"], "lerobot_backend": timing["backend"],
            "note": "ours decodes each episode's video segment once, front to back; LeRobot[i] seeks and decodes "
                    "per item (random access), as its DataLoader use needs",
        },
        "machine": {"cpu_count": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    (work / "dataset_parity.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
