"""Reading a LeRobot dataset (codebase version v3.0, what LeRobot 0.6.x writes) from a local directory.

Why: people fine-tune pi0.5 on LeRobot datasets, so the episodes the policy was trained to
reproduce are already on their disk in this format; reading it directly lets ``build-cache``,
``replay`` and ``bench --cache`` use them without re-recording anything on a ROS robot.

What is read (layout in :mod:`.lerobot_format`): ``meta/info.json`` (fps, features, path
templates), ``meta/tasks.parquet``, the episode table under ``meta/episodes/`` (each episode's
row range, length, tasks and video segments), the per-frame rows in ``data/`` and the camera
frames, either inline PNG/JPEG in the parquet rows (``image`` features) or mp4 segments in
``videos/`` (``video`` features) decoded with PyAV (AV1, H.264 or whatever the wheel's FFmpeg
decodes). A video frame is the one whose presentation time is the segment's ``from_timestamp``
plus the row's ``timestamp``, within ``tolerance_s`` (LeRobot uses the same rule and default).

Only v3.0 is read: v2.x keeps one file per episode and JSON-lines metadata, a different
layout; such a dataset is refused naming its version. Nothing is downloaded: the path must be a
local directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import av
import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import lerobot_format as fmt

#: LeRobot's default ``tolerance_s``: how far a decoded frame's time may be from the wanted one.
DEFAULT_TOLERANCE_S = 1e-4


class DatasetError(ValueError):
    """The directory is not a readable v3.0 LeRobot dataset; the message names the file or key."""


@dataclass(frozen=True)
class Feature:
    key: str
    dtype: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None

    @property
    def is_camera(self) -> bool:
        return self.dtype in ("video", "image")


@dataclass(frozen=True)
class VideoSegment:
    path: Path
    from_timestamp: float
    to_timestamp: float


@dataclass(frozen=True)
class EpisodeMeta:
    """One row of the episode table: where the episode's frames are."""

    index: int
    length: int
    tasks: tuple[str, ...]
    data_path: Path
    from_index: int
    to_index: int
    videos: dict[str, VideoSegment]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path.parent.parent}: no {fmt.INFO_PATH}; not a LeRobot dataset directory") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from None


def _column(table: pa.Table, name: str, where: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise DatasetError(f"{where} has no column {name!r}; it has {table.column_names}")
    return table.column(name)


class LeRobotDatasetReader:
    """A v3.0 dataset on disk: its metadata at construction, frames on demand per episode."""

    def __init__(self, root: str | Path, tolerance_s: float = DEFAULT_TOLERANCE_S):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"no dataset directory at {root} (only local directories are read; "
                                    "nothing is downloaded)")
        self.root = root
        self.tolerance_s = float(tolerance_s)
        info = _read_json(root / fmt.INFO_PATH)
        version = info.get("codebase_version")
        if version != fmt.CODEBASE_VERSION:
            raise DatasetError(f"{root}: codebase version {version!r} is not supported; only "
                               f"{fmt.CODEBASE_VERSION} (LeRobot 0.6) is read. Convert the dataset with LeRobot's "
                               f"v3.0 conversion script first")
        self.info = info
        try:
            self.fps = float(info["fps"])
            raw_features = info["features"]
        except KeyError as e:
            raise DatasetError(f"{root / fmt.INFO_PATH}: missing key {e}") from None
        if not self.fps > 0:
            raise DatasetError(f"{root / fmt.INFO_PATH}: fps must be > 0, got {info['fps']!r}")
        self.features: dict[str, Feature] = {}
        for key, f in raw_features.items():
            if not isinstance(f, dict) or "dtype" not in f or "shape" not in f:
                raise DatasetError(f"{root / fmt.INFO_PATH}: feature {key!r} needs dtype and shape")
            names = f.get("names")
            flat = tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None
            self.features[key] = Feature(key, str(f["dtype"]), tuple(int(x) for x in f["shape"]), flat)
        self.data_path = info.get("data_path") or fmt.DEFAULT_DATA_PATH
        self.video_path = info.get("video_path") or fmt.DEFAULT_VIDEO_PATH
        self.tasks = self._read_tasks()
        self.episodes = self._read_episodes()

    # ------------------------------------------------------------------ metadata
    @property
    def camera_keys(self) -> tuple[str, ...]:
        return tuple(k for k, f in self.features.items() if f.is_camera)

    def _read_tasks(self) -> dict[int, str]:
        path = self.root / fmt.TASKS_PATH
        if not path.is_file():
            raise DatasetError(f"{self.root}: no {fmt.TASKS_PATH}")
        table = pq.read_table(path)
        # pandas writes the task strings as the index: a column named "task", or "__index_level_0__"
        # when the index had no name; the pandas metadata says which.
        pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
        candidates = ["task", *[c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)]]
        name = next((c for c in candidates if c in table.column_names), None)
        if name is None:
            raise DatasetError(f"{path}: no task column (looked for {candidates}); it has {table.column_names}")
        strings = _column(table, name, str(path)).to_pylist()
        indices = _column(table, "task_index", str(path)).to_pylist()
        return {int(i): str(s) for i, s in zip(indices, strings)}

    def _read_episodes(self) -> dict[int, EpisodeMeta]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(f"{self.root}: no episode table under meta/episodes/")
        table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
        where = f"{self.root}/meta/episodes"
        cols = {c: _column(table, c, where).to_pylist() for c in
                (fmt.EP_INDEX, fmt.EP_LENGTH, fmt.EP_TASKS, fmt.EP_DATA_CHUNK, fmt.EP_DATA_FILE, fmt.EP_FROM, fmt.EP_TO)}
        videos = {k: {w: _column(table, fmt.video_column(k, w), where).to_pylist()
                      for w in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")}
                  for k, f in self.features.items() if f.dtype == "video"}
        out = {}
        for r in range(table.num_rows):
            index = int(cols[fmt.EP_INDEX][r])
            segs = {k: VideoSegment(self.root / self.video_path.format(video_key=k, chunk_index=int(v["chunk_index"][r]),
                                                                       file_index=int(v["file_index"][r])),
                                    float(v["from_timestamp"][r]), float(v["to_timestamp"][r]))
                    for k, v in videos.items()}
            data = self.root / self.data_path.format(chunk_index=int(cols[fmt.EP_DATA_CHUNK][r]),
                                                     file_index=int(cols[fmt.EP_DATA_FILE][r]))
            out[index] = EpisodeMeta(index, int(cols[fmt.EP_LENGTH][r]), tuple(cols[fmt.EP_TASKS][r] or ()), data,
                                     int(cols[fmt.EP_FROM][r]), int(cols[fmt.EP_TO][r]), segs)
        return dict(sorted(out.items()))

    def episode(self, index: int) -> EpisodeMeta:
        if index not in self.episodes:
            have = list(self.episodes)
            span = f"{have[0]}-{have[-1]}" if have == list(range(have[0], have[-1] + 1)) else str(have)
            raise DatasetError(f"{self.root}: no episode {index}; the dataset has episodes {span}")
        return self.episodes[index]

    # ------------------------------------------------------------------ frames
    def rows(self, index: int, columns: Sequence[str]) -> pa.Table:
        """The episode's rows (the index columns and ``columns``, video features left out: their
        frames are in the mp4 files), in frame order."""
        ep = self.episode(index)
        if not ep.data_path.is_file():
            raise DatasetError(f"episode {index}: data file {ep.data_path} is missing")
        stored = [c for c in columns if c not in self.features or self.features[c].dtype != "video"]
        wanted = list(dict.fromkeys([*fmt.INDEX_COLUMNS, *stored]))
        schema = pq.read_schema(ep.data_path)
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise DatasetError(f"{ep.data_path} has no column(s) {missing}; it has {schema.names}")
        table = pq.read_table(ep.data_path, columns=wanted, filters=[("episode_index", "=", index)])
        table = table.sort_by("frame_index")
        if table.num_rows != ep.length:
            raise DatasetError(f"episode {index}: {table.num_rows} rows in {ep.data_path}, the episode table says "
                               f"{ep.length}")
        return table

    def vectors(self, table: pa.Table, key: str) -> np.ndarray:
        """A numeric feature of ``rows(...)`` as float64 ``[N, *shape]``."""
        col = table.column(key).combine_chunks()
        values = col
        while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) \
                or pa.types.is_large_list(values.type):
            values = values.flatten()
        arr = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)
        return arr.reshape(table.num_rows, *self.features[key].shape) if key in self.features else arr

    def images(self, index: int, key: str, table: pa.Table, positions: Sequence[int]) -> list[np.ndarray]:
        """Camera ``key``'s frames at row ``positions`` of ``table`` (``rows(index, ...)``), uint8 RGB."""
        feature = self.features[key]
        if feature.dtype == "image":
            cells = table.column(key).take(pa.array(list(positions), pa.int64())).to_pylist()
            return [self._decode_image(cell, key, index, int(p)) for cell, p in zip(cells, positions)]
        seg = self.episode(index).videos[key]
        stamps = np.asarray(table.column("timestamp").to_numpy(), dtype=np.float64)[list(positions)]
        return decode_video_frames(seg.path, seg.from_timestamp + stamps, self.tolerance_s, f"episode {index} {key}")

    def _decode_image(self, cell: object, key: str, index: int, pos: int) -> np.ndarray:
        where = f"episode {index} frame {pos} {key}"
        data = None
        if isinstance(cell, dict):
            data = cell.get("bytes")
            if data is None and cell.get("path"):
                data = (self.root / cell["path"]).read_bytes()
        elif isinstance(cell, (bytes, bytearray)):
            data = cell
        if not data:
            raise DatasetError(f"{where}: no image bytes")
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise DatasetError(f"{where}: the image bytes do not decode")
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def decode_video_frames(path: Path, times: np.ndarray, tolerance_s: float, where: str) -> list[np.ndarray]:
    """The frames of ``path`` shown at ``times`` (seconds in the file), as uint8 RGB.

    Seeks to the keyframe before the first wanted time and decodes forward (AV1 and H.264 frames
    depend on earlier ones, so every frame from there is decoded; only the wanted ones are
    converted). A wanted time no frame lies within ``tolerance_s`` of is an error naming the
    nearest frame: a dataset whose timestamps disagree with its videos must not be read silently
    off by a frame.
    """
    if not path.is_file():
        raise DatasetError(f"{where}: video file {path} is missing")
    times = np.asarray(times, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    wanted = times[order]
    out: list[np.ndarray | None] = [None] * len(times)
    nearest = np.full(len(times), np.inf)
    try:
        container = av.open(str(path))
    except av.error.FFmpegError as e:
        raise DatasetError(f"{where}: cannot open {path}: {e}") from None
    with container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if len(wanted) == 0:
            return []
        container.seek(max(0, int(wanted[0] / stream.time_base)), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            t = frame.time
            if t is None:
                continue
            lo = int(np.searchsorted(wanted, t - tolerance_s, side="left"))
            hi = int(np.searchsorted(wanted, t + tolerance_s, side="right"))
            gap = np.abs(wanted - t)
            closer = gap < nearest
            nearest[closer] = gap[closer]
            if hi > lo:
                rgb = frame.to_ndarray(format="rgb24")
                for j in range(lo, hi):
                    out[order[j]] = rgb
            if t > wanted[-1] + tolerance_s:
                break
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
        i = missing[0]
        raise DatasetError(f"{where}: no frame of {path} within {tolerance_s:g} s of t={times[i]:.6f} s "
                           f"(nearest {nearest[order.tolist().index(i)]:.6f} s away); {len(missing)} frame(s) missing")
    return out  # type: ignore[return-value]
