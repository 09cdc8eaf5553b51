"""Selection's in-place view of the working set: which slots are candidates, scores computed from
the shared memory itself with per-slot norms that follow each slot's sequence, and a slot written
since it was taken in never scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vla_runtime.ipc.ring import RingBuffer
from vla_runtime.nodes.window_view import WindowView
from vla_runtime.nodes.working_set import SharedEntryStore

from .conftest import RETRIEVAL, new_ws_ring, ws_entry

RETRIEVAL_BYTES = math.prod(RETRIEVAL) * 4   # one slot's retrieval features (float32)
# float32 dot products of 24 terms against the float64 cosine: a few ulps of 1 at most
ATOL = 1e-6


@pytest.fixture
def store():
    ring = new_ws_ring(6)
    yield SharedEntryStore(ring)
    ring.close()


def _view(store: SharedEntryStore, episodes) -> WindowView:
    view = WindowView(RingBuffer.attach(store.ring.name, store.ring.layout))
    view.follow_task("task", episodes)
    return view


def _cos(entry, q: torch.Tensor) -> float:
    a, b = entry.retrieval.reshape(-1).double(), q.reshape(-1).double()
    return float(a @ b / (a.norm() * b.norm()))


def test_the_view_follows_the_window_by_sequence_numbers(store):
    """Only the current task's episodes are candidates, an entry is taken in once, an entry that
    leaves stops scoring at once, and scores are cosines read from the slots themselves."""
    a, b, other = ws_entry(("ep-a", 0), 2, 1), ws_entry(("ep-b", 1), 2, 2), ws_entry(("ep-x", 0), 2, 3)
    store[a.key], store[b.key], store[other.key] = a, b, other
    view = _view(store, ["ep-a", "ep-b"])                  # ep-x belongs to another task
    assert view.refresh() == 2 and len(view) == 2 and view.refresh() == 0   # nothing changed: nothing taken in
    assert view.candidates("task") is view and view.candidates("another task") is None
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    sims = view.similarities(q)
    sa, sb = store[a.key].slot, store[b.key].slot
    np.testing.assert_allclose(sims[[sa, sb]], [_cos(a, q), _cos(b, q)], rtol=0, atol=ATOL)
    assert np.isneginf(np.delete(sims, [sa, sb])).all()     # ep-x's slot and the empty ones
    assert view.keys[sa] == a.key and np.array_equal(view.histories_np[sa], a.state_history.numpy())
    assert view.entry(b.key)[0].slot == sb and view.entry(b.key)[0].seq == store[b.key].seq
    del store[a.key]
    assert view.refresh() == 0 and len(view) == 1 and view.entry(a.key) is None
    assert np.isneginf(view.similarities(q)[sa])
    c = ws_entry(("ep-a", 2), 2, 4)
    store[c.key] = c                                        # reuses a's slot with a new sequence
    assert store[c.key].slot == sa and view.refresh() == 1 and view.entry(c.key)[0].slot == sa
    assert view.similarities(q)[sa] == pytest.approx(_cos(c, q), abs=ATOL)
    view.ring.close()


@pytest.mark.parametrize("gap_read_bytes, rows_read", [(0, 3), (RETRIEVAL_BYTES, 4)])
def test_the_product_reads_only_the_candidate_slots(store, gap_read_bytes, rows_read):
    """Candidates in two spans of slots with another task's entries between them and after: each
    candidate scores its cosine, the others -inf, and the product reads only the candidates' slots
    (``rows_scored``; a slot holds 768 KB of features at ``pi05-small``), plus a gap between them
    when one slot's features are cheaper to read than another product."""
    entries = [ws_entry((ep, i), 2, i + 1) for i, ep in enumerate(["ep-a", "ep-x", "ep-a", "ep-a", "ep-x"])]
    for e in entries:
        store[e.key] = e
    view = _view(store, ["ep-a"])
    view.GAP_READ_BYTES = gap_read_bytes
    assert view.refresh() == 3
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(11))
    sims = view.similarities(q)
    mine = [store[e.key].slot for e in entries if e.key[0] == "ep-a"]
    assert sorted(mine) == [0, 2, 3]                        # two spans: [0] and [2, 3]
    np.testing.assert_allclose(sims[mine], [_cos(e, q) for e in entries if e.key[0] == "ep-a"], rtol=0, atol=ATOL)
    assert np.isneginf(np.delete(sims, mine)).all()
    assert view.rows_scored == rows_read
    view.ring.close()


def test_a_slot_whose_sequence_changed_gets_its_norm_recomputed(store):
    """The inverse norm is kept per sequence, not per slot or key: the same entry re-prepared
    into the same slot with features of another length scores with its new norm."""
    g = torch.Generator().manual_seed(5)
    first = ws_entry(("ep-a", 0), 2, 1, retrieval=torch.randn(4, 6, generator=g))
    store[first.key] = first
    view = _view(store, ["ep-a"])
    q = torch.randn(4, 6, generator=g)
    assert view.refresh() == 1
    slot = store[first.key].slot
    assert view.similarities(q)[slot] == pytest.approx(_cos(first, q), abs=ATOL)
    again = ws_entry(first.key, 2, 2, retrieval=40.0 * torch.randn(4, 6, generator=g))
    store[again.key] = again                                # same key, same slot, a new sequence
    assert store[again.key].slot == slot and view.refresh() == 1
    assert view.similarities(q)[slot] == pytest.approx(_cos(again, q), abs=ATOL)
    view.ring.close()


def test_a_slot_written_after_it_was_taken_in_does_not_score(store):
    """The product reads the slots as they are now: a slot rewritten since its pin (not yet taken
    in again) may hold a mix of two payloads, so it scores -inf until the next refresh."""
    a, b = ws_entry(("ep-a", 0), 2, 1), ws_entry(("ep-a", 1), 2, 2)
    store[a.key], store[b.key] = a, b
    view = _view(store, ["ep-a"])
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    view.refresh()
    pin = view.entry(b.key)[0]
    store[b.key] = ws_entry(b.key, 2, 7)                    # the cache manager rewrites b's slot
    sims = view.similarities(q)
    assert not pin.valid() and math.isinf(sims[pin.slot]) and sims[pin.slot] < 0
    assert sims[store[a.key].slot] == pytest.approx(_cos(a, q), abs=ATOL)
    assert view.refresh() == 1 and np.isfinite(view.similarities(q)[store[b.key].slot])
    view.ring.close()


def test_an_entry_moved_to_a_slot_taken_in_first_stays_a_candidate(store):
    """The cache manager drops an entry and prepares it again into a lower slot, and the slot it
    left gets another entry: taken in slot by slot, the new place comes first, and forgetting the
    old place must not drop the entry (the copied mirror this view replaced lost it)."""
    e0, k, e2, x = (ws_entry(("ep", i), 2, i + 1) for i in range(4))
    store[e0.key], store[k.key], store[e2.key] = e0, k, e2
    view = _view(store, ["ep"])
    view.refresh()
    old_slot = store[k.key].slot
    del store[e0.key], store[k.key]
    store[x.key], store[k.key] = x, k
    assert store[k.key].slot < old_slot and store[x.key].slot == old_slot
    view.refresh()
    assert view.entry(k.key) is not None and view.entry(k.key)[0].slot == store[k.key].slot
    assert len(view) == 3 and view.keys[old_slot] == x.key
    view.ring.close()


def test_the_products_spans_follow_candidates_coming_and_going(store):
    """The spans the product reads are kept between calls, so they must change with the window: a
    candidate that leaves is no longer read, one that comes is read and scores its cosine."""
    entries = [ws_entry(("ep-a", i), 2, i + 1) for i in range(3)]
    for e in entries:
        store[e.key] = e
    view = _view(store, ["ep-a"])
    view.GAP_READ_BYTES = 0                                 # read candidates only: the spans show in rows_scored
    view.refresh()
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(21))
    view.similarities(q)
    assert view.rows_scored == 3
    del store[entries[1].key]
    view.refresh()
    sims = view.similarities(q)
    assert view.rows_scored == 2 and np.isneginf(sims[1])
    late = ws_entry(("ep-a", 5), 2, 9)
    store[late.key] = late
    view.refresh()
    sims = view.similarities(q)
    assert view.rows_scored == 3 and sims[store[late.key].slot] == pytest.approx(_cos(late, q), abs=ATOL)
    view.ring.close()


def test_a_query_in_any_layout_or_dtype_scores_the_same(store):
    """The call's features are read where they are when they are contiguous float32 (the vision
    tower's output), copied otherwise: a transposed or float64 query scores the same."""
    a, b = ws_entry(("ep-a", 0), 2, 1), ws_entry(("ep-a", 1), 2, 2)
    store[a.key], store[b.key] = a, b
    view = _view(store, ["ep-a"])
    view.refresh()
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(13))
    slots = [store[a.key].slot, store[b.key].slot]
    expected = [_cos(a, q), _cos(b, q)]
    for query in (q, q.t().contiguous().t(), q.double()):
        np.testing.assert_allclose(view.similarities(query)[slots], expected, rtol=0, atol=ATOL)
    view.ring.close()


def test_a_candidate_is_handed_over_as_its_entry_in_place(store):
    """``entry`` gives a candidate's pin and its entry as views of the slot, as taken in."""
    a = ws_entry(("ep-a", 0), 2, 1)
    store[a.key] = a
    view = _view(store, ["ep-a"])
    assert view.entry(a.key) is None                        # not taken in yet
    view.refresh()
    pin, entry = view.entry(a.key)
    assert pin.valid() and pin.slot == store[a.key].slot and entry.key == a.key
    assert torch.equal(entry.ffn_in, a.ffn_in) and torch.equal(entry.ffn_out, a.ffn_out)
    assert entry.ffn_in.data_ptr() == pin.views["ffn_in"].data_ptr()   # read in place, not copied
    del store[a.key]
    view.refresh()
    assert view.entry(a.key) is None
    view.ring.close()


def test_refresh_reads_the_headers_only_after_a_change(store, monkeypatch):
    """A call's ``refresh`` with nothing changed since the last one reads one word (the ring's
    change count), not every slot's header; any change after it (a commit, a write begun and
    abandoned) is taken in by the next ``refresh``, and so is a slot it could not take in."""
    a = ws_entry(("ep-a", 0), 2, 1)
    store[a.key] = a
    view = _view(store, ["ep-a"])
    assert view.refresh() == 1
    reads = []
    slot_seqs = view.ring.slot_seqs
    monkeypatch.setattr(view.ring, "slot_seqs", lambda: reads.append(1) or slot_seqs())
    assert view.refresh() == 0 and reads == []                 # nothing changed: no header read
    b = ws_entry(("ep-a", 1), 2, 2)
    store[b.key] = b
    assert view.refresh() == 1 and len(reads) == 1 and len(view) == 2
    store.ring.begin_write(store[a.key].slot).abort()          # a's slot emptied (``clear_slot``)
    assert view.refresh() == 0 and len(reads) == 2 and view.entry(a.key) is None and len(view) == 1
    c = ws_entry(("ep-a", 2), 2, 3)
    store[c.key] = c
    pin = view.ring.pin
    monkeypatch.setattr(view.ring, "pin", lambda *args: None)  # as if c's slot were being rewritten
    assert view.refresh() == 0 and len(reads) == 3
    monkeypatch.setattr(view.ring, "pin", pin)
    assert view.refresh() == 1 and len(reads) == 4 and view.entry(c.key) is not None   # looked at again
    assert view.refresh() == 0 and len(reads) == 4
    view.ring.close()


def test_scores_check_every_slots_lock_only_after_a_change(store, monkeypatch):
    """After the product, pins taken since the ring's change count was read are still valid when
    the count has not moved: one word read instead of every slot's seqlock. A write since (even
    one only begun) sends the scores through the slot-by-slot check."""
    a, b = ws_entry(("ep-a", 0), 2, 1), ws_entry(("ep-a", 1), 2, 2)
    store[a.key], store[b.key] = a, b
    view = _view(store, ["ep-a"])
    view.refresh()
    locks_read = []
    seqlocks = view.ring.seqlocks
    monkeypatch.setattr(view.ring, "seqlocks", lambda: locks_read.append(1) or seqlocks())
    q = torch.randn(4, 6, generator=torch.Generator().manual_seed(17))
    sims = view.similarities(q)
    assert locks_read == [] and np.isfinite(sims[[store[a.key].slot, store[b.key].slot]]).all()
    w = store.ring.begin_write(store[b.key].slot)              # b's slot being rewritten, not taken in yet
    sims = view.similarities(q)
    assert locks_read == [1] and np.isneginf(sims[view.entry(b.key)[0].slot])
    assert sims[store[a.key].slot] == pytest.approx(_cos(a, q), abs=ATOL)
    w.abort()
    view.ring.close()


def test_retrieval_over_the_view_scores_a_slot_by_the_episode_it_holds_now(store):
    """The retriever keeps which rows belong to the episodes it follows between calls; a slot of
    a followed episode rewritten with another episode's entry must drop out of that set."""
    from vla_runtime.cache.retrieval import RetrievalConfig, Retriever

    a = ws_entry(("ep-a", 0), 2, 1)
    b = ws_entry(("ep-b", 0), 2, 2)
    store[a.key], store[b.key] = a, b
    view = _view(store, ["ep-a", "ep-b"])
    view.refresh()
    r = Retriever(RetrievalConfig(top_t=1, history_len=view.history_len, min_similarity=-1.0), view)
    r.start_episode("task", max_calls=10)
    h = np.zeros((view.history_len, view.state_dim), dtype=np.float32)
    assert r.query(a.retrieval, h).key == a.key and r.candidate_episodes() == ["ep-a"]
    assert r.query(b.retrieval, h).key == a.key                   # ep-b is not followed
    slot = store[a.key].slot
    del store[a.key]
    b1 = ws_entry(("ep-b", 1), 2, 3)
    store[b1.key] = b1                                            # ep-b's entry where ep-a's was
    assert store[b1.key].slot == slot and view.refresh() == 1
    assert r.query(b1.retrieval, h) is None and r.reason == "no prepared candidates"
    view.ring.close()
