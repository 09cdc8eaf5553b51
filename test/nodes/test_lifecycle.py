"""What the managed nodes decide without ROS (vla_runtime/nodes/lifecycle.py): where a
deactivated policy holds the robot, which peer is reported silent, and the warm-up a configure
runs (stages.py), which must leave the rings untouched."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from vla_runtime.engine.controller import ControllerConfig, StreamingController
from vla_runtime.engine.safety import JointLimits
from vla_runtime.nodes.lifecycle import PeerWatch, hold_target, release_memory, settle_heap
from vla_runtime.nodes.stages import PolicyStage, RingNames, VisionStage, load_policy
from vla_runtime.nodes.profile import EngineSpec

CAMS = ("top", "wrist")


def _controller() -> StreamingController:
    limits = JointLimits(lower=np.full(3, -1.0), upper=np.full(3, 1.0))
    return StreamingController(ControllerConfig(control_hz=10.0, chunk_size=4, action_dim=3), limits)


def test_a_policy_that_never_commanded_holds_the_measured_position_clamped():
    c = _controller()
    assert hold_target(c, None) is None     # nothing sent, nothing known: nothing to hold
    np.testing.assert_array_equal(hold_target(c, np.array([0.5, 3.0, -0.2])), [0.5, 1.0, -0.2])


def test_a_policy_that_commanded_holds_its_last_command_not_the_lagging_measurement():
    c = _controller()
    c.set_initial(np.zeros(3))
    c.on_chunk(c.maybe_request(0, np.zeros(3), 0.0).request_seq, np.full((4, 3), 0.25), 0, 0.0)
    sent = next(a for a in (c.tick(t).action for t in range(1, 10)) if a.any())   # the plan reached
    assert c.tick(10).action.any()          # what the robot was last told (no longer the start)
    np.testing.assert_array_equal(hold_target(c, np.zeros(3)), c.safety.last_command)
    assert sent.any() and not np.array_equal(hold_target(c, np.zeros(3)), np.zeros(3))


def test_a_peer_is_given_the_timeout_then_warned_about_until_heard_then_an_error_when_silent():
    w = PeerWatch(("policy",), now_s=100.0, timeout_s=3.0)
    assert w.report(102.9) == ("", "") and w.silent(102.9) == {}
    assert w.values(102.9) == {"policy_last_heard_s": "2.9", "policy_heard": "False"}   # the start counts
    # never heard: still starting, or kept unconfigured by a lifecycle manager: a warning
    assert w.report(104.0) == ("", "policy node not heard since this node started 4.0 s ago")
    w.heard("policy", 104.5)
    assert w.report(107.0) == ("", "") and w.values(107.0) == {"policy_last_heard_s": "2.5", "policy_heard": "True"}
    # heard, then silent: it died (or was cleaned up): an error naming it
    assert w.report(108.0) == ("policy node silent for 3.5 s (stopped reporting): not running or not configured?",
                               "")
    w.heard("someone else", 108.0)         # not watched: ignored
    assert list(w.silent(108.0)) == ["policy"]
    w.timeout_s = 5.0                      # peer_timeout_s changed at run time
    assert w.report(108.0) == ("", "")


def test_a_watch_needs_a_peer():
    with pytest.raises(ValueError, match="at least one peer"):
        PeerWatch((), 0.0, 1.0)


class _Cycle:
    """An object in a reference cycle: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_a_settled_heap_is_left_out_of_collections_until_memory_is_released():
    try:
        loaded = _Cycle()   # what a configure leaves behind (the model, rclpy)
        gone = weakref.ref(loaded)
        assert settle_heap() >= 1 and gc.get_freeze_count() >= 1
        del loaded
        gc.collect()        # a full collection no longer walks it, so the dropped cycle stays
        assert gone() is not None
        after = _Cycle()    # allocated after the freeze: collected as usual
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None
        release_memory()    # a cleanup thaws and collects: the cycle goes
        assert gone() is None and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_warm_ups_run_a_call_without_touching_the_rings(demo):
    """configure's warm-up: one call on blank inputs; the prefix ring gets no slot (nothing
    announced, nothing to read), and the model then serves a real call as before."""
    engine = EngineSpec(threads=1)
    rings = RingNames.tagged(f"warm{np.random.randint(1 << 30)}")
    vision = VisionStage(load_policy(demo["checkpoint"], engine, CAMS, None, role="vision"), rings)
    try:
        seq_before = vision.prefix.latest_seq
        vision.warm_up()
        assert vision.prefix.latest_seq == seq_before
        policy = PolicyStage(load_policy(demo["checkpoint"], engine, CAMS, None, role="policy"), rings)
        policy.warm_up()
        assert policy.prefix is None       # never attached: the warm-up reads no ring
        policy.close()
    finally:
        vision.close()
