"""The reference working set in shared memory: the cache manager writes prepared entries, the
vision node reads their FFN states (Context Cache) and the policy node their masks (Action Cache).

The cache manager process keeps the sliding window of rMuscle (T episodes x (L + 1) positions);
each prepared entry it reconstructs goes into a slot of a ring buffer of its own, chosen among the
slots no live entry holds, so a slot is only rewritten once its entry has left the window. A
reference is announced as "slot s holds sequence n": a reader that finds another sequence there
(the entry was replaced since) gets None and that call runs dense, which is always correct.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache.entry import EntryKey, PreparedEntry
from ..ipc.layout import FieldSpec, SlotLayout
from ..ipc.ring import RingBuffer
from ..models.config import Pi05Config

DEFAULT_WORKING_SET = "vla_refs"


def working_set_layout(cfg: Pi05Config, mask_groups: int, mask_size: int, dtype: torch.dtype) -> SlotLayout:
    """One slot holds one prepared entry at the model's largest camera layout (fewer cameras use
    the first rows; the slot's metadata says how many visual tokens are valid)."""
    pv = cfg.num_cameras * cfg.num_image_tokens
    ffn = (cfg.vlm.depth - 1, pv, cfg.vlm.width)
    return SlotLayout((FieldSpec("ffn_in", ffn, dtype), FieldSpec("ffn_out", ffn, dtype),
                       FieldSpec("image_mask", (cfg.num_cameras,), torch.bool),
                       FieldSpec("masks", (mask_groups, cfg.expert.depth, mask_size), torch.int64)))


@dataclass(frozen=True)
class SharedEntry:
    """Where one prepared entry lives in the working-set ring (the manager's view of it)."""

    key: EntryKey
    slot: int
    seq: int
    size: int

    def nbytes(self) -> int:
        return self.size


class SharedEntryStore(MutableMapping[EntryKey, SharedEntry]):
    """The cache manager's ``entries``: storing a ``PreparedEntry`` copies it into a free slot.

    Slots are only reused after their entry was dropped, so an entry stays readable for as long
    as it is in the window; no allocation happens after the ring is created.
    """

    def __init__(self, ring: RingBuffer):
        self.ring = ring
        self._where: dict[EntryKey, SharedEntry] = {}
        self._free = list(range(ring.slots - 1, -1, -1))
        self.mask_shape = tuple(ring.layout.field("masks").shape)

    def __setitem__(self, key: EntryKey, entry: PreparedEntry) -> None:
        if key in self._where:
            del self[key]
        if not self._free:
            raise RuntimeError(f"working set {self.ring.name!r} is full ({self.ring.slots} entries): "
                               "window capacity and ring slots disagree")
        pv = entry.visual_tokens
        has_masks = entry.masks is not None
        if has_masks and tuple(entry.masks.shape) != self.mask_shape:
            raise ValueError(f"entry {key} has masks {tuple(entry.masks.shape)}, the working set holds "
                             f"{self.mask_shape}")
        slot = self._free.pop()
        with self.ring.begin_write(slot) as wr:
            wr["ffn_in"][:, :pv].copy_(entry.ffn_in)
            wr["ffn_out"][:, :pv].copy_(entry.ffn_out)
            wr["image_mask"].copy_(entry.image_mask)
            if has_masks:
                wr["masks"].copy_(entry.masks)
            try:
                _, seq = wr.commit({"episode": key[0], "index": int(key[1]), "visual_tokens": pv,
                                    "has_masks": int(has_masks)})
            except (ValueError, TypeError):
                self._free.append(slot)
                raise
        self._where[key] = SharedEntry(key, slot, seq, entry.nbytes())

    def __getitem__(self, key: EntryKey) -> SharedEntry:
        return self._where[key]

    def __delitem__(self, key: EntryKey) -> None:
        self._free.append(self._where.pop(key).slot)

    def __iter__(self) -> Iterator[EntryKey]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class WorkingSetReader:
    """A reader's preallocated copy of working-set entries: the vision node reads whole entries
    (Context Cache), the policy node only masks (Action Cache)."""

    ENTRY_FIELDS = ("ffn_in", "ffn_out", "image_mask", "masks")

    def __init__(self, ring: RingBuffer, fields: tuple[str, ...] = ENTRY_FIELDS, device: torch.device | str = "cpu"):
        self.ring = ring
        self.buf: dict[str, Tensor] = {}
        for name in fields:
            f = ring.layout.field(name)
            self.buf[name] = torch.zeros(f.shape, dtype=f.dtype, device=device)

    def _read(self, slot: int, seq: int) -> dict | None:
        info = self.ring.read(slot, seq, self.buf)
        return info.meta if info is not None and isinstance(info.meta, dict) else None

    def read_entry(self, slot: int, seq: int) -> PreparedEntry | None:
        """The entry announced as (slot, seq), or None when it was replaced (then run dense)."""
        meta = self._read(slot, seq)
        if meta is None:
            return None
        b, pv = self.buf, int(meta["visual_tokens"])
        return PreparedEntry((str(meta["episode"]), int(meta["index"])), b["ffn_in"][:, :pv], b["ffn_out"][:, :pv],
                             b["image_mask"], b["masks"] if meta.get("has_masks") else None)

    def read_masks(self, slot: int, seq: int) -> Tensor | None:
        """The Action Cache masks of entry (slot, seq); None when replaced or the entry has none."""
        meta = self._read(slot, seq)
        return self.buf["masks"] if meta is not None and meta.get("has_masks") else None
