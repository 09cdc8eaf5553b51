"""The policy node's per-tick logic, driven tick by tick without ROS."""

from __future__ import annotations

import numpy as np

from vla_runtime.testing.controllers import small_controller




def test_request_merge_execute_cycle():
    c = small_controller()
    assert c.tick(0).status == "held"                       # nothing planned yet
    req = c.maybe_request(0, np.array([0.1, 0.2]), obs_age_s=0.0)
    assert req is not None and req.request_seq == 0 and req.start_tick == 2
    np.testing.assert_array_equal(req.state, [0.1, 0.2])      # nothing planned: the observed state
    assert c.maybe_request(1, np.zeros(2), 0.0) is None       # one call in flight at most
    chunk = np.linspace(0, 0.9, 20).reshape(10, 2)
    assert not c.on_chunk(5, chunk, now=2, latency_s=0.04)    # unknown call: ignored
    assert c.on_chunk(0, chunk, now=2, latency_s=0.04)
    cmd = c.tick(2)
    np.testing.assert_allclose(cmd.action, chunk[0])
    assert cmd.status == "ok"
    first, upcoming = c.upcoming(3)
    assert first == 3 and upcoming.shape == (9, 2)
    np.testing.assert_allclose(upcoming[0], chunk[1])
    nxt = c.maybe_request(3, np.zeros(2), 0.0)                # continuous re-planning: the next call starts
    assert nxt is not None and nxt.request_seq == 1
    np.testing.assert_allclose(nxt.state, chunk[nxt.start_tick - 2 - 1])   # predicted, not observed


def test_stale_observations_and_limits():
    c = small_controller()
    assert c.maybe_request(0, np.zeros(2), obs_age_s=5.0) is None     # too old: no call
    req = c.maybe_request(1, np.zeros(2), obs_age_s=0.0)
    c.on_chunk(req.request_seq, np.full((10, 2), 7.0), now=3, latency_s=0.04)
    np.testing.assert_array_equal(c.tick(3).action, [1.0, 1.0])       # clamped to the joint limit
    c.abandon(4)
    assert c.in_flight is None
