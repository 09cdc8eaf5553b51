"""Reference selection with its episode state (``ReferenceSelector``) and the note it hands the
window planner (``Selection``): what the vision process runs, and the in-process manager too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_runtime.cache.retrieval import CandidateMatrix, RetrievalConfig, TaskPacks
from vla_runtime.cache.selector import ReferenceSelector

F, L, D = 8, 3, 2
TASK = "stack blocks"


def unit(*xs: float) -> torch.Tensor:
    v = torch.zeros(F)
    v[: len(xs)] = torch.tensor(xs)
    return v


def selector(entries: dict, lengths: dict[str, int], **cfg) -> ReferenceSelector:
    m = CandidateMatrix(16, F, L, D)
    for key, feat in entries.items():
        m.put(key, feat, torch.zeros(L, D))
    s = ReferenceSelector(RetrievalConfig(history_len=L, **cfg), TaskPacks({TASK: m}), {TASK: lengths}, D)
    s.start_episode(TASK)
    return s


def test_a_selection_note_carries_the_match_and_the_episodes_the_window_follows():
    s = selector({("a", 0): unit(1), ("b", 0): unit(0.8, 0.6)}, {"a": 5, "b": 5})
    s.observe_state(torch.zeros(D))
    m = s.select(unit(1))
    note = s.selection(request_seq=7, episode=2)
    assert m.key == ("a", 0) and note.match == m and (note.request_seq, note.task, note.episode) == (7, TASK, 2)
    assert set(note.candidates) == {"a", "b"} and not note.restart and not note.dense_for_episode


def test_the_joint_history_keeps_the_last_calls_the_rerank_reads():
    s = selector({("a", 0): unit(1)}, {"a": 5})
    with pytest.raises(RuntimeError, match="observe_state"):
        s.state_history()
    s.observe_state(torch.full((D,), 0.0))
    s.observe_state(np.full(D, 1.0))
    assert s.state_history()[:, 0].tolist() == [0.0, 0.0, 1.0]          # the oldest repeated to fill, as recorded
    for x in range(2, 5):
        s.observe_state(torch.full((D,), float(x)))
    assert s.state_history().shape == (L, D)                            # bounded
    assert s.state_history()[:, 0].tolist() == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="3 values"):
        s.observe_state(torch.zeros(3))


def test_a_stall_restarts_the_episodes_selection_and_says_so_to_the_window():
    """The same reference more often than the task's longest reference has calls: that call runs
    dense with the stall as its reason, the selection starts over, and the note asks the window to
    restart too."""
    s = selector({("a", 1): unit(1)}, {"a": 2})
    for _ in range(2):
        s.observe_state(torch.zeros(D))
        assert s.select(unit(1)) is not None
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)) is None
    note = s.selection(3, 1)
    assert note.restart and note.match is None and note.reason.startswith("stall: reference ('a', 1)")
    assert not note.dense_for_episode and s.retriever.stats.stalls == 1 and s.observed == 0
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)).key == ("a", 1) and s.selection(4, 1).restart is False   # served again


def test_before_any_episode_the_note_is_dense_with_nothing_to_restart():
    """A note asked for before the first episode (the vision process publishes one per request)
    carries no match, no task, and plain booleans: the note's bool fields go into a ROS message,
    whose setters refuse None. ``select`` before ``start_episode`` names what is missing."""
    m = CandidateMatrix(4, F, L, D)
    m.put(("a", 0), unit(1), torch.zeros(L, D))
    s = ReferenceSelector(RetrievalConfig(history_len=L), TaskPacks({TASK: m}), {TASK: {"a": 3}}, D)
    note = s.selection(0, 0)
    assert (note.match, note.task, note.candidates, note.reason) == (None, "", (), "")
    assert note.restart is False and note.dense_for_episode is False
    s.observe_state(torch.zeros(D))
    with pytest.raises(RuntimeError, match="ReferenceSelector.select before start_episode"):
        s.select(unit(1))


def test_a_new_episode_forgets_the_last_match_and_restart():
    s = selector({("a", 0): unit(1)}, {"a": 5})
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)).key == ("a", 0)
    s.start_episode(TASK)
    note = s.selection(1, 1)
    assert note.match is None and note.restart is False and note.candidates == ()


def test_a_low_similarity_fallback_is_dense_for_the_episode_in_the_note():
    s = selector({("a", 0): unit(1)}, {"a": 5})
    s.observe_state(torch.zeros(D))
    assert s.select(unit(0.5, 0.75 ** 0.5)) is None                    # cosine 0.5 < min_similarity 0.8
    note = s.selection(1, 0)
    assert note.dense_for_episode is True and note.restart is False and note.reason.startswith("fallback")


def test_the_episode_lengths_reach_the_past_the_references_rule():
    """The selector hands the task's reference lengths to the retriever: with ``max_end_matches``
    1, a second match to ("a", 2), the last of a's 3 calls, runs the rest of the episode dense."""
    s = selector({("a", 2): unit(1)}, {"a": 3}, max_end_matches=1)
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)).key == ("a", 2)
    assert s.select(unit(1)) is None and s.reason.startswith("past the references")
    assert s.selection(2, 0).dense_for_episode is True


def test_a_task_without_reference_lengths_counts_a_second_repeat_as_a_stall():
    """Without lengths the repeat bound is one call: the same reference twice is a stall. An
    unknown task (no pack, no lengths) runs dense and says so."""
    m = CandidateMatrix(4, F, L, D)
    m.put(("a", 0), unit(1), torch.zeros(L, D))
    s = ReferenceSelector(RetrievalConfig(history_len=L), TaskPacks({TASK: m}), {}, D)
    s.start_episode(TASK)
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)).key == ("a", 0)
    assert s.select(unit(1)) is None and s.reason.startswith("stall") and s.selection(2, 0).restart is True
    s.start_episode("fold towel")
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)) is None and s.reason == "unknown task 'fold towel': no task pack"


def test_the_history_is_float32_whatever_the_caller_passes():
    """States arrive as float64 numpy arrays or int lists (a driver's joint readings); the history
    the rerank compares with the repository's float32 histories is float32, values kept."""
    s = selector({("a", 0): unit(1)}, {"a": 5})
    s.observe_state(np.array([0.25, -1.5]))
    s.observe_state([1, 2])
    h = s.state_history()
    assert h.dtype == np.float32
    assert h.tolist() == [[0.25, -1.5], [0.25, -1.5], [1.0, 2.0]]
