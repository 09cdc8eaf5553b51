"""A small two-joint streaming controller the tests drive tick by tick (limits +-1, 50 Hz)."""

from __future__ import annotations

import numpy as np

from ..engine.controller import ControllerConfig, StreamingController
from ..engine.safety import JointLimits
from ..engine.stitching import StitchConfig


def small_controller(**over) -> StreamingController:
    cfg = ControllerConfig(control_hz=50.0, chunk_size=10, action_dim=2, stitch=StitchConfig(mode="replace"),
                           initial_latency_s=0.04, watchdog_s=1.0, **over)
    c = StreamingController(cfg, JointLimits(np.array([-1.0, -1.0]), np.array([1.0, 1.0])))
    c.set_initial(np.zeros(2))
    return c
