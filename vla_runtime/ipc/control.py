"""Binary format of a ring's control block: the host shared-memory header every process agrees on.

Kept apart from the ring logic so the format is in one place and versioned (``FORMAT_VERSION``).
All integer fields are aligned int64 words accessed through a numpy view, so each load and store
of a sequence counter is one aligned 8-byte access that can never be seen half-written
(``struct.pack_into`` with standard sizes writes byte by byte, which a seqlock must not use).

Layout (bytes)::

    0    magic "VLARING\\0"           written last by the creator: a reader never sees a half-made block
    8    format version   16 slots   24 backend (0 host, 1 cuda)
    32   writer pid       40 writer heartbeat (time.monotonic_ns; CLOCK_MONOTONIC is system-wide)
    48   latest committed sequence (-1: none yet)
    56   payload offset in this segment (host backend)   64 slot stride (bytes)
    72   layout JSON length   80 CUDA device index   88 CUDA IPC handle length
    96   layout tag (32 ASCII hex digits)
    128  CUDA IPC handle (up to 64 bytes)
    192  creator's resource-tracker pipe inode (see ring._open_attached)   200 creation nonce
    208  header changes: +1 whenever a slot header changes (write begun, committed, aborted)
    216  call begun: 1 + the sequence the writer's call in progress will commit (0: none); 224 its stamp
    232  call done: 1 + the newest sequence a reader finished a call with (0: none); 240 its stamp
         (the call gate, ``ring.CallWords``: the one word pair a reader writes)
    256  layout JSON (the writer's SlotLayout, so a refused reader is told what differs)
    H    slot headers, SLOT_HEADER bytes each, 64-aligned:
           +0 seqlock (odd while written)  +8 payload sequence (-1: none/invalid)  +16 stamp_ns
           +24 meta length  +32 meta kind (0 none, 1 bytes, 2 JSON)  +40 CRC-32 of the header fields
           +64 metadata, META_BYTES bytes
"""

from __future__ import annotations

import struct
import zlib

from .layout import align_up

MAGIC = b"VLARING\x00"
FORMAT_VERSION = 1
GLOBAL_BYTES = 256
SLOT_HEADER = 320
META_BYTES = 256
TAG_BYTES = 32
CUDA_HANDLE_BYTES = 64

# word indices (byte offset // 8) of the global fields
W_VERSION, W_SLOTS, W_BACKEND, W_PID, W_HEARTBEAT, W_LATEST = 1, 2, 3, 4, 5, 6
W_PAYLOAD_OFFSET, W_STRIDE, W_LAYOUT_LEN, W_CUDA_DEVICE, W_CUDA_HANDLE_LEN = 7, 8, 9, 10, 11
W_TRACKER, W_NONCE = 24, 25
W_CHANGES = 26   # bumped by every change of a slot header (begin, commit, abort): ``RingBuffer.changes``
# the call gate: which call is in progress, for background work that yields to calls (``RingBuffer.call_begun``)
W_CALL_BEGUN, W_CALL_BEGUN_NS, W_CALL_DONE, W_CALL_DONE_NS = 27, 28, 29, 30
TAG_OFFSET, CUDA_HANDLE_OFFSET, LAYOUT_OFFSET = 96, 128, 256

# word offsets inside a slot header
H_SEQLOCK, H_SEQ, H_STAMP, H_META_LEN, H_META_KIND, H_CHECKSUM = 0, 1, 2, 3, 4, 5
META_OFFSET = 64

META_NONE, META_BYTES_KIND, META_JSON = 0, 1, 2

BACKEND_HOST, BACKEND_CUDA = 0, 1

_HEADER_WORDS = struct.Struct("<4q")


def headers_offset(layout_json_len: int) -> int:
    return GLOBAL_BYTES + align_up(layout_json_len)


def control_nbytes(layout_json_len: int, slots: int) -> int:
    return headers_offset(layout_json_len) + slots * SLOT_HEADER


def header_checksum(seq: int, stamp_ns: int, meta_len: int, meta_kind: int, meta: bytes | memoryview) -> int:
    """CRC-32 over a slot header's fields. Races are the seqlock's job; this catches a header whose
    seqlock says "complete" but whose fields disagree (a foreign process or a bug scribbling on the
    segment), so such a slot is refused instead of handed out with a wrong sequence or stamp."""
    return zlib.crc32(meta, zlib.crc32(_HEADER_WORDS.pack(seq, stamp_ns, meta_len, meta_kind)))
