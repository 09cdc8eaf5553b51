"""The policy node's wait for a prefix request's answer learns from answers that came too late."""

import pytest

from vla_runtime.nodes.request_timeout import Asked, RequestTimeout


def test_the_configured_wait_holds_until_an_answer_comes_late():
    t = RequestTimeout()
    assert t.seconds(2.0) == 2.0
    assert t.seconds(0.5) == 0.5      # the parameter is read on every use: a change takes effect


def test_a_late_answer_raises_the_wait_to_margin_times_its_latency_and_says_so():
    t = RequestTimeout(margin=1.5)
    msg = t.late_answer(3.0, configured_s=2.0)
    assert t.seconds(2.0) == pytest.approx(4.5)
    assert "3.00 s" in msg and "request_timeout_s (2 s)" in msg and "4.50 s" in msg
    # a later, faster late answer does not shorten the wait, and is not reported again
    assert t.late_answer(2.5, configured_s=2.0) == "" and t.seconds(2.0) == pytest.approx(4.5)
    # a slower one raises it further
    assert t.late_answer(4.0, configured_s=2.0) and t.seconds(2.0) == pytest.approx(6.0)


def test_a_configured_wait_longer_than_the_learned_one_wins_and_the_ceiling_bounds_both():
    t = RequestTimeout(margin=2.0, ceiling_s=10.0)
    t.late_answer(3.0, configured_s=1.0)
    assert t.seconds(1.0) == 6.0 and t.seconds(8.0) == 8.0
    assert t.late_answer(30.0, configured_s=1.0) and t.seconds(1.0) == 10.0
    # an answer that came within what the configured wait already allows changes nothing
    u = RequestTimeout()
    assert u.late_answer(1.0, configured_s=5.0) == "" and u.seconds(5.0) == 5.0


@pytest.mark.parametrize("kw", [{"margin": 0.9}, {"ceiling_s": 0.0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="margin must be >= 1"):
        RequestTimeout(**kw)


def test_the_last_requests_given_up_on_are_kept_until_their_answers_come():
    t = RequestTimeout(kept=3)
    for seq in (4, 1, 7, 9):       # given up on out of order: the lowest numbers are the oldest requests
        t.give_up(seq, Asked(clock_s=float(seq), monotonic_ns=seq * 10))
    assert sorted(t.given_up) == [4, 7, 9]
    assert t.take_given_up(7) == Asked(7.0, 70)
    assert t.take_given_up(7) is None          # one answer per request
    assert t.take_given_up(1) is None          # forgotten: beyond the last three
    assert sorted(t.given_up) == [4, 9]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_kept_is_validated(bad):
    with pytest.raises(ValueError, match=f"kept must be an int >= 1, got {bad!r}"):
        RequestTimeout(kept=bad)
