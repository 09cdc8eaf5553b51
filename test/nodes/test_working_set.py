"""The working set in shared memory: entries written into free slots, read back exactly, and a
replaced entry is never served (the reader gets None and that call runs dense)."""

from __future__ import annotations

import pytest
import torch

from vla_runtime.ipc.ring import RingBuffer
from vla_runtime.nodes.working_set import SharedEntryStore, pin_entry

from .conftest import WS_CFG as CFG
from .conftest import ws_entry as _entry


def test_entries_round_trip_through_shared_memory(ws_ring):
    store = SharedEntryStore(ws_ring)
    a, b = _entry(("ep-a", 0), cams=CFG.num_cameras, seed=1), _entry(("ep-b", 3), cams=1, seed=2, masks=False)
    store[a.key], store[b.key] = a, b
    assert len(store) == 2 and store[a.key].nbytes() == a.nbytes()
    ring = RingBuffer.attach(ws_ring.name, RingBuffer.peek_layout(ws_ring.name))
    for e in (a, b):
        got, pin = pin_entry(ring, store[e.key].slot, store[e.key].seq)    # views of the shared memory
        assert got.key == e.key and got.visual_tokens == e.visual_tokens and pin.valid()
        assert torch.equal(got.ffn_in, e.ffn_in) and torch.equal(got.ffn_out, e.ffn_out)
        assert torch.equal(got.image_mask, e.image_mask)
        assert (got.masks is None) == (e.masks is None) and (e.masks is None or torch.equal(got.masks, e.masks))
    ring.close()


def test_a_replaced_entry_is_not_served_and_slots_are_reused(ws_ring):
    store = SharedEntryStore(ws_ring)
    a = _entry(("ep", 0), CFG.num_cameras, 1)
    store[a.key] = a
    where = store[a.key]
    del store[a.key]
    for i in range(1, 4):                    # fills all three slots, reusing a's
        store[("ep", i)] = _entry(("ep", i), CFG.num_cameras, i + 1)
    ring = RingBuffer.attach(ws_ring.name, ws_ring.layout)
    assert pin_entry(ring, where.slot, where.seq) is None
    with pytest.raises(RuntimeError, match="is full"):
        store[("ep", 9)] = _entry(("ep", 9), CFG.num_cameras, 9)
    with pytest.raises(ValueError, match="masks"):
        del store[("ep", 1)]
        store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5, k=4)
    assert len(store) == 2                   # the refused entry took no slot
    store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5)
    ring.close()


def test_a_pin_held_while_the_entry_is_replaced_turns_invalid(ws_ring):
    """Reading in place: whatever was computed from a pinned entry counts only while the pin is
    valid; dropping the entry (the slot is cleared) or rewriting its slot invalidates it."""
    store = SharedEntryStore(ws_ring)
    a = _entry(("ep", 0), CFG.num_cameras, 1)
    store[a.key] = a
    ring = RingBuffer.attach(ws_ring.name, ws_ring.layout)
    entry, pin = pin_entry(ring, store[a.key].slot, store[a.key].seq)
    assert torch.equal(entry.ffn_out, a.ffn_out) and pin.valid()
    del store[a.key]                                        # left the window: the slot is cleared at once
    assert not pin.valid() and pin_entry(ring, pin.slot, pin.seq) is None
    ring.close()


def test_fewer_cameras_than_the_model_has_slots_are_stored_and_read_back(ws_ring):
    """A robot with one camera on a model with more slots: the entry's mask keeps the robot's
    camera count (what the Context Cache compares with the call's), the slot holds the rest."""
    store = SharedEntryStore(ws_ring)
    one = _entry(("ep", 0), cams=1, seed=3, slots=1)
    store[one.key] = one
    ring = RingBuffer.attach(ws_ring.name, ws_ring.layout)
    got, pin = pin_entry(ring, store[one.key].slot, store[one.key].seq)
    assert torch.equal(got.image_mask, one.image_mask) and got.visual_tokens == CFG.num_image_tokens
    assert torch.equal(got.ffn_in, one.ffn_in) and pin.valid()
    ring.close()
