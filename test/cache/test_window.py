"""Sliding working set: window shape, incremental preparation, budget."""

from __future__ import annotations

import pytest

from vla_runtime.cache.window import SlidingWindow, WindowConfig, WindowPlan, reconstruction_budget

LENGTHS = {"e0": 40, "e1": 38, "e2": 12, "e3": 40, "e4": 30, "e5": 25}


def window(**cfg) -> SlidingWindow:
    return SlidingWindow(WindowConfig(**cfg), LENGTHS)


def test_full_window_is_t_by_l_plus_one():
    w = window()
    matches = {"e0": 3, "e1": 7, "e3": 0, "e4": 10}
    target = w.target(matches)
    assert len(target) == WindowConfig().capacity == 20 and len(set(target)) == 20
    assert {i for e, i in target if e == "e1"} == set(range(7, 12))
    # nearest first: all current positions, then +1, ...
    assert target[:4] == [("e0", 3), ("e1", 7), ("e3", 0), ("e4", 10)]
    assert target[4:8] == [("e0", 4), ("e1", 8), ("e3", 1), ("e4", 11)]


def test_window_clipped_at_episode_end():
    w = window()
    assert w.target({"e2": 10}) == [("e2", 10), ("e2", 11)]
    with pytest.raises(ValueError, match="outside"):
        w.target({"e2": 12})
    with pytest.raises(ValueError, match="length unknown"):
        w.target({"nope": 0})
    with pytest.raises(ValueError, match="holds 2"):
        window(episodes=2).target({"e0": 0, "e1": 0, "e3": 0})


def test_only_new_entries_are_prepared_on_advance():
    w = window(episodes=2, lookahead=4)
    first = w.plan({"e0": 0, "e1": 0}, budget=100)
    assert len(first.add) == 10 and first.drop == [] and first.keep == []
    w.commit(first)
    step = w.plan({"e0": 1, "e1": 3}, budget=100)
    assert set(step.add) == {("e0", 5), ("e1", 5), ("e1", 6), ("e1", 7)}
    assert set(step.drop) == {("e0", 0), ("e1", 0), ("e1", 1), ("e1", 2)}
    assert len(step.keep) == 6
    w.commit(step)
    assert w.prepared == set(w.target({"e0": 1, "e1": 3}))
    same = w.plan({"e0": 1, "e1": 3}, budget=100)
    assert same.add == [] and same.drop == []
    # switching episodes releases the old one entirely
    swap = w.plan({"e0": 1, "e3": 0}, budget=100)
    assert {e for e, _ in swap.drop} == {"e1"} and {e for e, _ in swap.add} == {"e3"}


def test_budget_truncates_add_nearest_first():
    w = window(episodes=2, lookahead=4)
    w.commit(w.plan({"e0": 0, "e1": 0}, budget=100))
    plan = w.plan({"e0": 3, "e1": 10}, budget=3)
    # by distance from the current match, across episodes: e1 jumped, so its current index
    # comes first; e0 (3, 4 already prepared) needs only its far positions
    assert plan.add == [("e1", 10), ("e1", 11), ("e0", 5)]
    assert plan.deferred == [("e1", 12), ("e0", 6), ("e1", 13), ("e0", 7), ("e1", 14)]
    assert len(plan.add) + len(plan.deferred) == len(w.missing({"e0": 3, "e1": 10}))
    w.commit(plan)
    assert ("e1", 12) not in w.prepared and ("e0", 0) not in w.prepared
    nothing = w.plan({"e0": 3, "e1": 10}, budget=0)
    assert nothing.add == [] and nothing.drop == [] and len(nothing.deferred) == 5


def test_commit_refuses_a_stale_plan():
    w = window()
    plan = w.plan({"e0": 0}, budget=5)
    w.commit(plan)
    with pytest.raises(ValueError, match="stale"):
        w.commit(plan)
    w.reset()
    assert w.prepared == set()


def test_initial_window():
    w = window(episodes=2, lookahead=2)
    init = w.initial_target(["e0", "e1", "e2", "e3"])
    # position 0 of every episode (so call 0 can choose), then the lookahead of the first T
    assert init == [("e0", 0), ("e1", 0), ("e2", 0), ("e3", 0), ("e0", 1), ("e1", 1), ("e0", 2), ("e1", 2)]
    few = window(episodes=4, lookahead=2).initial_target(["e0", "e1"])
    assert set(few) == {(e, i) for e in ("e0", "e1") for i in range(3)}
    w.commit(w.initial_plan(["e0", "e1", "e2", "e3"], budget=100))
    after_call0 = w.plan({"e3": 0, "e1": 0}, budget=100)
    assert set(after_call0.drop) == {("e0", 0), ("e0", 1), ("e0", 2), ("e2", 0)}
    assert after_call0.add == [("e3", 1), ("e3", 2)]


@pytest.mark.parametrize("args, expected", [
    # n_cand, mem_free, entry, t_avl, t_trans, t_rec
    ((20, 10**12, 1, 0.5, 0.0, 0.025), 20),        # paper's 4090 example: time allows 20
    ((20, 10**12, 1, 0.5, 0.1, 0.025), 16),        # transfer eats into the window
    ((20, 10 * 100, 100, 10.0, 0.0, 0.01), 10),    # memory-bound
    ((5, 10**12, 1, 10.0, 0.0, 0.01), 5),          # candidate-bound
    ((20, 10**12, 1, 0.3, 0.0, 0.1), 3),           # exact ratio despite float rounding
    ((20, 10**12, 1, 0.0, 0.0, 0.025), 0),         # no time
    ((20, 10**12, 1, 0.01, 0.05, 0.025), 0),       # negative time left: zero, not negative
    ((20, 10**12, 1, -1.0, 0.0, 0.025), 0),
    ((0, 10**12, 1, 1.0, 0.0, 0.025), 0),
    ((20, 50, 100, 1.0, 0.0, 0.025), 0),           # not even one entry fits
])
def test_reconstruction_budget(args, expected):
    assert reconstruction_budget(*args) == expected


@pytest.mark.parametrize("kw, field", [
    (dict(entry_bytes=0), "entry_bytes"),
    (dict(mean_reconstruct_s=0.0), "mean_reconstruct_s"),
    (dict(mean_reconstruct_s=-1.0), "mean_reconstruct_s"),
    (dict(n_candidates=-1), "n_candidates"),
    (dict(mem_free_bytes=-5), "mem_free_bytes"),
    (dict(time_available_s=float("nan")), "time_available_s"),
])
def test_reconstruction_budget_validates(kw, field):
    args = dict(n_candidates=4, mem_free_bytes=1000, entry_bytes=10, time_available_s=1.0, transfer_s=0.0,
                mean_reconstruct_s=0.1)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        reconstruction_budget(**args)


def test_config_validation():
    with pytest.raises(ValueError, match="episodes"):
        WindowConfig(episodes=0)
    with pytest.raises(ValueError, match="lookahead"):
        WindowConfig(lookahead=-1)
    assert WindowConfig(episodes=3, lookahead=0).capacity == 3
    assert isinstance(window().plan({}, budget=0), WindowPlan)
