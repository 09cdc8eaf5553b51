"""Boundary conversions: bad messages become InputError diagnostics, good ones exact arrays
(images and joint states: test/io/test_messages.py)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from vla_runtime.io.messages import InputError, JointStateAssembler
from vla_runtime.nodes.conversions import chunk_to_trajectory, implausible_joints, points_passed


def _traj_factories():
    make_traj = lambda: NS(header=NS(stamp=None, frame_id=None), joint_names=None, points=None)  # noqa: E731
    return dict(make_trajectory=make_traj, make_point=lambda: NS(positions=None, time_from_start=None),
                make_duration=lambda s, ns: (s, ns), make_time=lambda s, ns: (s, ns))


def test_chunk_to_trajectory_stamps_and_refuses_nan():
    chunk = np.array([[0.0, 1.0], [0.5, 1.5], [1.0, 2.0]])
    t = chunk_to_trajectory(chunk, ["j1", "j2"], first_action_time_ns=12_500_000_000, period_s=0.02, **_traj_factories())
    assert t.header.stamp == (12, 500_000_000) and t.joint_names == ["j1", "j2"]
    assert [p.time_from_start for p in t.points] == [(0, 0), (0, 20_000_000), (0, 40_000_000)]
    assert t.points[1].positions == [0.5, 1.5]
    with pytest.raises(InputError, match="NaN"):
        chunk_to_trajectory(np.array([[np.nan, 0.0]]), ["j1", "j2"], 0, 0.02, **_traj_factories())
    with pytest.raises(InputError, match=r"chunk must be \[C, 2\]"):
        chunk_to_trajectory(np.zeros((3, 3)), ["j1", "j2"], 0, 0.02, **_traj_factories())


def test_trajectory_times_strictly_increase_and_it_never_starts_in_the_past():
    """What joint_trajectory_controller checks: time_from_start strictly increasing, and a header
    stamp not in the past (``points_passed`` drops the points already due when it is published)."""
    t = chunk_to_trajectory(np.zeros((5, 2)), ["j1", "j2"], first_action_time_ns=10**9, period_s=0.02,
                            **_traj_factories())
    times = [s * 10**9 + ns for s, ns in (p.time_from_start for p in t.points)]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert not any(getattr(p, "velocities", None) for p in t.points)   # positions only: no final velocity to zero
    period = 20_000_000
    assert points_passed(10**9, 0.02, 10**9 - 1, 5) == 0            # first point still ahead
    assert points_passed(10**9, 0.02, 10**9 + 1, 5) == 1            # point 0 just passed: start at point 1
    assert points_passed(10**9, 0.02, 10**9 + 2 * period, 5) == 2   # point 2 due now: kept (not in the past)
    assert points_passed(10**9, 0.02, 10**9 + 10 * period, 5) == 5


def test_implausible_joint_positions_are_named():
    j = JointStateAssembler(["a", "b", "c"])
    j.update(NS(name=["a", "b"], position=[100.0, 1.4]), 1)     # c not yet seen: not judged
    far = implausible_joints(j, [-1.0, -1.0, 0.0], [1.0, 1.0, 0.08])
    assert far == ["a = 100 (limits [-1, 1])"]                 # b: past its limit by less than half the range
