"""Writing episodes as a LeRobot dataset (codebase version v3.0) with pyarrow and PyAV.

Why here: the project's own recordings (the Meta-World demonstrations, the tests' fixtures) can
then be handed to LeRobot tooling, and read back through the same reader as a dataset made by
LeRobot itself. Written the way LeRobot 0.6 lays a dataset out (see :mod:`.lerobot_format`):
several episodes share one data file and one video file per camera (``episodes_per_file``),
each video stream counts its frames on from the file's first episode, and the episode table
records where each episode's rows and video segment are.

Cameras listed in ``video_keys`` become mp4 streams (AV1 or H.264, yuv420p, one frame per
dataset frame at ``fps``); the other cameras are stored inline as PNG, the way LeRobot stores
``image`` features (a struct of ``bytes`` and ``path``).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterator, Sequence

import av
import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import lerobot_format as fmt


@dataclass
class DatasetEpisodeData:
    """One episode to write: ``N`` frames at the dataset's fps.

    ``frame_tasks`` (optional) gives the task of each frame when it changes within the episode;
    by default every frame has ``task``. ``images`` maps the camera key (e.g.
    ``"observation.images.top"``) to uint8 ``[N, H, W, 3]`` RGB.
    """

    task: str
    state: np.ndarray
    action: np.ndarray
    images: dict[str, np.ndarray]
    frame_tasks: list[str] | None = None

    def __post_init__(self) -> None:
        self.state = np.asarray(self.state, dtype=np.float32)
        self.action = np.asarray(self.action, dtype=np.float32)
        n = self.state.shape[0]
        if self.state.ndim != 2 or self.action.ndim != 2 or self.action.shape[0] != n or n == 0:
            raise ValueError(f"state and action must be [N, D] with the same N > 0, got {self.state.shape} and "
                             f"{self.action.shape}")
        for key, imgs in self.images.items():
            if imgs.dtype != np.uint8 or imgs.ndim != 4 or imgs.shape[0] != n or imgs.shape[3] != 3:
                raise ValueError(f"images {key!r} must be uint8 [{n}, H, W, 3], got {imgs.dtype} {imgs.shape}")
        if self.frame_tasks is not None and len(self.frame_tasks) != n:
            raise ValueError(f"frame_tasks has {len(self.frame_tasks)} entries for {n} frames")

    @property
    def length(self) -> int:
        return int(self.state.shape[0])

    def tasks_by_frame(self) -> list[str]:
        return list(self.frame_tasks) if self.frame_tasks is not None else [self.task] * self.length


@dataclass(frozen=True)
class WriterConfig:
    fps: int = 30
    video_keys: tuple[str, ...] = ()
    codec: str = "h264"
    crf: int = 18                     # high quality, so a round trip stays close to the source
    state_key: str = "observation.state"
    action_key: str = "action"
    state_names: tuple[str, ...] | None = None
    action_names: tuple[str, ...] | None = None
    robot_type: str = "unknown"
    episodes_per_file: int = 1000
    chunks_size: int = 1000           # files per chunk directory (LeRobot's default)
    extra_info: dict = field(default_factory=dict)

    def validate(self) -> "WriterConfig":
        if self.codec not in fmt.ENCODERS:
            raise ValueError(f"codec must be one of {sorted(fmt.ENCODERS)}, got {self.codec!r}")
        if not (isinstance(self.fps, int) and self.fps > 0):
            raise ValueError(f"fps must be a positive integer, got {self.fps!r}")
        if self.episodes_per_file < 1 or self.chunks_size < 1:
            raise ValueError("episodes_per_file and chunks_size must be >= 1")
        return self


def _image_feature(key: str, shape: tuple[int, ...], video: bool, cfg: WriterConfig) -> dict:
    h, w, c = shape
    feat: dict = {"dtype": "video" if video else "image", "shape": [h, w, c], "names": ["height", "width", "channels"]}
    if video:
        feat["info"] = {"video.height": h, "video.width": w, "video.codec": cfg.codec, "video.pix_fmt": "yuv420p",
                        "video.is_depth_map": False, "video.fps": cfg.fps, "video.channels": c, "has_audio": False}
    return feat


def _vector_feature(dim: int, names: tuple[str, ...] | None) -> dict:
    return {"dtype": "float32", "shape": [dim], "names": list(names) if names else None}


@contextmanager
def _scheduling_kept() -> Iterator[None]:
    """Keep this thread's CPU scheduling policy through a call into the encoder.

    Why: the SVT-AV1 encoder (PyAV's ``libsvtav1``) switches the thread that drives it to
    SCHED_FIFO at priority 99 when it may (as root). Every process started afterwards inherits
    that, and two busy real-time processes then starve everything else on the machine (seen: ROS
    node processes started after an AV1 export hung a whole test run). The policy in force
    before each encoder call is put back after it."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if os.sched_getscheduler(0) != policy or os.sched_getparam(0) != param:
            os.sched_setscheduler(0, policy, param)


class _VideoFile:
    """One mp4 stream that several episodes append to; frame k has pts k (time base 1/fps)."""

    def __init__(self, path: Path, width: int, height: int, cfg: WriterConfig):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.container = av.open(str(path), mode="w")
        self.stream = self.container.add_stream(fmt.ENCODERS[cfg.codec], rate=cfg.fps)
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
        self.stream.time_base = Fraction(1, cfg.fps)
        self.stream.options = {"crf": str(cfg.crf)}
        self.frames = 0

    def append(self, images: np.ndarray) -> None:
        for img in images:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts = self.frames
            self.frames += 1
            with _scheduling_kept():
                packets = self.stream.encode(frame)
            for packet in packets:
                self.container.mux(packet)

    def close(self) -> None:
        with _scheduling_kept():
            packets = self.stream.encode()
        for packet in packets:
            self.container.mux(packet)
        with _scheduling_kept():
            self.container.close()


def _list_column(values: np.ndarray) -> pa.Array:
    flat = pa.array(values.reshape(-1), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, values.shape[1])


def _png_column(images: np.ndarray) -> pa.Array:
    rows = []
    for img in images:
        ok, buf = cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        if not ok:
            raise ValueError("PNG encoding failed")
        rows.append({"bytes": buf.tobytes(), "path": None})
    return pa.array(rows, type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def write_lerobot_dataset(root: str | Path, episodes: Sequence[DatasetEpisodeData], cfg: WriterConfig) -> Path:
    """Write ``episodes`` as a v3.0 dataset under ``root`` (which must not exist yet)."""
    cfg = cfg.validate()
    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root} exists already; a dataset is written into a new directory")
    if not episodes:
        raise ValueError("no episode to write")
    first = episodes[0]
    cams = {k: v.shape[1:] for k, v in first.images.items()}
    unknown = sorted(set(cfg.video_keys) - set(cams))
    if unknown:
        raise ValueError(f"video_keys {unknown} are not cameras of the episodes ({sorted(cams)})")
    for i, ep in enumerate(episodes):
        if {k: v.shape[1:] for k, v in ep.images.items()} != cams or ep.state.shape[1] != first.state.shape[1] \
                or ep.action.shape[1] != first.action.shape[1]:
            raise ValueError(f"episode {i} has other cameras or dimensions than episode 0")
    odd = [k for k in cfg.video_keys if cams[k][0] % 2 or cams[k][1] % 2]
    if odd:
        raise ValueError(f"video cameras {odd} need even width and height (yuv420p)")

    tasks: dict[str, int] = {}
    for ep in episodes:
        for t in ep.tasks_by_frame():
            tasks.setdefault(t, len(tasks))
    features = {k: _image_feature(k, tuple(s), k in cfg.video_keys, cfg) for k, s in cams.items()}
    features[cfg.state_key] = _vector_feature(first.state.shape[1], cfg.state_names)
    features[cfg.action_key] = _vector_feature(first.action.shape[1], cfg.action_names)
    features |= {"timestamp": {"dtype": "float32", "shape": [1], "names": None},
                 **{k: {"dtype": "int64", "shape": [1], "names": None} for k in fmt.INDEX_COLUMNS[1:]}}

    rows: list[dict] = []
    global_index = 0
    for start in range(0, len(episodes), cfg.episodes_per_file):
        file_no = start // cfg.episodes_per_file
        chunk, file = divmod(file_no, cfg.chunks_size)
        group = list(enumerate(episodes[start:start + cfg.episodes_per_file], start=start))
        videos = {k: _VideoFile(root / fmt.DEFAULT_VIDEO_PATH.format(video_key=k, chunk_index=chunk, file_index=file),
                                cams[k][1], cams[k][0], cfg) for k in cfg.video_keys}
        columns: dict[str, list[pa.Array]] = {}
        for ep_index, ep in group:
            n = ep.length
            row = {fmt.EP_INDEX: ep_index, fmt.EP_TASKS: list(dict.fromkeys(ep.tasks_by_frame())),
                   fmt.EP_LENGTH: n, fmt.EP_DATA_CHUNK: chunk, fmt.EP_DATA_FILE: file,
                   fmt.EP_FROM: global_index, fmt.EP_TO: global_index + n,
                   "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            for k, video in videos.items():
                row |= {fmt.video_column(k, "chunk_index"): chunk, fmt.video_column(k, "file_index"): file,
                        fmt.video_column(k, "from_timestamp"): video.frames / cfg.fps,
                        fmt.video_column(k, "to_timestamp"): (video.frames + n) / cfg.fps}
                video.append(ep.images[k])
            rows.append(row)
            part = {"timestamp": pa.array(np.arange(n, dtype=np.float32) / np.float32(cfg.fps)),
                    "frame_index": pa.array(np.arange(n, dtype=np.int64)),
                    "episode_index": pa.array(np.full(n, ep_index, dtype=np.int64)),
                    "index": pa.array(np.arange(global_index, global_index + n, dtype=np.int64)),
                    "task_index": pa.array(np.array([tasks[t] for t in ep.tasks_by_frame()], dtype=np.int64)),
                    cfg.state_key: _list_column(ep.state), cfg.action_key: _list_column(ep.action)}
            part |= {k: _png_column(ep.images[k]) for k in cams if k not in cfg.video_keys}
            for k, arr in part.items():
                columns.setdefault(k, []).append(arr)
            global_index += n
        for video in videos.values():
            video.close()
        table = pa.table({k: pa.concat_arrays(v) for k, v in columns.items()})
        path = root / fmt.DEFAULT_DATA_PATH.format(chunk_index=chunk, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)

    ep_path = root / fmt.EPISODES_PATH.format(chunk_index=0, file_index=0)
    ep_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), ep_path)
    pq.write_table(pa.table({"task": list(tasks), "task_index": pa.array(list(tasks.values()), pa.int64())}),
                   root / fmt.TASKS_PATH)
    info = {"codebase_version": fmt.CODEBASE_VERSION, "robot_type": cfg.robot_type,
            "total_episodes": len(episodes), "total_frames": global_index, "total_tasks": len(tasks),
            "chunks_size": cfg.chunks_size, "data_files_size_in_mb": 100, "video_files_size_in_mb": 500,
            "fps": cfg.fps, "splits": {"train": f"0:{len(episodes)}"}, "data_path": fmt.DEFAULT_DATA_PATH,
            "video_path": fmt.DEFAULT_VIDEO_PATH if cfg.video_keys else None, "features": features, **cfg.extra_info}
    (root / fmt.INFO_PATH).write_text(json.dumps(info, indent=4))
    _write_stats(root, episodes, cfg)
    return root


def _write_stats(root: Path, episodes: Sequence[DatasetEpisodeData], cfg: WriterConfig) -> None:
    """``meta/stats.json`` for the state and action (LeRobot's trainers normalise with it)."""
    stats = {}
    for key, attr in ((cfg.state_key, "state"), (cfg.action_key, "action")):
        x = np.concatenate([getattr(ep, attr) for ep in episodes]).astype(np.float64)
        stats[key] = {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(), "min": x.min(0).tolist(),
                      "max": x.max(0).tolist(), "count": [int(x.shape[0])],
                      "q01": np.quantile(x, 0.01, axis=0).tolist(), "q99": np.quantile(x, 0.99, axis=0).tolist()}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=2))
