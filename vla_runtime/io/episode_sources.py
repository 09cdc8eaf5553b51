"""Where episodes come from: rosbag2 bags or the episodes of a LeRobot dataset, behind one interface.

Why: ``build-cache``, ``replay`` and ``bench --cache`` consume :class:`~.bags.Episode` objects
(the sequence of policy calls an episode would have made). An :class:`EpisodeRef` names one
recorded episode and turns it into that sequence on demand, so those pipelines take bags and
dataset episodes alike, and each episode is decoded only when its turn comes.

A dataset episode is sampled with the same causal rule as a bag: a call every ``call_period``
seconds from the first frame, each on the newest frame whose timestamp is at or before the
call time (so ``call_period = 1/fps`` is every frame). A dataset has no outcome: ``success`` is
``None`` (taken as a reference unless excluded by the episode selection). Beside the episode,
:meth:`DatasetRef.read` returns the recorded actions of every frame, which open-loop evaluation
compares the policy's chunks with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from .bags import BagTopics, Episode, EpisodeFrame, read_episode
from .dataset_features import DatasetProfile, FeatureMap, resolve_features
from .lerobot_dataset import DatasetError, LeRobotDatasetReader


class EpisodeRef(Protocol):
    """One recorded episode, not yet read. ``label`` names it in logs and repository ids,
    ``source`` says where it is (recorded with the references)."""

    @property
    def label(self) -> str: ...

    @property
    def source(self) -> str: ...

    def load(self, call_period: float, state_dim: int | None = None) -> Episode: ...


@dataclass(frozen=True)
class BagRef:
    path: Path
    topics: BagTopics

    @property
    def label(self) -> str:
        return Path(self.path).name

    @property
    def source(self) -> str:
        return str(self.path)

    def load(self, call_period: float, state_dim: int | None = None) -> Episode:
        return read_episode(self.path, self.topics, call_period, state_dim=state_dim)


def bag_refs(paths: Sequence[Path], topics: BagTopics) -> list[BagRef]:
    return [BagRef(Path(p), topics) for p in paths]


@dataclass
class DatasetCalls:
    """A dataset episode as policy calls, with what was recorded around them.

    ``actions`` is the recorded action of *every* frame ``[N, A]`` (robot units) and
    ``call_frames[i]`` the frame call ``i`` saw, so the chunk of call ``i`` lines up with
    ``actions[call_frames[i]:]`` at the dataset's ``fps``."""

    episode: Episode
    actions: np.ndarray
    call_frames: np.ndarray
    fps: float


@dataclass(frozen=True)
class DatasetRef:
    reader: LeRobotDatasetReader
    index: int
    features: FeatureMap

    @property
    def label(self) -> str:
        return f"episode_{self.index:06d}"

    @property
    def source(self) -> str:
        return f"{self.reader.root}#episode={self.index}"

    def load(self, call_period: float, state_dim: int | None = None) -> Episode:
        return self.read(call_period).episode

    def read(self, call_period: float) -> DatasetCalls:
        if not (isinstance(call_period, (int, float)) and math.isfinite(call_period) and call_period > 0):
            raise ValueError(f"call_period must be a positive number of seconds, got {call_period!r}")
        r, fm = self.reader, self.features
        table = r.rows(self.index, [*fm.cameras.values(), fm.state, fm.action])
        stamps = np.asarray(table.column("timestamp").to_numpy(), dtype=np.float64)
        if np.any(np.diff(stamps) <= 0) or not np.all(np.isfinite(stamps)):
            raise DatasetError(f"{self.source}: frame timestamps must increase")
        rel = stamps - stamps[0]
        # k * period vs timestamps stored as float32: half the decoder's tolerance absorbs the rounding,
        # far below a frame period, so a frame stamped at a call time counts as already there.
        slack = r.tolerance_s / 2
        calls = np.arange(int(math.floor((rel[-1] + slack) / call_period)) + 1) * call_period
        frames = np.searchsorted(rel, calls + slack, side="right") - 1
        states = r.vectors(table, fm.state)
        actions = r.vectors(table, fm.action)
        for part, values in (("state", states), ("action", actions)):
            bad = np.argwhere(~np.isfinite(values))
            if bad.size:
                raise DatasetError(f"{self.source}: {part} {fm.state if part == 'state' else fm.action!r} is not "
                                   f"finite at frame {int(bad[0][0])}")
        task_idx = table.column("task_index").to_numpy()
        unknown = sorted({int(t) for t in task_idx} - set(r.tasks))
        if unknown:
            raise DatasetError(f"{self.source}: task_index {unknown} not in meta/tasks.parquet")
        unique = sorted(set(frames.tolist()))
        images = {name: dict(zip(unique, r.images(self.index, key, table, unique)))
                  for name, key in fm.cameras.items()}
        task = r.tasks[int(task_idx[frames[0]])]
        out = []
        for t, f in zip(calls, frames):
            text = r.tasks[int(task_idx[f])]
            out.append(EpisodeFrame(t=float(t), images={n: images[n][f] for n in fm.cameras},
                                    state=states[f].astype(np.float32), instruction=None if text == task else text))
        episode = Episode(episode_id=self.label, task=task, success=None, frames=out, source=self.source)
        return DatasetCalls(episode, actions, frames.astype(np.int64), r.fps)


def parse_episode_selection(text: str | None, available: Sequence[int]) -> list[int]:
    """``"0-49"``, ``"3,7,10-12"`` or ``None`` (all) into episode indices, each one checked."""
    have = list(available)
    if text is None or not text.strip():
        return have
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise ValueError(f"--episodes expects indices and ranges like 0-49,60, got {text!r}") from None
        if lo > hi:
            raise ValueError(f"--episodes: empty range {part.strip()!r}")
        out.extend(range(lo, hi + 1))
    missing = sorted(set(out) - set(have))
    if missing:
        span = f"{have[0]}-{have[-1]}" if have else "none"
        raise ValueError(f"--episodes: the dataset has no episode(s) {missing[:10]}{' ...' if len(missing) > 10 else ''}"
                         f" (it has {len(have)}: {span})")
    return list(dict.fromkeys(out))


def dataset_refs(reader: LeRobotDatasetReader, features: FeatureMap, episodes: str | None = None) -> list[DatasetRef]:
    return [DatasetRef(reader, i, features) for i in parse_episode_selection(episodes, list(reader.episodes))]


def open_dataset(root: str | Path, checkpoint: str | Path, profile: DatasetProfile | None = None,
                 overrides: Sequence[str] = (), episodes: str | None = None, log=lambda m: None):
    """The policy and the selected episodes of a dataset, the features mapped (the profile's
    ``dataset`` section or the checkpoint's ``config.json``, then ``overrides``) and checked
    against the dataset and the checkpoint's state/action sizes before anything runs."""
    from ..engine.policy import Pi05Policy

    reader = LeRobotDatasetReader(root)
    features = resolve_features(checkpoint, profile, overrides)
    policy = Pi05Policy.from_checkpoint(checkpoint, camera_names=list(features.cameras))
    features.check(reader, policy.state_dim, policy.action_norm.dim)
    refs = dataset_refs(reader, features, episodes)
    log(f"dataset {root}: {len(refs)} of {len(reader.episodes)} episode(s) at {reader.fps:g} fps; cameras "
        f"{features.cameras}, state {features.state!r}, action {features.action!r}")
    return policy, refs
