"""The working set in shared memory: entries written into free slots, read back exactly, and a
replaced entry is never served (the reader gets None and that call runs dense)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from vla_runtime.cache.entry import PreparedEntry
from vla_runtime.ipc.ring import RingBuffer
from vla_runtime.models.config import PRESETS
from vla_runtime.nodes.working_set import SharedEntryStore, WindowMirror, WorkingSetReader, working_set_layout

CFG = PRESETS["pi05-tiny"]()


RETRIEVAL, HISTORY = (4, 6), (3, 2)


def _entry(key, cams: int, seed: int, masks: bool = True, k: int = 8, groups: int = 2, slots: int | None = None
           ) -> PreparedEntry:
    """An entry recorded with ``cams`` cameras present out of ``slots`` camera slots (the robot's)."""
    g = torch.Generator().manual_seed(seed)
    pv = cams * CFG.num_image_tokens
    shape = (CFG.vlm.depth - 1, pv, CFG.vlm.width)
    slots = CFG.num_cameras if slots is None else slots
    mask = torch.tensor([True] * cams + [False] * (slots - cams))
    m = torch.randint(0, CFG.expert.mlp_dim, (groups, CFG.expert.depth, k), generator=g) if masks else None
    return PreparedEntry(key, torch.randn(shape, generator=g), torch.randn(shape, generator=g), mask, m,
                         torch.randn(RETRIEVAL, generator=g), torch.randn(HISTORY, generator=g))


@pytest.fixture
def ring():
    layout = working_set_layout(CFG, mask_groups=2, mask_size=8, dtype=torch.float32, retrieval_shape=RETRIEVAL,
                                history_shape=HISTORY)
    r = RingBuffer.create(f"vla_ws_{os.getpid()}_{uuid.uuid4().hex[:6]}", layout, slots=3)
    yield r
    r.close()


def test_entries_round_trip_through_shared_memory(ring):
    store = SharedEntryStore(ring)
    a, b = _entry(("ep-a", 0), cams=CFG.num_cameras, seed=1), _entry(("ep-b", 3), cams=1, seed=2, masks=False)
    store[a.key], store[b.key] = a, b
    assert len(store) == 2 and store[a.key].nbytes() == a.nbytes()
    reader = WorkingSetReader(RingBuffer.attach(ring.name, RingBuffer.peek_layout(ring.name)))
    for e in (a, b):
        got, pin = reader.pin_entry(store[e.key].slot, store[e.key].seq)    # views of the shared memory
        assert got.key == e.key and got.visual_tokens == e.visual_tokens and pin.valid()
        assert torch.equal(got.ffn_in, e.ffn_in) and torch.equal(got.ffn_out, e.ffn_out)
        assert torch.equal(got.image_mask, e.image_mask)
        assert (got.masks is None) == (e.masks is None) and (e.masks is None or torch.equal(got.masks, e.masks))
    reader.ring.close()


def test_a_replaced_entry_is_not_served_and_slots_are_reused(ring):
    store = SharedEntryStore(ring)
    a = _entry(("ep", 0), CFG.num_cameras, 1)
    store[a.key] = a
    where = store[a.key]
    del store[a.key]
    for i in range(1, 4):                    # fills all three slots, reusing a's
        store[("ep", i)] = _entry(("ep", i), CFG.num_cameras, i + 1)
    reader = WorkingSetReader(RingBuffer.attach(ring.name, ring.layout))
    assert reader.pin_entry(where.slot, where.seq) is None
    with pytest.raises(RuntimeError, match="is full"):
        store[("ep", 9)] = _entry(("ep", 9), CFG.num_cameras, 9)
    with pytest.raises(ValueError, match="masks"):
        del store[("ep", 1)]
        store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5, k=4)
    assert len(store) == 2                   # the refused entry took no slot
    store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5)
    reader.ring.close()


def test_a_pin_held_while_the_entry_is_replaced_turns_invalid(ring):
    """Reading in place: whatever was computed from a pinned entry counts only while the pin is
    valid; dropping the entry (the slot is cleared) or rewriting its slot invalidates it."""
    store = SharedEntryStore(ring)
    a = _entry(("ep", 0), CFG.num_cameras, 1)
    store[a.key] = a
    reader = WorkingSetReader(RingBuffer.attach(ring.name, ring.layout))
    entry, pin = reader.pin_entry(store[a.key].slot, store[a.key].seq)
    assert torch.equal(entry.ffn_out, a.ffn_out) and pin.valid()
    del store[a.key]                                        # left the window: the slot is cleared at once
    assert not pin.valid() and reader.pin_entry(pin.slot, pin.seq) is None
    reader.ring.close()


def test_fewer_cameras_than_the_model_has_slots_are_stored_and_read_back(ring):
    """A robot with one camera on a model with more slots: the entry's mask keeps the robot's
    camera count (what the Context Cache compares with the call's), the slot holds the rest."""
    store = SharedEntryStore(ring)
    one = _entry(("ep", 0), cams=1, seed=3, slots=1)
    store[one.key] = one
    reader = WorkingSetReader(RingBuffer.attach(ring.name, ring.layout))
    got, pin = reader.pin_entry(store[one.key].slot, store[one.key].seq)
    assert torch.equal(got.image_mask, one.image_mask) and got.visual_tokens == CFG.num_image_tokens
    assert torch.equal(got.ffn_in, one.ffn_in) and pin.valid()
    reader.ring.close()


def test_the_mirror_follows_the_window_by_sequence_numbers(ring):
    """Selection's view of the window: only the current task's episodes, entries that enter are
    copied once, entries that leave disappear, and the features are kept normalised."""
    store = SharedEntryStore(ring)
    a, b, other = _entry(("ep-a", 0), 2, 1), _entry(("ep-b", 1), 2, 2), _entry(("ep-x", 0), 2, 3)
    store[a.key], store[b.key], store[other.key] = a, b, other
    mirror = WindowMirror(RingBuffer.attach(ring.name, ring.layout))
    mirror.follow_task("task", ["ep-a", "ep-b"])            # ep-x belongs to another task
    assert mirror.refresh() == 2 and len(mirror) == 2 and mirror.refresh() == 0   # nothing changed: no copy
    m = mirror.candidates("task")
    row = m.keys.index(a.key)
    torch.testing.assert_close(m.features[row], a.retrieval.reshape(-1) / a.retrieval.norm(), rtol=0, atol=1e-6)
    assert torch.equal(m.histories[row], a.state_history) and mirror.candidates("another task") is None
    assert mirror.location(b.key) == (store[b.key].slot, store[b.key].seq)
    del store[a.key]
    assert mirror.refresh() == 0 and m.keys == [b.key] and mirror.location(a.key) is None
    c = _entry(("ep-a", 2), 2, 4)
    store[c.key] = c                                        # reuses a's slot with a new sequence
    assert mirror.refresh() == 1 and set(m.keys) == {b.key, c.key}
    mirror.ring.close()
