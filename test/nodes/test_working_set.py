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
from vla_runtime.nodes.working_set import SharedEntryStore, WorkingSetReader, working_set_layout

CFG = PRESETS["pi05-tiny"]()


def _entry(key, cams: int, seed: int, masks: bool = True, k: int = 8, groups: int = 2) -> PreparedEntry:
    g = torch.Generator().manual_seed(seed)
    pv = cams * CFG.num_image_tokens
    shape = (CFG.vlm.depth - 1, pv, CFG.vlm.width)
    mask = torch.tensor([True] * cams + [False] * (CFG.num_cameras - cams))
    m = torch.randint(0, CFG.expert.mlp_dim, (groups, CFG.expert.depth, k), generator=g) if masks else None
    return PreparedEntry(key, torch.randn(shape, generator=g), torch.randn(shape, generator=g), mask, m)


@pytest.fixture
def ring():
    layout = working_set_layout(CFG, mask_groups=2, mask_size=8, dtype=torch.float32)
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
        got = reader.read_entry(store[e.key].slot, store[e.key].seq)
        assert got.key == e.key and got.visual_tokens == e.visual_tokens
        assert torch.equal(got.ffn_in, e.ffn_in) and torch.equal(got.ffn_out, e.ffn_out)
        assert torch.equal(got.image_mask, e.image_mask)
        assert (got.masks is None) == (e.masks is None) and (e.masks is None or torch.equal(got.masks, e.masks))
    assert torch.equal(reader.read_masks(store[a.key].slot, store[a.key].seq), a.masks)
    assert reader.read_masks(store[b.key].slot, store[b.key].seq) is None      # an entry without masks
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
    assert reader.read_entry(where.slot, where.seq) is None
    with pytest.raises(RuntimeError, match="is full"):
        store[("ep", 9)] = _entry(("ep", 9), CFG.num_cameras, 9)
    with pytest.raises(ValueError, match="masks"):
        del store[("ep", 1)]
        store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5, k=4)
    assert len(store) == 2                   # the refused entry took no slot
    store[("ep", 5)] = _entry(("ep", 5), CFG.num_cameras, 5)
    reader.ring.close()
