"""LeRobot v3.0 datasets: a dataset written here (pyarrow + PyAV) read back frame for frame, and
every refusal of the reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vla_runtime.io.lerobot_dataset import DatasetError, LeRobotDatasetReader
from vla_runtime.io.lerobot_writer import DatasetEpisodeData, WriterConfig, write_lerobot_dataset

FPS = 10
H, W = 48, 64
VIDEO = ("observation.images.top", "observation.images.wrist")
INLINE = "observation.images.side"
TASKS = ("pick the cube", "place the cube")
LENGTHS = (12, 9, 15)
#: Consecutive frames of one camera differ by 8 levels in R and B everywhere (see _frames), so
#: a reader one frame off is off by ~5 levels on average; the codec tolerance below is 3.
FRAME_STEP = 8
#: Mean |decoded - source| per frame a correct video read stays within, in 8-bit levels:
#: (a) RGB -> 8-bit YUV -> RGB rounding moves a channel by at most ~1 level; (b) 4:2:0 chroma
#: averages 2x2 blocks of a gradient of <= 3 levels/pixel, <= ~1.5 levels; (c) crf 18 (the
#: writer's default) keeps PSNR above ~45 dB on smooth content, RMS below ~1.5 levels. They do
#: not all peak on one pixel; the worst measured frame means are 1.7 (H.264) and 2.3 (AV1),
#: while every other frame of the episode is >= 4.4 away.
VIDEO_MEAN_TOL = 3.0


def _frames(n: int, seed: int) -> np.ndarray:
    """Smooth gradients whose level moves by FRAME_STEP per frame: codec-friendly, each frame
    distinct from its neighbours. Levels fold back at 255 (a triangle wave) instead of wrapping,
    which would put a sharp 255 -> 0 edge into the picture."""
    yy, xx = np.mgrid[0:H, 0:W]

    def fold(v: np.ndarray) -> np.ndarray:
        return np.abs((v + 255) % 510 - 255)

    out = []
    for k in range(n):
        r = xx * 2 + FRAME_STEP * k + 7 * seed
        g = yy * 3 + 40 + 3 * seed
        b = np.full_like(xx, 60 + FRAME_STEP * k)
        out.append(fold(np.stack([r, g, b], -1)))
    return np.stack(out).astype(np.uint8)


def _episodes() -> list[DatasetEpisodeData]:
    eps = []
    for e, n in enumerate(LENGTHS):
        rng = np.random.default_rng(e)
        tasks = None
        if e == 2:  # the instruction changes within the episode
            tasks = [TASKS[0]] * 5 + [TASKS[1]] * (n - 5)
        eps.append(DatasetEpisodeData(task=TASKS[e % 2], state=rng.normal(size=(n, 6)), action=rng.normal(size=(n, 6)),
                                      images={VIDEO[0]: _frames(n, e), VIDEO[1]: _frames(n, e + 10),
                                              INLINE: _frames(n, e + 20)}, frame_tasks=tasks))
    return eps


@pytest.fixture(scope="module")
def episodes() -> list[DatasetEpisodeData]:
    return _episodes()


@pytest.fixture(scope="module", params=["h264", "av1"])
def dataset(request, tmp_path_factory, episodes) -> Path:
    root = tmp_path_factory.mktemp(f"ds_{request.param}") / "ds"
    return write_lerobot_dataset(root, episodes, WriterConfig(fps=FPS, video_keys=VIDEO, codec=request.param,
                                                              episodes_per_file=2))


def test_metadata(dataset, episodes):
    r = LeRobotDatasetReader(dataset)
    assert r.fps == FPS and sorted(r.tasks.values()) == sorted(TASKS)
    assert set(r.camera_keys) == {*VIDEO, INLINE}
    assert r.features[VIDEO[0]].dtype == "video" and r.features[INLINE].dtype == "image"
    assert r.features["observation.state"].shape == (6,)
    assert [m.length for m in r.episodes.values()] == list(LENGTHS)
    assert r.episodes[2].tasks == TASKS
    # episodes 0 and 1 share a data and a video file (back to back), episode 2 has the next ones
    m0, m1, m2 = r.episodes[0], r.episodes[1], r.episodes[2]
    assert m0.data_path == m1.data_path != m2.data_path
    assert m1.videos[VIDEO[0]].path == m0.videos[VIDEO[0]].path
    assert m1.videos[VIDEO[0]].from_timestamp == pytest.approx(LENGTHS[0] / FPS)
    assert (m0.from_index, m1.from_index, m2.from_index) == (0, LENGTHS[0], LENGTHS[0] + LENGTHS[1])


def test_frame_for_frame(dataset, episodes):
    r = LeRobotDatasetReader(dataset)
    for e, ep in enumerate(episodes):
        table = r.rows(e, ["observation.state", "action", INLINE])
        stamps = table.column("timestamp").to_numpy()
        np.testing.assert_allclose(stamps, np.arange(ep.length) / FPS, atol=1e-6)   # float32 storage
        assert table.column("frame_index").to_pylist() == list(range(ep.length))
        # float32 is the stored dtype: exact after casting the source the same way
        np.testing.assert_array_equal(r.vectors(table, "observation.state"), ep.state.astype(np.float32))
        np.testing.assert_array_equal(r.vectors(table, "action"), ep.action.astype(np.float32))
        assert [r.tasks[i] for i in table.column("task_index").to_pylist()] == ep.tasks_by_frame()
        every = list(range(ep.length))
        inline = r.images(e, INLINE, table, every)
        for k in every:  # PNG is lossless
            np.testing.assert_array_equal(inline[k], ep.images[INLINE][k])
        for key in VIDEO:
            decoded = r.images(e, key, table, every)
            src = ep.images[key].astype(np.float64)
            for k, img in enumerate(decoded):
                assert img.shape == (H, W, 3) and img.dtype == np.uint8
                errs = np.abs(img.astype(np.float64)[None] - src).mean(axis=(1, 2, 3))
                assert errs[k] <= VIDEO_MEAN_TOL, (e, key, k, errs[k])
                assert int(np.argmin(errs)) == k, (e, key, k, errs)     # its own frame, not a neighbour
        # a subset, out of order, decodes to the same frames as the full pass
        some = [7, 2, 2, 0]
        for k, img in zip(some, r.images(e, VIDEO[1], table, some)):
            np.testing.assert_array_equal(img, r.images(e, VIDEO[1], table, every)[k])


# ------------------------------------------------------------------------------------ refusals
@pytest.fixture()
def copy(tmp_path, episodes) -> Path:
    return write_lerobot_dataset(tmp_path / "ds", episodes, WriterConfig(fps=FPS, video_keys=VIDEO,
                                                                         episodes_per_file=2))


def _edit_info(root: Path, **changes) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("version", ["v2.1", "v2.0", None])
def test_other_versions_refused(copy, version):
    _edit_info(copy, codebase_version=version)
    with pytest.raises(DatasetError, match=f"codebase version {version!r} is not supported; only v3.0"):
        LeRobotDatasetReader(copy)


def test_not_a_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="only local directories"):
        LeRobotDatasetReader("lerobot/aloha_sim_transfer_cube_human")   # a hub id: nothing is downloaded
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no meta/info.json"):
        LeRobotDatasetReader(tmp_path / "empty")


def test_missing_tables_refused(copy):
    shutil.rmtree(copy / "meta" / "episodes")
    with pytest.raises(DatasetError, match="no episode table"):
        LeRobotDatasetReader(copy)


def test_unknown_episode_refused(copy):
    with pytest.raises(DatasetError, match=r"no episode 7; the dataset has episodes 0-2"):
        LeRobotDatasetReader(copy).episode(7)


def test_missing_video_refused(copy):
    r = LeRobotDatasetReader(copy)
    r.episodes[2].videos[VIDEO[0]].path.unlink()
    table = r.rows(2, [])
    with pytest.raises(DatasetError, match="video file .* is missing"):
        r.images(2, VIDEO[0], table, [0])


def test_timestamps_off_the_video_refused(copy):
    """Timestamps that no longer match the video's frames (shifted by half a frame) are an error,
    not a silent read of the nearest frame."""
    path = copy / "data" / "chunk-000" / "file-001.parquet"
    t = pq.read_table(path)
    shifted = pa.array(t.column("timestamp").to_numpy() + np.float32(0.5 / FPS), pa.float32())
    pq.write_table(t.set_column(t.schema.get_field_index("timestamp"), "timestamp", shifted), path)
    r = LeRobotDatasetReader(copy)
    with pytest.raises(DatasetError, match=r"episode 2 observation.images.top: no frame .* within 0.0001 s"):
        r.images(2, VIDEO[0], r.rows(2, []), [3])


def test_row_count_mismatch_refused(copy):
    path = copy / "data" / "chunk-000" / "file-001.parquet"
    t = pq.read_table(path)
    pq.write_table(t.slice(0, 10), path)
    with pytest.raises(DatasetError, match="episode 2: 10 rows .* the episode table says 15"):
        LeRobotDatasetReader(copy).rows(2, [])


def test_missing_column_refused(copy):
    r = LeRobotDatasetReader(copy)
    with pytest.raises(DatasetError, match=r"has no column\(s\) \['observation.velocity'\]"):
        r.rows(0, ["observation.velocity"])


def test_pandas_style_tasks_table(copy):
    """pandas (what LeRobot uses) writes the task strings as an unnamed index column."""
    meta = {"index_columns": ["__index_level_0__"], "columns": []}
    table = pa.table({"task_index": pa.array([0, 1], pa.int64()), "__index_level_0__": list(TASKS)})
    table = table.replace_schema_metadata({b"pandas": json.dumps(meta).encode()})
    pq.write_table(table, copy / "meta" / "tasks.parquet")
    assert LeRobotDatasetReader(copy).tasks == {0: TASKS[0], 1: TASKS[1]}


def test_writing_av1_leaves_the_scheduling_policy_as_it_was(tmp_path, episodes):
    """PyAV's SVT-AV1 encoder switches the thread that drives it to SCHED_FIFO 99 (as root); the
    writer puts the policy back, or every process started afterwards would run real-time."""
    import os

    before = os.sched_getscheduler(0), os.sched_getparam(0)
    write_lerobot_dataset(tmp_path / "ds", episodes[:1], WriterConfig(fps=FPS, video_keys=VIDEO, codec="av1"))
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
