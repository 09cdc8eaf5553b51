"""Which LeRobot dataset feature feeds which model input (cameras, state) and which is the action.

Why a mapping at all: a checkpoint fine-tuned with LeRobot names its inputs after the dataset's
features (``config.json`` ``input_features`` / ``output_features``), so by default the names
match and nothing needs saying. A checkpoint trained on another dataset, or a robot profile with
its own camera names, needs to say which dataset key plays which part; every key can be
overridden one by one (``--feature MODEL_KEY=DATASET_KEY``).

The mapping is checked against the dataset before anything runs: a feature the dataset lacks, a
camera that is not an image or video, or a state/action whose shape is not the checkpoint's is
refused with the key named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, Sequence

from .lerobot_dataset import DatasetError, LeRobotDatasetReader

STATE = "observation.state"
ACTION = "action"


@dataclass(frozen=True)
class FeatureMap:
    """``cameras`` maps the policy's camera name (model slot order) to a dataset key; ``state``
    and ``action`` are the dataset keys of the joint state and the recorded action."""

    cameras: dict[str, str]
    state: str = STATE
    action: str = ACTION

    def __post_init__(self) -> None:
        if not self.cameras:
            raise ValueError("a feature map needs at least one camera")
        keys = [*self.cameras.values(), self.state, self.action]
        if len(set(keys)) != len(keys):
            raise ValueError(f"each dataset feature may play one part only; got {keys}")

    def with_overrides(self, items: Sequence[str]) -> "FeatureMap":
        """Apply ``MODEL_KEY=DATASET_KEY`` items: a camera name, ``observation.state`` or ``action``."""
        cameras, state, action = dict(self.cameras), self.state, self.action
        for item in items:
            model, sep, key = item.partition("=")
            if not sep or not model or not key:
                raise ValueError(f"--feature expects MODEL_KEY=DATASET_KEY, got {item!r}")
            if model in cameras:
                cameras[model] = key
            elif model == STATE:
                state = key
            elif model == ACTION:
                action = key
            else:
                raise ValueError(f"--feature {item!r}: {model!r} is not a model input; known: "
                                 f"{[*cameras, STATE, ACTION]}")
        return replace(self, cameras=cameras, state=state, action=action)

    def check(self, reader: LeRobotDatasetReader, state_dim: int, action_dim: int) -> None:
        """Refuse a mapping the dataset cannot serve, naming the key."""
        have = sorted(reader.features)
        for name, key in self.cameras.items():
            f = reader.features.get(key)
            if f is None:
                raise DatasetError(f"camera {name!r}: the dataset has no feature {key!r}; it has {have} "
                                   f"(map it with --feature {name}=DATASET_KEY)")
            if not f.is_camera or len(f.shape) != 3 or 3 not in (f.shape[0], f.shape[-1]):
                raise DatasetError(f"camera {name!r}: feature {key!r} is {f.dtype} {list(f.shape)}, not a 3-channel "
                                   f"image or video")
        for part, key, dim in (("state", self.state, state_dim), ("action", self.action, action_dim)):
            f = reader.features.get(key)
            if f is None:
                raise DatasetError(f"{part}: the dataset has no feature {key!r}; it has {have}")
            if f.is_camera or f.shape != (dim,):
                raise DatasetError(f"{part}: feature {key!r} is {f.dtype} {list(f.shape)}, the checkpoint expects "
                                   f"a {dim}-vector")


def checkpoint_features(checkpoint: str | Path) -> FeatureMap:
    """The camera, state and action keys a LeRobot checkpoint's ``config.json`` names, cameras in
    the order of its ``input_features`` (the model's image slot order)."""
    path = Path(checkpoint) / "config.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no {path}: the checkpoint's features cannot be named") from None
    inputs, outputs = meta.get("input_features") or {}, meta.get("output_features") or {}
    cams = {k: k for k, f in inputs.items() if isinstance(f, dict) and f.get("type") == "VISUAL"}
    states = [k for k, f in inputs.items() if isinstance(f, dict) and f.get("type") == "STATE"]
    actions = [k for k, f in outputs.items() if isinstance(f, dict) and f.get("type") == "ACTION"]
    if not cams:
        raise ValueError(f"{path}: input_features names no VISUAL feature")
    return FeatureMap(cameras=cams, state=states[0] if states else STATE, action=actions[0] if actions else ACTION)


class _Named(Protocol):
    name: str


class DatasetKeys(Protocol):
    state: str
    action: str

    def camera_key(self, name: str) -> str: ...


class DatasetProfile(Protocol):
    """What :func:`profile_features` reads off a robot profile (``nodes.profile.RobotProfile``:
    its cameras and its ``dataset`` section). Named here, not imported: ``io`` sits below the
    nodes and does not depend on them."""

    cameras: Sequence[_Named]
    dataset: DatasetKeys


def profile_features(profile: DatasetProfile) -> FeatureMap:
    """The dataset keys a robot profile's ``dataset`` section names, its cameras in profile order."""
    ds = profile.dataset
    return FeatureMap(cameras={c.name: ds.camera_key(c.name) for c in profile.cameras}, state=ds.state,
                      action=ds.action)


def resolve_features(checkpoint: str | Path, profile: DatasetProfile | None = None,
                     overrides: Sequence[str] = ()) -> FeatureMap:
    """The mapping a command uses: the profile's ``dataset`` section when a profile is given,
    else the checkpoint's ``config.json``; then each ``--feature`` override."""
    base = profile_features(profile) if profile is not None else checkpoint_features(checkpoint)
    return base.with_overrides(overrides)
