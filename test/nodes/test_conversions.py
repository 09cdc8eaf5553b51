"""Boundary conversions: bad messages become InputError diagnostics, good ones exact arrays."""

from __future__ import annotations

from types import SimpleNamespace as NS

import cv2
import numpy as np
import pytest

from vla_runtime.nodes.conversions import (InputError, JointStateAssembler, chunk_to_trajectory, image_from_msg,
                                          implausible_joints, points_passed)


def _image(h=4, w=5, enc="rgb8", data=None):
    ch = {"rgb8": 3, "bgr8": 3, "mono8": 1}.get(enc, 3)
    arr = np.arange(h * w * ch, dtype=np.uint8).reshape(h, w * ch)
    return NS(height=h, width=w, encoding=enc, step=w * ch, data=arr.tobytes() if data is None else data)


def test_images_decode_and_bad_ones_are_diagnosed():
    rgb = image_from_msg(_image(), compressed=False, camera="top")
    assert rgb.shape == (4, 5, 3) and rgb.dtype == np.uint8
    bgr = image_from_msg(_image(enc="bgr8"), compressed=False, camera="top")
    np.testing.assert_array_equal(bgr, rgb[..., ::-1])
    ok, png = cv2.imencode(".png", np.zeros((6, 7, 3), np.uint8))
    assert image_from_msg(NS(format="png", data=png.tobytes()), compressed=True, camera="wrist").shape == (6, 7, 3)
    for msg, compressed, what in [(_image(enc="yuv422"), False, "unsupported Image encoding"),
                                  (_image(data=b"\x00" * 3), False, "inconsistent"),
                                  (NS(format="jpeg", data=b"not a jpeg"), True, "could not decode"),
                                  (NS(format="jpeg", data=b""), True, "no data")]:
        with pytest.raises(InputError, match=f"camera 'top': .*{what}"):
            image_from_msg(msg, compressed, camera="top")


def test_joint_states_assemble_in_profile_order():
    js = JointStateAssembler(["a1", "a2", "b1"])
    assert not js.complete()
    with pytest.raises(InputError, match=r"no joint state received yet for \['a1', 'a2', 'b1'\]"):
        js.vector()
    js.update(NS(name=["a2", "a1", "extra"], position=[2.0, 1.0, 9.0]), stamp_ns=5)
    js.update(NS(name=["b1"], position=[3.0]), stamp_ns=7)
    np.testing.assert_array_equal(js.vector(), [1.0, 2.0, 3.0])
    assert js.oldest_stamp_ns() == 5
    with pytest.raises(InputError, match="non-finite"):
        js.update(NS(name=["a1"], position=[float("nan")]), stamp_ns=8)
    with pytest.raises(InputError, match="2 names but 1 positions"):
        js.update(NS(name=["a1", "a2"], position=[0.0]), stamp_ns=8)
    with pytest.raises(InputError, match="match none"):
        js.update(NS(name=["zz"], position=[0.0]), stamp_ns=8)
    np.testing.assert_array_equal(js.vector(), [1.0, 2.0, 3.0])   # refused messages changed nothing


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
