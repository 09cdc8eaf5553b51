"""The reference working set in shared memory: the cache manager publishes prepared entries, the
vision process selects among them, reads their FFN states in place (Context Cache) and passes
their masks on to the policy in the call's prefix slot (Action Cache).

The cache manager process keeps the sliding window of rMuscle (T episodes x (L + 1) positions);
each prepared entry it reconstructs goes into a slot of a ring buffer of its own, chosen among the
slots no live entry holds, together with what selection needs (the stored call's retrieval
features and joint history). A slot whose entry leaves the window is cleared at once. A reader
names an entry as "slot s holds sequence n": finding another sequence there (the entry was
replaced since) means that call runs dense, which is always correct.

Why the window is published rather than asked for: reference selection runs in the process that
needs the answer (``window_view.WindowView`` reads the window in place), so no call ever waits for
the cache manager, which may be busy rebuilding entries or gone.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from ..cache.entry import EntryKey, PreparedEntry
from ..ipc.layout import FieldSpec, SlotLayout
from ..ipc.ring import PinnedSlot, RingBuffer, RingBufferError
from ..models.config import Pi05Config

DEFAULT_WORKING_SET = "vla_refs"


def working_set_layout(cfg: Pi05Config, mask_groups: int, mask_size: int, dtype: torch.dtype,
                       retrieval_shape: tuple[int, int] | None = None,
                       history_shape: tuple[int, int] | None = None) -> SlotLayout:
    """One slot holds one prepared entry at the model's largest camera layout (fewer cameras use
    the first rows; the slot's metadata says how many cameras and visual tokens are valid), and,
    when selection reads the window, the stored call's retrieval features and joint history (the
    repository's shapes)."""
    pv = cfg.num_cameras * cfg.num_image_tokens
    ffn = (cfg.vlm.depth - 1, pv, cfg.vlm.width)
    fields = [FieldSpec("ffn_in", ffn, dtype), FieldSpec("ffn_out", ffn, dtype),
              FieldSpec("image_mask", (cfg.num_cameras,), torch.bool),
              FieldSpec("masks", (mask_groups, cfg.expert.depth, mask_size), torch.int64)]
    if retrieval_shape is not None and history_shape is not None:
        fields += [FieldSpec("retrieval", tuple(retrieval_shape), torch.float32),
                   FieldSpec("history", tuple(history_shape), torch.float32)]
    return SlotLayout(tuple(fields))


@dataclass(frozen=True)
class SharedEntry:
    """Where one prepared entry lives in the working-set ring (the manager's view of it)."""

    key: EntryKey
    slot: int
    seq: int
    size: int

    def nbytes(self) -> int:
        return self.size


def window_state(task: str, episode: int, ready: bool) -> dict:
    """What the cache manager publishes about its window: the episode it serves (the task as a
    CRC-32, slot metadata is small) and whether that episode's initial window is complete."""
    return {"task": zlib.crc32(task.encode()), "episode": int(episode), "ready": int(ready)}


class SharedEntryStore(MutableMapping[EntryKey, SharedEntry]):
    """The cache manager's ``entries``: storing a ``PreparedEntry`` copies it into a free slot.

    Slots are only reused after their entry was dropped (and the slot cleared), so an entry stays
    readable for as long as it is in the window; no allocation happens after the ring is created.
    With ``window_marker`` the ring's last slot holds no entry but the window's state
    (``mark_window``): an episode's first search waits for its initial window to be complete.
    """

    def __init__(self, ring: RingBuffer, window_marker: bool = False):
        self.ring = ring
        self._where: dict[EntryKey, SharedEntry] = {}
        self.marker_slot = ring.slots - 1 if window_marker else None
        self._free = list(range(ring.slots - (2 if window_marker else 1), -1, -1))
        self.mask_shape = tuple(ring.layout.field("masks").shape)
        self.publishes_retrieval = "retrieval" in {f.name for f in ring.layout.fields}

    def __setitem__(self, key: EntryKey, entry: PreparedEntry) -> None:
        if key in self._where:
            del self[key]
        if not self._free:
            raise RuntimeError(f"working set {self.ring.name!r} is full ({self.ring.slots} entries): "
                               "window capacity and ring slots disagree")
        pv, cams = entry.visual_tokens, entry.image_mask.numel()
        has_masks = entry.masks is not None
        if has_masks and tuple(entry.masks.shape) != self.mask_shape:
            raise ValueError(f"entry {key} has masks {tuple(entry.masks.shape)}, the working set holds "
                             f"{self.mask_shape}")
        selectable = self.publishes_retrieval and entry.retrieval is not None and entry.state_history is not None
        slot = self._free.pop()
        with self.ring.begin_write(slot) as wr:
            try:
                if cams > wr["image_mask"].numel():
                    raise ValueError(f"entry {key} has {cams} camera slots, the working set holds "
                                     f"{wr['image_mask'].numel()}")
                wr["ffn_in"][:, :pv].copy_(entry.ffn_in)
                wr["ffn_out"][:, :pv].copy_(entry.ffn_out)
                wr["image_mask"].zero_()
                wr["image_mask"][:cams].copy_(entry.image_mask)
                if has_masks:
                    wr["masks"].copy_(entry.masks)
                if selectable:
                    wr["retrieval"].copy_(entry.retrieval.reshape(wr["retrieval"].shape))
                    wr["history"].copy_(entry.state_history)
                _, seq = wr.commit({"episode": key[0], "index": int(key[1]), "visual_tokens": pv, "cameras": cams,
                                    "has_masks": int(has_masks), "selectable": int(selectable)})
            except (ValueError, TypeError, RuntimeError):
                self._free.append(slot)
                raise
        self._where[key] = SharedEntry(key, slot, seq, entry.nbytes())

    def mark_window(self, state: dict) -> None:
        """Publish the window's state (``window_state``); nothing without a marker slot."""
        if self.marker_slot is not None:
            with self.ring.begin_write(self.marker_slot) as wr:
                wr.commit({"window": state})

    def __getitem__(self, key: EntryKey) -> SharedEntry:
        return self._where[key]

    def __delitem__(self, key: EntryKey) -> None:
        slot = self._where.pop(key).slot
        self.ring.clear_slot(slot)   # readers and the selectors' views drop it from now on
        self._free.append(slot)

    def __iter__(self) -> Iterator[EntryKey]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def pinned_entry(pin: PinnedSlot) -> PreparedEntry:
    """A working-set slot as a ``PreparedEntry`` of zero-copy views (valid while ``pin.valid()``)."""
    meta, v = pin.meta, pin.views
    pv, cams = int(meta["visual_tokens"]), int(meta.get("cameras", v["image_mask"].numel()))
    return PreparedEntry((str(meta["episode"]), int(meta["index"])), v["ffn_in"][:, :pv], v["ffn_out"][:, :pv],
                         v["image_mask"][:cams], v["masks"] if meta.get("has_masks") else None)


def pin_entry(ring: RingBuffer, slot: int, seq: int) -> tuple[PreparedEntry, PinnedSlot] | None:
    """The working-set entry announced as (slot, seq), in place, or None when it was replaced
    (run dense). Whatever is computed from it counts only if ``pin.valid()`` afterwards."""
    pin = ring.pin(slot, seq)
    if pin is None or not isinstance(pin.meta, dict):
        return None
    return pinned_entry(pin), pin


def current_ring(ring: RingBuffer | None, name: str) -> RingBuffer | None:
    """The working set to read now: ``ring`` unless it was replaced (the cache manager
    restarted: a new segment, sequences from 0 again, maybe another layout, or it closed it),
    then a fresh attachment (None while there is no working set: the call runs dense, it never
    waits). A cache manager that died or stopped leaves its last window readable: its entries
    stay valid (only a writer changes a slot), so calls go on selecting from it."""
    if ring is not None and ring.replaced():
        ring.close()
        ring = None
    if ring is not None:
        return ring
    try:
        return RingBuffer.attach(name, RingBuffer.peek_layout(name))
    except (RingBufferError, OSError):   # asked again every call
        return None
