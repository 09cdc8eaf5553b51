"""Selection in the vision process over the window the cache manager publishes: an episode's first
search waits until the cache manager says the episode's initial window is complete, so the
reference the pipeline picks does not depend on how far the cache manager had got, and equals the
one-process choice."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch

from vla_runtime.cache.entry import reconstruct_entry
from vla_runtime.cache.manager import CacheManager, stored_images_to_model
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.engine.policy import Pi05Policy
from vla_runtime.nodes.profile import CacheSpec
from vla_runtime.nodes.selection import WindowSelector
from vla_runtime.nodes.stages import CacheStage, RingNames, manager_config
from vla_runtime.nodes.working_set import pin_entry, window_state

from .conftest import CAMS


@pytest.fixture
def published(demo):
    """The demo's cache stage publishing into a private working set, and what selection needs."""
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    spec = CacheSpec(enabled=True, repository=str(demo["repo"]), episodes=2, lookahead=2, max_end_matches=0)
    rings = RingNames.tagged(f"sel{os.getpid()}_{uuid.uuid4().hex[:6]}")
    stage = CacheStage(policy, spec, rings)
    assert stage.enabled, stage.disabled_reason
    repo = ReferenceRepository.open(demo["repo"])
    yield stage, repo, manager_config(spec, repo), rings
    stage.close()


def test_the_first_search_waits_for_the_initial_window_and_equals_the_one_process_choice(published):
    stage, repo, cfg, rings = published
    manager = stage.worker.manager
    task = repo.tasks()[0]
    eids = [r.episode_id for r in repo.episodes(task)]
    # the robot shows what a reference's call 1 showed (its features and state): the best entry
    query = repo.load_call(eids[-1], 1)
    features, state = query.retrieval, query.state_history[-1].numpy()

    # one process: the manager's own selection over its complete initial window
    alone = CacheManager(manager.model, repo, cfg)
    alone.start_episode(task)
    alone.observe_state(torch.as_tensor(state))
    assert alone.select(features) is not None
    want = alone.last_match.key

    selector = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=600.0)
    try:
        # the cache manager has begun the episode and published part of its initial window: the
        # entry a search would pick is there, but the first search must not run on a partial window
        stage.store.mark_window(window_state(task, 0, ready=False))
        stage.worker.begin(task, 0)
        initial = set(manager.entries)
        held_back = [k for k in initial if k != want][:2]
        for k in held_back:
            del manager.entries[k]
        for call in range(2):
            choice = selector.choose(call, task, 0, features, state)
            assert not choice.found and "initial window still being prepared" in choice.reason
            assert selector.selector.candidate_episodes() == []          # no episodes chosen yet
        for k in held_back:
            manager.entries[k] = _rebuilt(manager, repo, k)
        stage.store.mark_window(window_state(task, 0, ready=True))
        choice = selector.choose(2, task, 0, features, state)
        assert choice.found and choice.selection.match.key == want, (choice.reason, choice.selection.match)
        assert set(choice.selection.candidates) == set(alone.selector.candidate_episodes())
        got, _ = pin_entry(selector.ring, choice.slot, choice.seq)
        np.testing.assert_array_equal(got.ffn_out.numpy(), alone.entries[want].ffn_out.numpy())
        # the same task again: the window still holds episode 0's entries, but episode 1's first
        # search waits until the cache manager has begun episode 1
        choice = selector.choose(3, task, 1, features, state)
        assert not choice.found and "initial window still being prepared" in choice.reason
        stage.begin(task, 1)
        assert selector.choose(4, task, 1, features, state).found
        assert selector.partial_first_searches == 0
    finally:
        selector.close()


def test_the_wait_for_the_initial_window_is_bounded(published):
    """A cache manager starved of CPU (or an episode shorter than its window takes to build):
    once ``first_search_wait_s`` has passed since the episode's first call, the first search runs
    on what has been published instead of leaving the episode dense."""
    stage, repo, cfg, rings = published
    task = repo.tasks()[0]
    query = repo.load_call(repo.episodes(task)[0].episode_id, 0)
    features, state = query.retrieval, query.state_history[-1].numpy()
    stage.store.mark_window(window_state(task, 0, ready=False))
    stage.worker.begin(task, 0)                    # published, but never marked complete
    selector = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=0.2)
    try:
        assert not selector.choose(0, task, 0, features, state).found
        time.sleep(0.25)
        choice = selector.choose(1, task, 0, features, state)
        assert choice.found and selector.partial_first_searches == 1
        assert selector.diagnostics()["partial_first_searches"] == "1"
    finally:
        selector.close()


def test_a_restarted_vision_process_selects_from_the_window_the_episode_is_at(published):
    """A vision process restarted mid-episode starts its selection afresh over the window as it
    has slid (the initial window is long gone): it does not wait for one."""
    stage, repo, cfg, rings = published
    task = repo.tasks()[0]
    eid = repo.episodes(task)[0].episode_id
    stage.begin(task, 0)
    first = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=600.0)
    calls = repo.episodes(task)[0].num_calls
    for i in range(calls):               # the robot replays reference eid: the window slides along
        call = repo.load_call(eid, i)
        choice = first.choose(i, task, 0, call.retrieval, call.state_history[-1].numpy())
        assert choice.found, choice.reason
        stage.follow(choice.selection)
        stage.upkeep()
    first.close()
    assert (eid, 0) not in stage.worker.manager.entries        # the window has moved on
    again = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=600.0)
    try:
        call = repo.load_call(eid, calls - 1)
        choice = again.choose(calls, task, 0, call.retrieval, call.state_history[-1].numpy())
        assert choice.found and choice.selection.match.key == (eid, calls - 1), choice.reason
    finally:
        again.close()


def test_a_late_note_of_the_episode_before_does_not_take_the_window_back(published):
    """A call in flight when the robot reset reports its episode's selection after the cache
    manager began the next one: following it would restart the old episode, then the next call
    would start the current one a second time."""
    from vla_runtime.cache.selector import Selection

    stage, repo, _, _ = published
    task = repo.tasks()[0]
    stage.begin(task, 1)
    stage.begin(task, 2)
    started = stage.worker.episodes_started
    stage.follow(Selection(7, task, 1, None, reason="initial window still being prepared"))
    assert stage.worker.episodes_started == started and stage.worker.episode == 2
    stage.follow(Selection(8, task, 3, None))                 # a later episode is begun from its note
    assert stage.worker.episodes_started == started + 1 and stage.worker.episode == 3


@pytest.mark.parametrize("idle", [False, True], ids=["calls only", "idle work between calls"])
def test_in_place_selection_chooses_what_the_copied_window_chooses(published, idle):
    """The robot replays a reference episode while the window slides: at every call, selection
    in place over the working set picks what the same rules pick over a copy of that window (the
    cache manager's own candidate matrix, which holds exactly the window's entries). With the
    vision process's idle work between calls (``idle``), the window's changes are taken in
    before the call comes, and the choices are the same."""
    from vla_runtime.cache.selector import ReferenceSelector

    stage, repo, cfg, rings = published
    manager = stage.worker.manager
    task = repo.tasks()[0]
    lengths = {t: {r.episode_id: r.num_calls for r in repo.episodes(t)} for t in repo.tasks()}
    state_dim = int(repo.call_layout["state_history"][1])
    copied = ReferenceSelector(cfg.retrieval, manager, lengths, state_dim)
    stage.begin(task, 0)
    copied.start_episode(task)
    selector = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=600.0)
    selector.idle()                       # nothing attached or followed yet: nothing to do
    assert selector.view is None
    eid = repo.episodes(task)[-1].episode_id
    try:
        for i in range(repo.episodes(task)[-1].num_calls):
            call = repo.load_call(eid, i)
            state = call.state_history[-1].numpy()
            choice = selector.choose(i, task, 0, call.retrieval, state)
            copied.observe_state(torch.as_tensor(state))
            want = copied.select(call.retrieval)
            assert choice.found and want is not None, (i, choice.reason, copied.reason)
            got = choice.selection.match
            assert got.key == want.key and choice.selection.candidates == tuple(copied.candidate_episodes())
            # float32 cosines from two orders of the same arithmetic (normalise then multiply,
            # against multiply then scale): a few ulps apart; joint distances: the same numbers
            assert got.similarity == pytest.approx(want.similarity, abs=1e-5)
            assert got.joint_distance == pytest.approx(want.joint_distance, rel=1e-6)
            stage.follow(choice.selection)
            stage.upkeep()
            if idle:
                selector.idle()
                assert selector.view.refresh() == 0      # the idle work took in every change
    finally:
        selector.close()


def test_a_slot_rewritten_between_scoring_and_validation_means_a_dense_call(published, monkeypatch):
    """The cache manager rewrites the chosen entry's slot after the scores were computed from it
    and before the choice is returned: the call runs dense, naming the entry."""
    from vla_runtime.cache.selector import ReferenceSelector

    stage, repo, cfg, rings = published
    manager = stage.worker.manager
    task = repo.tasks()[0]
    stage.begin(task, 0)
    call = repo.load_call(repo.episodes(task)[0].episode_id, 1)
    real = ReferenceSelector.select

    def rewritten(self, features):
        match = real(self, features)
        if match is not None:     # the same entry prepared again: its slot gets a new sequence
            manager.entries[match.key] = _rebuilt(manager, repo, match.key)
        return match

    selector = WindowSelector(repo, cfg.retrieval, rings.working_set, first_search_wait_s=600.0)
    try:
        monkeypatch.setattr(ReferenceSelector, "select", rewritten)
        choice = selector.choose(0, task, 0, call.retrieval, call.state_history[-1].numpy())
        assert not choice.found and choice.pin is None
        assert choice.reason == f"entry {selector.selector.last_match.key} replaced before it was read"
        monkeypatch.setattr(ReferenceSelector, "select", real)
        assert selector.choose(1, task, 0, call.retrieval, call.state_history[-1].numpy()).found  # taken in again
    finally:
        selector.close()


def _rebuilt(manager: CacheManager, repo: ReferenceRepository, key):
    """Entry ``key`` as the cache manager prepares it (its states, retrieval features, history)."""
    call = repo.load_call(*key)
    entry = reconstruct_entry(manager.model, key, stored_images_to_model(call.images), call.image_mask, call.tokens,
                              call.token_mask, call.masks)
    entry.retrieval, entry.state_history = call.retrieval, call.state_history
    return entry


def test_beside_tower_runs_the_selection_on_its_thread_only_after_a_long_enough_tail():
    """No tail measured yet: the tap starts nothing and ``finish`` chooses on the caller's thread,
    then keeps the measured tail; with the bound at zero the tap starts the selection on the
    ``vision-select`` thread and ``finish`` returns its result; ``abandon`` waits for it."""
    import threading
    import time

    from vla_runtime.nodes.selection import BesideTower

    beside, ran = BesideTower(), []

    def choose(features):
        ran.append((threading.current_thread().name, features))
        return f"chose {features}"

    try:
        on_tap = beside.start(choose)
        on_tap("a")
        time.sleep(0.002)   # the tower's tail
        assert beside.finish(lambda: choose("a, here")) == "chose a, here"
        assert [n for n, _ in ran] == [threading.current_thread().name] and beside.tail_s > 0.0
        beside.MIN_TAIL_S = 0.0
        beside.start(choose)("b")
        assert beside.finish(lambda: choose("never")) == "chose b" and ran[-1][0].startswith("vision-select")
        release = threading.Event()
        beside.start(lambda f: (release.wait(120.0), choose(f))[1])("c")
        threading.Timer(0.05, release.set).start()
        beside.abandon()   # returns once the selection in flight is done
        assert ran[-1][1] == "c"
    finally:
        beside.close()


def test_a_restarted_cache_manager_is_taken_up_between_calls_or_else_at_the_call(demo):
    """The attachment to the working set is checked between calls (the vision process's idle work)
    and, when calls come back to back, by the call itself: either way a cache manager restarted
    since (a new segment under the same name) serves the next call from its own window."""
    policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
    spec = CacheSpec(enabled=True, repository=str(demo["repo"]), episodes=2, lookahead=2, max_end_matches=0)
    rings = RingNames.tagged(f"rst{os.getpid()}_{uuid.uuid4().hex[:6]}")
    repo = ReferenceRepository.open(demo["repo"])
    task = repo.tasks()[0]
    eid = repo.episodes(task)[0].episode_id
    stage = CacheStage(policy, spec, rings)
    selector = WindowSelector(repo, manager_config(spec, repo).retrieval, rings.working_set, first_search_wait_s=600.0)

    def restart():
        nonlocal stage
        stage.close()                           # unlinks its working set
        stage = CacheStage(policy, spec, rings)
        stage.begin(task, 0)

    def choose(i: int):
        call = repo.load_call(eid, i)
        choice = selector.choose(i, task, 0, call.retrieval, call.state_history[-1].numpy())
        assert choice.found, choice.reason
        return choice

    try:
        stage.begin(task, 0)
        choose(0)
        before = selector.ring
        selector.idle()
        restart()
        selector.idle()                         # between calls: the new segment
        assert selector.ring is not before
        choose(1)
        before = selector.ring
        restart()                               # and no gap before the next call
        choose(1)
        assert selector.ring is not before
    finally:
        selector.close()
        stage.close()


def test_a_late_note_of_a_task_switched_away_from_does_not_restart_its_episode(published):
    """A call in flight when the instruction changed reports its selection after the robot was
    switched back: following it would begin the other task's episode, then the next call would
    begin the current one a second time (seen in the ROS fault test under load: three episodes
    started for one announced). Until an instruction is heard every task's notes are followed."""
    from vla_runtime.cache.selector import Selection

    stage, repo, _, _ = published
    task, other = repo.tasks()[0], "a task switched away from"
    stage.follow(Selection(1, other, 0, None))            # no instruction heard yet: followed
    assert stage.worker.manager.task == other and stage.notes_of_other_tasks == 0
    stage.instruct(task)
    stage.begin(task, 0)
    started = stage.worker.episodes_started
    stage.follow(Selection(2, other, 0, None, reason="initial window still being prepared"))
    assert stage.worker.episodes_started == started and stage.worker.manager.task == task
    assert stage.notes_of_other_tasks == 1
    stage.follow(Selection(3, task, 0, None))             # the current task's notes are followed
    assert stage.worker.episodes_started == started and stage.worker.last_selection.request_seq == 3
