"""gym-aloha (bimanual ViperX, MuJoCo) as a closed-loop harness for the ALOHA profile.

Why not the gym wrapper as it is: its task renders three 480x640 images at *every* 50 Hz
physics step (about 0.2 s a step on this CPU), while a policy looks at the cameras only at its
call points. The harness keeps gym-aloha's physics, tasks, seeding and success signal, replaces
the per-step observation with the joint positions only, and renders the cameras it is asked for
when :meth:`AlohaTask.render` is called, at the policy's image size (supersampled, box-averaged).

Units are gym-aloha's, which are the ALOHA profile's: 14 joint positions (rad) in the profile's
order, grippers normalised 0 (closed) .. 1 (open); actions are joint position targets.
Success is gym-aloha's: the task's top reward (4).

The simulator's cameras are named ``top``, ``angle``, ``left_wrist``, ``right_wrist``, ...;
``cameras`` maps the profile's camera names to them (``cam_high`` -> ``top`` by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MUJOCO_GL", "egl")   # headless; must be set before dm_control loads a GL backend

import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from ..nodes.profile import RobotProfile

TASKS = ("transfer_cube", "insertion")
INSTRUCTIONS = {"transfer_cube": "pick up the cube with the right arm and hand it over to the left arm",
                "insertion": "insert the peg into the socket"}
SUCCESS_REWARD = 4
CONTROL_DT = 0.02          # gym-aloha steps at 50 Hz, the ALOHA profile's control rate
STATE_DIM = 14
DEFAULT_CAMERAS = {"cam_high": "top", "cam_left_wrist": "left_wrist", "cam_right_wrist": "right_wrist"}
DEFAULT_PROFILE = Path("config/aloha.yaml")     # the ALOHA profile, from the repository root, as `run` reads config/sim.yaml


def check_profile(profile: "RobotProfile", cameras: dict[str, str]) -> None:
    """The harness speaks the profile's language: its 14 joints and its camera names."""
    if len(profile.joint_names) != STATE_DIM:
        raise ValueError(f"profile {profile.name!r} has {len(profile.joint_names)} joints; gym-aloha has {STATE_DIM}")
    if abs(profile.control_hz * CONTROL_DT - 1.0) > 1e-6:
        raise ValueError(f"profile {profile.name!r} runs at {profile.control_hz} Hz; gym-aloha steps at {1 / CONTROL_DT} Hz")
    names = [c.name for c in profile.cameras]
    if sorted(names) != sorted(cameras):
        raise ValueError(f"profile cameras {names} but the harness maps {sorted(cameras)}")


@dataclass(frozen=True)
class AlohaSimConfig:
    task: str = "transfer_cube"
    cameras: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_CAMERAS))   # profile name -> sim camera
    image_size: int = 224
    render_scale: int = 1          # render at image_size * render_scale, box-average down
    max_steps: int = 400           # gym-aloha's episodes are 400 steps (8 s)

    def validate(self) -> "AlohaSimConfig":
        if self.task not in TASKS:
            raise ValueError(f"unknown gym-aloha task {self.task!r}; choose from {TASKS}")
        if not self.cameras:
            raise ValueError("at least one camera is needed")
        if self.image_size < 8 or self.render_scale < 1 or self.max_steps < 1:
            raise ValueError("image_size >= 8, render_scale >= 1 and max_steps >= 1")
        return self

    @property
    def instruction(self) -> str:
        return INSTRUCTIONS[self.task]


@dataclass(frozen=True)
class AlohaStep:
    state: np.ndarray      # [14] joint positions after the step
    reward: int
    success: bool
    done: bool


class AlohaTask:
    """One gym-aloha task: reset to a seeded object pose, step joint targets, render on demand."""

    def __init__(self, cfg: AlohaSimConfig):
        self.cfg = cfg.validate()
        try:
            from gym_aloha.env import AlohaEnv
        except ImportError as e:   # an optional extra: say how to get it
            raise ImportError("gym-aloha is not installed: `make setup` installs it "
                              "(requirements-sim.txt: gym-aloha, dm-control)") from e
        self._gym = AlohaEnv(cfg.task, obs_type="pixels_agent_pos")
        self._env = self._gym._env                    # dm_control Environment: physics + task
        task = self._env.task
        # Joint positions only at each step; the cameras are rendered by render() when asked.
        task.get_observation = lambda physics: {"qpos": task.get_qpos(physics)}
        names = set(self._camera_names())
        unknown = sorted(set(cfg.cameras.values()) - names)
        if unknown:
            raise ValueError(f"gym-aloha has no camera {unknown}; it has {sorted(names)}")
        self.steps = 0
        self.max_reward = 0
        self._state: np.ndarray | None = None

    def _camera_names(self) -> list[str]:
        model = self._env.physics.model
        return [model.id2name(i, "camera") for i in range(model.ncam)]

    @property
    def instruction(self) -> str:
        return self.cfg.instruction

    def reset(self, seed: int) -> np.ndarray:
        """The object pose drawn from ``seed`` (gym-aloha's own sampler), the arms at home."""
        from gym_aloha.tasks.sim import BOX_POSE
        from gym_aloha.utils import sample_box_pose, sample_insertion_pose

        self._env.task.random.seed(seed)
        self._env.task._random = np.random.RandomState(seed)
        # gym-aloha's tasks read the object pose from this module-level list at reset
        BOX_POSE[0] = (sample_box_pose(seed) if self.cfg.task == "transfer_cube"
                       else np.concatenate(sample_insertion_pose(seed)))
        ts = self._env.reset()
        self.steps, self.max_reward = 0, 0
        self._state = np.asarray(ts.observation["qpos"], np.float64)
        return self.state()

    def state(self) -> np.ndarray:
        assert self._state is not None, "call reset() first"
        return self._state.astype(np.float32)

    @property
    def physics(self) -> Any:
        """dm_control's physics (MuJoCo model and data): for a scripted expert, never the policy."""
        return self._env.physics

    def object_position(self) -> np.ndarray:
        """World position of the task's object (the cube; the peg for insertion), privileged."""
        return np.array(self._env.physics.named.data.qpos[16:19], np.float64)

    def step(self, action: np.ndarray) -> AlohaStep:
        a = np.asarray(action, np.float64)
        if a.shape != (STATE_DIM,) or not np.isfinite(a).all():
            raise ValueError(f"an ALOHA action is 14 finite joint targets, got shape {a.shape}")
        ts = self._env.step(a)
        self.steps += 1
        self._state = np.asarray(ts.observation["qpos"], np.float64)
        reward = int(ts.reward or 0)
        self.max_reward = max(self.max_reward, reward)
        success = reward >= SUCCESS_REWARD
        return AlohaStep(self.state(), reward, success, success or self.steps >= self.cfg.max_steps)

    def render(self) -> dict[str, np.ndarray]:
        """Every configured camera as uint8 RGB [S, S, 3], keyed by the profile's camera names."""
        s, k = self.cfg.image_size, self.cfg.render_scale
        out: dict[str, np.ndarray] = {}
        for name, cam in self.cfg.cameras.items():
            img = self._env.physics.render(height=s * k, width=s * k, camera_id=cam)
            if k > 1:
                img = img.reshape(s, k, s, k, 3).mean(axis=(1, 3)).round().astype(np.uint8)
            out[name] = np.ascontiguousarray(img, dtype=np.uint8)
        return out

    def close(self) -> None:
        self._gym.close()

    def __enter__(self) -> "AlohaTask":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
