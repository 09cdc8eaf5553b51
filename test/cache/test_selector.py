"""Reference selection with its episode state (``ReferenceSelector``) and the note it hands the
window planner (``Selection``): what the vision process runs, and the in-process manager too."""

from __future__ import annotations

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
    for x in range(5):
        s.observe_state(torch.full((D,), float(x)))
    assert len(s.history) == L                                          # bounded
    assert torch.equal(s.state_history()[:, 0], torch.tensor([2.0, 3.0, 4.0]))
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
    assert not note.dense_for_episode and s.retriever.stats.stalls == 1 and s.history == []
    s.observe_state(torch.zeros(D))
    assert s.select(unit(1)).key == ("a", 1) and not s.selection(4, 1).restart   # served again
