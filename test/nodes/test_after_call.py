"""``AfterCall``: the cache manager node follows a selection once that call's chunk is published,
or after ``max_wait_s`` when no chunk comes, oldest first and never twice."""

from __future__ import annotations

import pytest

from vla_runtime.cache.selector import Selection
from vla_runtime.nodes.after_call import AfterCall


def _sel(seq: int) -> Selection:
    return Selection(seq, "task", 1, None)


def _seqs(selections: list[Selection]) -> list[int]:
    return [s.request_seq for s in selections]


def test_a_selection_waits_for_its_calls_chunk():
    q = AfterCall(max_wait_s=0.5)
    assert q.add(_sel(3), now_s=10.0) == [] and len(q) == 1
    assert q.chunk_published(2, now_s=10.01) == []              # an earlier call's chunk: still running
    assert _seqs(q.chunk_published(3, now_s=10.02)) == [3] and len(q) == 0
    assert q.chunk_published(3, now_s=10.03) == []              # followed once


def test_a_chunk_covers_every_earlier_call_in_order():
    q = AfterCall(max_wait_s=0.5)
    for seq, t in ((4, 1.0), (5, 1.01), (6, 1.02)):
        q.add(_sel(seq), now_s=t)
    assert _seqs(q.chunk_published(5, now_s=1.03)) == [4, 5]
    assert _seqs(q.chunk_published(6, now_s=1.04)) == [6]


def test_a_selection_arriving_after_its_chunk_is_due_at_once():
    q = AfterCall(max_wait_s=0.5)
    assert q.chunk_published(7, now_s=2.0) == []
    assert _seqs(q.add(_sel(7), now_s=2.001)) == [7]
    assert q.add(_sel(8), now_s=2.002) == []


def test_without_a_chunk_the_selection_is_followed_after_the_wait():
    q = AfterCall(max_wait_s=0.5)
    q.add(_sel(1), now_s=0.0)
    q.add(_sel(2), now_s=0.3)
    assert q.overdue(now_s=0.49) == []
    assert _seqs(q.overdue(now_s=0.5)) == [1]
    assert _seqs(q.overdue(now_s=0.8)) == [2]


def test_the_wait_grows_with_how_long_calls_take():
    """A model that denoises for seconds (full size on a CPU): once a chunk has shown how long a
    call takes, a selection is not followed while its call is still running."""
    q = AfterCall(max_wait_s=0.5)
    q.add(_sel(0), now_s=0.0)
    assert _seqs(q.chunk_published(0, now_s=2.0)) == [0]        # 2 s from selection to chunk
    assert q.wait_limit_s == pytest.approx(6.0)
    q.add(_sel(1), now_s=10.0)
    assert q.overdue(now_s=12.5) == []                          # still denoising: not followed
    assert _seqs(q.overdue(now_s=16.0)) == [1]                  # no chunk after 3x the usual: followed
    q.add(_sel(2), now_s=20.0)
    q.chunk_published(2, now_s=20.1)                            # faster calls bring the limit down
    assert q.usual_wait_s == pytest.approx(2.0 + 0.2 * (0.1 - 2.0))


def test_a_restarted_policy_numbering_from_zero_is_followed_and_then_waited_for_again():
    q = AfterCall(max_wait_s=0.5)
    q.add(_sel(40), now_s=0.0)
    assert _seqs(q.chunk_published(40, now_s=0.01)) == [40]
    # the new policy's first call: below the old chunk id, so followed at once (never held forever)
    assert _seqs(q.add(_sel(0), now_s=1.0)) == [0]
    q.chunk_published(0, now_s=1.02)                           # its chunk: the numbering restarts here too
    assert q.add(_sel(1), now_s=1.03) == []
    assert _seqs(q.chunk_published(1, now_s=1.05)) == [1]


def test_clear_forgets_what_is_held():
    q = AfterCall(max_wait_s=0.5)
    q.chunk_published(9, now_s=0.0)
    q.add(_sel(10), now_s=0.0)
    q.clear()
    assert len(q) == 0 and q.overdue(now_s=5.0) == []
    assert q.add(_sel(3), now_s=5.0) == []                     # the old chunk id no longer counts


def test_negative_wait_is_refused():
    with pytest.raises(ValueError, match="max_wait_s"):
        AfterCall(max_wait_s=-1.0)
