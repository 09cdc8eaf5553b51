"""A small LeRobot v3.0 dataset and a matching checkpoint for tests, from synthetic scenes.

Three episodes of two tasks (the synthetic scenes of :mod:`vla_runtime.sim.scenes`), three
cameras: ``observation.images.cam0`` and ``cam2`` as mp4 video, ``cam1`` inline PNG, so the
reader's video path, its inline-image path and a camera the model does not use are all
exercised. Episodes 0 and 1 share a data file and video file (the concatenated case), episode 2
is in the next files. The recorded action of frame ``i`` is the state of frame ``i + 1`` (the
commanded next position, the last one repeated), so an open-loop check has real targets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io.lerobot_writer import DatasetEpisodeData, WriterConfig, write_lerobot_dataset
from ..sim.scenes import SceneConfig, make_episode

TASKS = ("pick up the red block and put it in the bowl", "push the blue cube to the left")
CAMERAS = ("observation.images.cam0", "observation.images.cam1", "observation.images.cam2")
VIDEO_CAMERAS = ("observation.images.cam0", "observation.images.cam2")
SCENE_CAMERAS = ("top", "wrist", "wrist_left")
FPS = 10
IMAGE_SIZE = 56   # pi05-tiny's input size: no resizing between the dataset and the model


def synthetic_episodes(steps: int = 20, image_size: int = IMAGE_SIZE) -> list[DatasetEpisodeData]:
    """Episodes 0 and 2 do task 0, episode 1 task 1."""
    out = []
    for e, task in enumerate((TASKS[0], TASKS[1], TASKS[0])):
        scene = SceneConfig(image_size=image_size, cameras=SCENE_CAMERAS, task=task, steps_per_episode=steps,
                            seed=3)
        ep = make_episode(scene, episode_seed=e)
        states = np.stack([f.state for f in ep.frames])
        actions = np.concatenate([states[1:], states[-1:]])
        images = {key: np.stack([f.images[cam] for f in ep.frames]) for key, cam in zip(CAMERAS, SCENE_CAMERAS)}
        out.append(DatasetEpisodeData(task=task, state=states, action=actions, images=images))
    return out


def write_test_dataset(root: str | Path, codec: str = "h264", episodes: list[DatasetEpisodeData] | None = None) -> Path:
    episodes = synthetic_episodes() if episodes is None else episodes
    return write_lerobot_dataset(root, episodes, WriterConfig(fps=FPS, video_keys=VIDEO_CAMERAS, codec=codec,
                                                              episodes_per_file=2, robot_type="sim"))


def write_test_checkpoint(path: str | Path, episodes: list[DatasetEpisodeData], preset_name: str = "pi05-tiny") -> Path:
    """A random-weight checkpoint whose ``config.json`` names ``observation.images.cam0``/``cam1``
    (the first two cameras of the dataset), with the dataset's state/action statistics."""
    from ..models.config import preset
    from ..commands.demo import write_random_checkpoint

    path = Path(path)
    states = np.concatenate([ep.state for ep in episodes])
    actions = np.concatenate([ep.action for ep in episodes])
    write_random_checkpoint(path, preset(preset_name), list(TASKS), states, actions, ("cam0", "cam1"))
    return path
