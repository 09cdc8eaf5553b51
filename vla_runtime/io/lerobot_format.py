"""The on-disk layout of a LeRobot dataset, codebase version v3.0 (what LeRobot 0.6.x writes).

Shared by the reader and the writer so both sides agree on one set of names::

    meta/info.json                      codebase_version, fps, features, chunks_size, path templates
    meta/tasks.parquet                  one row per task: the task string and its task_index
    meta/episodes/chunk-XXX/file-YYY.parquet
                                        one row per episode: length, tasks, where its rows and
                                        video segments are (index range, file, from/to timestamp)
    data/chunk-XXX/file-YYY.parquet     one row per frame: timestamp, frame_index, episode_index,
                                        index, task_index, numeric features, inline images
    videos/<camera key>/chunk-XXX/file-YYY.mp4
                                        several episodes' frames back to back in one stream

Only the names live here; nothing is read or written.
"""

from __future__ import annotations

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"

#: Per-frame bookkeeping columns every v3.0 data file has, besides the features proper.
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")

#: Episode-table columns (``videos/<key>/...`` ones are per video feature).
EP_INDEX = "episode_index"
EP_LENGTH = "length"
EP_TASKS = "tasks"
EP_DATA_CHUNK = "data/chunk_index"
EP_DATA_FILE = "data/file_index"
EP_FROM = "dataset_from_index"
EP_TO = "dataset_to_index"


def video_column(key: str, what: str) -> str:
    """The episode-table column of camera ``key``: chunk_index, file_index, from_timestamp or
    to_timestamp."""
    return f"videos/{key}/{what}"


#: PyAV encoder per codec name written into ``info.json`` (``video.codec``). ``av1`` is LeRobot's
#: default (SVT-AV1); ``h264`` is what most other tools write.
ENCODERS = {"av1": "libsvtav1", "h264": "libx264"}
