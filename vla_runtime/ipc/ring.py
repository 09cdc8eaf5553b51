"""Single-writer, many-reader ring of fixed slots in shared memory, guarded per slot by a seqlock.

Why a seqlock and not a lock: the writer (vision node) must never wait for a slow or dead reader
(policy node, cache manager). It simply goes round the ring; a reader copies a slot into its own
preallocated tensors and afterwards checks that the slot's sequence counter did not move. If it
moved, the copy may be torn and is thrown away (``read_latest`` retries a bounded number of times,
``read`` of an announced slot reports it as overwritten).

Protocol per slot (``control.py`` has the byte layout):

- writer ``begin_write``: seqlock += 1 (odd), fence, header sequence = -1; the caller fills the
  zero-copy tensor views of the slot; ``commit``: backend completion (CUDA: stream sync), header
  fields + checksum, fence, seqlock += 1 (even), then the ring's "latest" word and heartbeat.
- reader: s1 = seqlock (odd: being written), fence, header sequence must be the wanted one,
  copy payload and header, backend completion, fence, s2 = seqlock; accepted only if s1 == s2.

A copy is accepted only if no write to the slot started before s2 was read, and a write that had
started before s1 was read would have shown an odd s1 or a different header sequence; so every
accepted copy is exactly one committed payload (``fence.py`` argues the CPU ordering).

Only the creating process writes. Other processes ``attach`` by name; the ROS side only carries
"slot k holds sequence n" notifications (``msg/SlotReady.msg``).
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Protocol

import numpy as np
import torch

from . import control as C
from .fence import make_fence
from .layout import SlotLayout, align_up

PAGE = 4096
SHM_DIR = "/dev/shm"   # where Linux keeps POSIX shared memory segments, as files
DEFAULT_READ_RETRIES = 16


class RingBufferError(RuntimeError):
    """A ring buffer cannot be created, attached or used as asked."""


class RingExistsError(RingBufferError, FileExistsError):
    """A segment of that name already exists (and was not a stale one we may replace)."""


class RingNotFoundError(RingBufferError, FileNotFoundError):
    """No ring of that name (yet)."""


class LayoutMismatchError(RingBufferError, ValueError):
    """The attaching process expects a different slot layout than the writer publishes."""


@dataclass(frozen=True)
class SlotInfo:
    """What a successful read copied: which slot, which payload sequence, its stamp and metadata."""

    slot: int
    seq: int
    stamp_ns: int
    meta: dict | bytes | None


class PinnedSlot:
    """One committed payload read in place: zero-copy views of the slot, valid while ``valid()``.

    Why: a reader that only computes from a payload (the vision node's Context Cache reads a
    reference's FFN states) need not copy it first. The seqlock still decides: whatever the
    reader computed from the views counts only if ``valid()`` holds *after* the computation
    (no write to the slot began since the pin), exactly as a copy counts only if the seqlock did
    not move during the copy. A pin never blocks the writer.
    """

    __slots__ = ("ring", "slot", "seq", "meta", "views", "_lock_word")

    def __init__(self, ring: "RingBuffer", slot: int, seq: int, meta: dict | bytes | None,
                 views: dict[str, torch.Tensor], lock_word: int) -> None:
        self.ring, self.slot, self.seq, self.meta, self.views = ring, slot, seq, meta, views
        self._lock_word = lock_word

    def valid(self) -> bool:
        """True while no write to the slot has started since the pin (reads after use count)."""
        return self.ring._pin_still_valid(self.slot, self._lock_word)

    @property
    def lock_word(self) -> int:
        """The slot's seqlock when pinned: compare with ``RingBuffer.seqlocks()`` to check many
        pins at once (equal: no write to that slot began since the pin)."""
        return self._lock_word


@dataclass
class ReadStats:
    """Per-process reader counters (never shared: readers must not write to the segment)."""

    reads: int = 0  # accepted copies
    torn_retries: int = 0  # read_latest attempts thrown away because the slot moved under the copy
    torn_giveups: int = 0  # read_latest calls that returned None after exhausting their retries
    overwritten: int = 0  # read(slot, seq) calls whose announced payload was already gone
    checksum_failures: int = 0  # stable seqlock but inconsistent header (never expected)


class _Payload(Protocol):
    """Where slot payloads live (host shared memory or a CUDA allocation) and how to order them."""

    views: list[dict[str, torch.Tensor]]  # per slot, per field: zero-copy tensor views

    def writes_done(self) -> None: ...  # writer's stores complete, before the seqlock release

    def copies_done(self) -> None: ...  # reader's copies complete, before the seqlock re-read

    def close(self) -> None: ...


class HostPayload:
    """Slots in the same POSIX segment as the control block, viewed with ``torch.frombuffer``."""

    def __init__(self, buf: mmap.mmap, offset: int, stride: int, layout: SlotLayout, slots: int) -> None:
        # numpy holds a buffer export of the mapping and torch holds the array: the views keep the
        # mapping alive (torch.frombuffer alone would not, and a view could outlive the mapping)
        base = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=stride * slots, offset=offset))
        self.views = [_field_views(base[s * stride:(s + 1) * stride], layout) for s in range(slots)]

    def writes_done(self) -> None:
        return None

    def copies_done(self) -> None:
        return None

    def close(self) -> None:
        self.views = []


def _field_views(slot_bytes: torch.Tensor, layout: SlotLayout) -> dict[str, torch.Tensor]:
    """Typed, shaped views of one slot's bytes (offsets are 64-aligned, so dtype views are legal)."""
    return {f.name: slot_bytes[off:off + f.nbytes].view(f.dtype).view(f.shape)
            for f, off in zip(layout.fields, layout.offsets)}


class SlotWriter:
    """The open write of one slot: fill ``tensors`` (or ``writer[name]``) in place, then ``commit``.

    One instance per slot is made at creation and reused, so a write allocates nothing. Used as a
    context manager it aborts when the block raises or ends without a commit.
    """

    __slots__ = ("_ring", "slot", "seq", "tensors", "_open")

    def __init__(self, ring: "RingBuffer", slot: int) -> None:
        # a proxy, not a reference: no ring <-> writer cycle, so dropping the ring closes it at once
        self._ring, self.slot, self.seq, self._open = weakref.proxy(ring), slot, -1, False
        self.tensors: dict[str, torch.Tensor] = ring._payload.views[slot]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def commit(self, meta: dict | bytes | None = None, stamp_ns: int | None = None) -> tuple[int, int]:
        """Publish the slot; returns (slot index, payload sequence) to announce to readers.

        ``meta``: a dict (stored as compact JSON) or bytes, at most 256 bytes encoded; ``stamp_ns``:
        the payload's stamp (e.g. the observation time), default ``time.monotonic_ns()`` now.
        A ValueError/TypeError for bad metadata leaves the write open (nothing is published).
        """
        if not self._open:
            raise RingBufferError(f"slot {self.slot} is not open for writing (commit/abort already called)")
        return self._ring._commit(self, meta, stamp_ns)

    def abort(self) -> None:
        """Give the slot up: it is left marked as holding no payload (readers skip it)."""
        if self._open:
            self._ring._abort(self)

    def __enter__(self) -> "SlotWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` names a live (non-zombie) process. PIDs can be reused after a crash; the
    heartbeat in ``writer_alive`` is the second, independent test."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _tracker_id() -> int:
    """Identity (pipe inode) of this process's multiprocessing resource tracker; 0 if none.

    Spawned and forked children inherit their parent's tracker pipe, so equal ids mean one tracker.
    """
    rt = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(rt, "_fd", None)
    if fd is None:
        return 0
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return 0


def _create_segment_raw(name: str, size: int) -> SharedMemory:
    """A new segment, registered with this process's resource tracker.

    The registration is a safety net: if the whole process tree dies without ``close()``, the
    tracker unlinks the segment; ``close()`` unlinks (and unregisters) it normally, and a segment
    left by a SIGKILLed tree is removed by ``create(..., replace_stale=True)``.
    """
    return SharedMemory(name=name, create=True, size=size)


def _open_attached(name: str) -> SharedMemory:
    """Open an existing segment without letting *our* resource tracker adopt it.

    Before Python 3.13 every ``SharedMemory`` registers with the resource tracker, which unlinks it
    when the last process using that tracker exits: a reader that is an independent process (its
    own tracker, e.g. another ROS node) would destroy the writer's ring on exit. So a reader
    unregisters again, unless it shares the creator's tracker (a spawned child), where the
    registration is a no-op in the tracker's set and unregistering would drop the creator's entry.
    """
    try:
        return SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]  # Python >= 3.13
    except TypeError:
        pass
    shm = SharedMemory(name=name, create=False)
    creator = 0
    if shm.size >= C.GLOBAL_BYTES and bytes(shm.buf[0:8]) == C.MAGIC:
        w = np.ndarray((C.GLOBAL_BYTES // 8,), dtype=np.int64, buffer=shm.buf)
        creator = int(w[C.W_TRACKER])
        del w
    mine = _tracker_id()
    if creator == 0 or mine == 0 or creator != mine:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _shm_inode(shm: SharedMemory) -> int | None:
    """The inode of a segment under ``SHM_DIR`` (Linux), None where POSIX shared memory lives elsewhere."""
    if not os.path.isdir(SHM_DIR):
        return None
    return os.fstat(shm._fd).st_ino  # type: ignore[attr-defined]


def _segment_nonce(name: str) -> int | None:
    """The creation nonce of the initialised ring the name ``name`` names now (None: none).

    Reads the control block with ``pread`` from ``/dev/shm`` (Linux: where POSIX shared memory
    lives) instead of mapping the segment, so no resource-tracker traffic is caused.
    """
    if not os.path.isdir(SHM_DIR):  # not Linux: map it instead (opening a file under a missing
        try:                          # SHM_DIR would say "no such segment" for every name)
            shm = _open_attached(name)
        except FileNotFoundError:
            return None
        try:
            ok = shm.size >= C.GLOBAL_BYTES and bytes(shm.buf[0:8]) == C.MAGIC
            return _read_word(shm.buf, C.W_NONCE) if ok else None
        finally:
            shm.close()
    words = _pread_control_words(name)
    return None if words is None else int(words[C.W_NONCE])


def _pread_control_words(name: str) -> np.ndarray | None:
    """The global words of the initialised ring ``name`` under ``SHM_DIR``, read with one
    ``pread`` (no mapping, no resource-tracker traffic); None when there is none."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        head = os.pread(fd, C.GLOBAL_BYTES, 0)
    finally:
        os.close(fd)
    if len(head) < C.GLOBAL_BYTES or head[0:8] != C.MAGIC:
        return None
    return np.frombuffer(head, dtype=np.int64)


@dataclass(frozen=True)
class CallWords:
    """The call gate of a ring at one moment (``RingBuffer.call_begun`` / ``call_done``)."""

    begun: int        # 1 + the sequence of the newest call begun (0: none)
    begun_ns: int     # time.monotonic_ns() when it began
    done: int         # 1 + the newest sequence a reader finished a call with (0: none)
    done_ns: int

    @classmethod
    def of(cls, words: np.ndarray) -> "CallWords":
        """The gate's four words out of a ring's control words (mapped or read from the file)."""
        return cls(int(words[C.W_CALL_BEGUN]), int(words[C.W_CALL_BEGUN_NS]), int(words[C.W_CALL_DONE]),
                   int(words[C.W_CALL_DONE_NS]))

    @property
    def in_flight(self) -> bool:
        """A call was begun and no reader has finished it (nor a later one) yet."""
        return self.begun > self.done

    def last_call_s(self) -> float | None:
        """How long the newest call took from its start to its reader's end; None while it runs
        or when the reader last finished another call. (After an abandoned call the start is
        that call's: a shorter figure, which only shortens the waits that use it.)"""
        if self.begun == 0 or self.begun != self.done or self.done_ns < self.begun_ns:
            return None
        return (self.done_ns - self.begun_ns) / 1e9


def read_call_words(name: str) -> CallWords | None:
    """The call gate of ring ``name`` without attaching it (one ``pread`` of its control block
    from ``/dev/shm``, as ``_segment_nonce``): None when no initialised ring has that name or
    POSIX shared memory is not under ``SHM_DIR`` (no gate there)."""
    w = _pread_control_words(name)
    if w is None:
        return None
    return CallWords.of(w)


def _read_word(buf: Any, index: int) -> int:
    w = np.ndarray((C.GLOBAL_BYTES // 8,), dtype=np.int64, buffer=buf)
    value = int(w[index])
    del w
    return value


def _words(buf: Any, nbytes: int) -> np.ndarray:
    return np.ndarray((nbytes // 8,), dtype=np.int64, buffer=buf)


def _map_segment(shm: SharedMemory) -> mmap.mmap:
    """Our own mapping of the segment, which nothing ever closes explicitly.

    Every array and tensor view of the ring holds a reference to it, so the memory stays mapped
    exactly as long as any view is alive: a view kept past ``close()`` reads stale-but-valid
    memory instead of faulting, and ``close()`` never has to fail because views exist.
    """
    return mmap.mmap(shm._fd, shm.size)  # type: ignore[attr-defined]


class RingBuffer:
    """A ring of ``slots`` payload slots of one ``SlotLayout``; see the module docstring.

    Use ``RingBuffer.create`` in the writer (owner) and ``RingBuffer.attach`` in readers. Not
    picklable: other processes attach by name.
    """

    def __init__(self, *, name: str, layout: SlotLayout, shm: SharedMemory, owner: bool,
                 read_retries: int, cuda_alloc: Any = None, _token: object = None) -> None:
        if _token is not _TOKEN:
            raise TypeError("use RingBuffer.create(...) or RingBuffer.attach(...)")
        if read_retries < 1:
            raise ValueError(f"read_retries must be >= 1, got {read_retries}")
        self.name, self.layout, self.is_owner, self.read_retries = name, layout, owner, read_retries
        self.stats = ReadStats()
        self._closed = True  # until fully built, so __del__/close of a half-built ring do nothing
        self._shm = shm  # kept for its name (unlink); its own mapping is closed below
        self._map = _map_segment(shm)
        self._inode = _shm_inode(shm)
        shm.close()
        self._fence = make_fence()
        self.slots = _read_word(self._map, C.W_SLOTS)
        json_len = _read_word(self._map, C.W_LAYOUT_LEN)
        self._hdr = C.headers_offset(json_len)
        self._w = _words(self._map, C.control_nbytes(json_len, self.slots))
        self._hw = self._hdr // 8  # word index of slot 0's header
        self._nonce, self._tracker = int(self._w[C.W_NONCE]), int(self._w[C.W_TRACKER])
        try:
            self._payload: _Payload = self._open_payload(cuda_alloc)
        except BaseException:
            self._w = None  # type: ignore[assignment]  # release the buffer export so the caller can close
            raise
        self._writers = [SlotWriter(self, s) for s in range(self.slots)] if owner else []
        self._pending: SlotWriter | None = None
        self._next_seq = 0
        self._closed = False

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, name: str, layout: SlotLayout, slots: int, *, replace_stale: bool = False,
               backend: str = "cpu", device: int | None = None,
               read_retries: int = DEFAULT_READ_RETRIES) -> "RingBuffer":
        """Allocate the segment (and the payload) once; this process becomes the only writer.

        An existing segment of that name is refused, unless ``replace_stale`` and its writer
        process is dead (crash cleanup on restart); a live writer's segment is never replaced.
        ``backend="cuda"`` puts the payload in one device allocation (``cuda.py``).
        """
        if not isinstance(layout, SlotLayout):
            raise ValueError(f"layout must be a SlotLayout, got {type(layout).__name__}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
        cuda_alloc = None
        if backend == "cuda":
            from .cuda import CudaAllocation

            cuda_alloc = CudaAllocation.allocate(align_up(layout.nbytes, 256) * slots, device)
        try:
            layout_json = layout.to_json().encode()
            ctrl = align_up(C.control_nbytes(len(layout_json), slots), PAGE)
            stride = align_up(layout.nbytes, PAGE if backend == "cpu" else 256)
            size = ctrl + (stride * slots if backend == "cpu" else 0)
            shm = cls._create_segment(name, size, replace_stale)
            tracker = _tracker_id()
        except BaseException:
            if cuda_alloc is not None:
                cuda_alloc.free()
            raise
        try:
            w = _words(shm.buf, C.control_nbytes(len(layout_json), slots))
            w[C.W_VERSION], w[C.W_SLOTS] = C.FORMAT_VERSION, slots
            w[C.W_BACKEND] = C.BACKEND_HOST if backend == "cpu" else C.BACKEND_CUDA
            w[C.W_PID], w[C.W_HEARTBEAT], w[C.W_LATEST] = os.getpid(), time.monotonic_ns(), -1
            w[C.W_TRACKER], w[C.W_NONCE] = tracker, secrets.randbits(62) + 1
            w[C.W_PAYLOAD_OFFSET], w[C.W_STRIDE], w[C.W_LAYOUT_LEN] = ctrl, stride, len(layout_json)
            shm.buf[C.TAG_OFFSET:C.TAG_OFFSET + C.TAG_BYTES] = layout.tag.encode()
            shm.buf[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + len(layout_json)] = layout_json
            if cuda_alloc is not None:
                handle = cuda_alloc.ipc_handle()
                w[C.W_CUDA_DEVICE], w[C.W_CUDA_HANDLE_LEN] = cuda_alloc.device, len(handle)
                shm.buf[C.CUDA_HANDLE_OFFSET:C.CUDA_HANDLE_OFFSET + len(handle)] = handle
            hw = C.headers_offset(len(layout_json)) // 8
            for s in range(slots):
                w[hw + s * (C.SLOT_HEADER // 8) + C.H_SEQ] = -1
            del w
            shm.buf[0:8] = C.MAGIC  # last: attachers wait for it
            return cls(name=name, layout=layout, shm=shm, owner=True, read_retries=read_retries,
                       cuda_alloc=cuda_alloc, _token=_TOKEN)
        except BaseException:
            if cuda_alloc is not None:
                cuda_alloc.free()
            shm.close()
            _unlink(shm)
            raise

    @staticmethod
    def _create_segment(name: str, size: int, replace_stale: bool) -> SharedMemory:
        try:
            return _create_segment_raw(name, size)
        except FileExistsError:
            pass
        pid = RingBuffer._segment_writer_pid(name)
        if not replace_stale:
            alive = "" if pid is None else f" (writer pid {pid}, {'alive' if _pid_alive(pid) else 'dead'})"
            raise RingExistsError(f"shared memory segment {name!r} already exists{alive}; another writer owns "
                                  f"it, or a crashed one left it: pass replace_stale=True to remove a dead "
                                  f"writer's segment") from None
        if pid is None:
            raise RingExistsError(f"shared memory segment {name!r} exists but is not an initialised vla_runtime "
                                  f"ring; refusing to remove it (delete /dev/shm/{name} by hand if it is yours)")
        if _pid_alive(pid):
            raise RingExistsError(f"ring {name!r} is owned by a live writer (pid {pid}); refusing to replace it")
        old = SharedMemory(name=name, create=False)  # registered here, unregistered by the unlink
        old.close()
        _unlink(old)
        return _create_segment_raw(name, size)

    @staticmethod
    def _segment_writer_pid(name: str) -> int | None:
        """The writer pid recorded in an existing segment, or None if it is not one of our rings."""
        try:
            shm = _open_attached(name)
        except FileNotFoundError:
            return None
        try:
            if shm.size < C.GLOBAL_BYTES or bytes(shm.buf[0:8]) != C.MAGIC:
                return None
            w = np.ndarray((C.GLOBAL_BYTES // 8,), dtype=np.int64, buffer=shm.buf)
            pid = int(w[C.W_PID])
            del w
            return pid
        finally:
            shm.close()

    @classmethod
    def attach(cls, name: str, layout: SlotLayout, *, timeout_s: float = 0.0,
               read_retries: int = DEFAULT_READ_RETRIES) -> "RingBuffer":
        """Open an existing ring as a reader; waits up to ``timeout_s`` for the writer to create it.

        Refuses a segment that is not a vla_runtime ring, has another format version, or carries
        another layout tag (the error names what differs).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                shm = _open_attached(name)
                if shm.size >= C.GLOBAL_BYTES and bytes(shm.buf[0:8]) == C.MAGIC:
                    break
                why = "is not an initialised vla_runtime ring (bad magic)"
                shm.close()
            except FileNotFoundError:
                why = "does not exist"
            if time.monotonic() >= deadline:
                raise RingNotFoundError(f"ring {name!r} {why}" + (f" after waiting {timeout_s:g}s" if timeout_s else ""))
            time.sleep(0.005)
        try:
            cls._check_compatible(name, shm, layout)
            return cls(name=name, layout=layout, shm=shm, owner=False, read_retries=read_retries, _token=_TOKEN)
        except BaseException:
            shm.close()
            raise

    @staticmethod
    def peek_layout(name: str) -> SlotLayout:
        """The layout a ring's writer created it with, for a reader that adopts it (the working set's
        shapes depend on the repository the cache manager opened, which other nodes do not read)."""
        try:
            shm = _open_attached(name)
        except FileNotFoundError:
            raise RingNotFoundError(f"ring {name!r} does not exist") from None
        try:
            if shm.size < C.GLOBAL_BYTES or bytes(shm.buf[0:8]) != C.MAGIC:
                raise RingBufferError(f"ring {name!r} is not an initialised vla_runtime ring (bad magic)")
            w = np.ndarray((C.GLOBAL_BYTES // 8,), dtype=np.int64, buffer=shm.buf)
            json_len = int(w[C.W_LAYOUT_LEN])
            del w
            try:
                return SlotLayout.from_json(bytes(shm.buf[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + json_len]).decode())
            except (ValueError, KeyError, TypeError) as e:
                raise RingBufferError(f"ring {name!r}: the writer's layout description is unreadable ({e})") from None
        finally:
            shm.close()

    @staticmethod
    def _check_compatible(name: str, shm: SharedMemory, layout: SlotLayout) -> None:
        w = np.ndarray((C.GLOBAL_BYTES // 8,), dtype=np.int64, buffer=shm.buf)
        version, json_len = int(w[C.W_VERSION]), int(w[C.W_LAYOUT_LEN])
        del w
        if version != C.FORMAT_VERSION:
            raise RingBufferError(f"ring {name!r} has control-block format version {version}, this reader "
                                  f"understands {C.FORMAT_VERSION}")
        tag = bytes(shm.buf[C.TAG_OFFSET:C.TAG_OFFSET + C.TAG_BYTES]).decode("ascii", "replace")
        if tag != layout.tag:
            try:
                theirs = SlotLayout.from_json(bytes(shm.buf[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + json_len]).decode())
                what = layout.diff(theirs)
            except (ValueError, KeyError, TypeError):
                what = "writer's layout description unreadable"
            raise LayoutMismatchError(f"ring {name!r}: layout tag {tag} != this reader's {layout.tag} "
                                      f"(reader vs writer: {what})")

    def _open_payload(self, cuda_alloc: Any) -> _Payload:
        w = self._w
        stride = int(w[C.W_STRIDE])
        if int(w[C.W_BACKEND]) == C.BACKEND_HOST:
            return HostPayload(self._map, int(w[C.W_PAYLOAD_OFFSET]), stride, self.layout, self.slots)
        from .cuda import CudaAllocation, CudaPayload

        if cuda_alloc is None:  # a reader: open the writer's allocation through its IPC handle
            n = int(w[C.W_CUDA_HANDLE_LEN])
            handle = self._map[C.CUDA_HANDLE_OFFSET:C.CUDA_HANDLE_OFFSET + n]
            cuda_alloc = CudaAllocation.open_ipc(handle, int(w[C.W_CUDA_DEVICE]), stride * self.slots)
        return CudaPayload(cuda_alloc, stride, self.layout, self.slots)

    # ---------------------------------------------------------------- writer

    def _hword(self, slot: int, field: int) -> int:
        return self._hw + slot * (C.SLOT_HEADER // 8) + field

    def begin_write(self, slot: int | None = None) -> SlotWriter:
        """Open the next slot (round robin) for writing; never waits for readers.

        ``slot`` picks the slot instead, for a writer that keeps long-lived payloads (the cache
        manager's working set replaces entries, not the oldest slot); sequences still grow by one.
        """
        self._check_open()
        if slot is not None and not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        self._check_owner("writes")
        if self._pending is not None:
            raise RingBufferError(f"slot {self._pending.slot} (sequence {self._pending.seq}) is still open: "
                                  f"commit or abort it before the next begin_write")
        seq = self._next_seq
        wr = self._writers[seq % self.slots if slot is None else slot]
        lock = self._hword(wr.slot, C.H_SEQLOCK)
        self._w[lock] = int(self._w[lock]) + 1  # odd: being written
        self._fence()
        self._w[self._hword(wr.slot, C.H_SEQ)] = -1
        self._bump_changes()
        wr.seq, wr._open, self._pending = seq, True, wr
        return wr

    def _commit(self, wr: SlotWriter, meta: dict | bytes | None, stamp_ns: int | None) -> tuple[int, int]:
        kind, blob = _encode_meta(meta)
        stamp = time.monotonic_ns() if stamp_ns is None else int(stamp_ns)
        self._payload.writes_done()
        w, s, buf = self._w, wr.slot, self._map
        w[self._hword(s, C.H_SEQ)], w[self._hword(s, C.H_STAMP)] = wr.seq, stamp
        w[self._hword(s, C.H_META_LEN)], w[self._hword(s, C.H_META_KIND)] = len(blob), kind
        meta_at = self._hdr + s * C.SLOT_HEADER + C.META_OFFSET
        buf[meta_at:meta_at + len(blob)] = blob
        w[self._hword(s, C.H_CHECKSUM)] = C.header_checksum(wr.seq, stamp, len(blob), kind, blob)
        self._fence()
        lock = self._hword(s, C.H_SEQLOCK)
        w[lock] = int(w[lock]) + 1  # even: complete
        w[C.W_LATEST] = wr.seq
        self._bump_changes()
        w[C.W_HEARTBEAT] = time.monotonic_ns()
        self._next_seq = wr.seq + 1
        wr._open, self._pending = False, None
        return s, wr.seq

    def _abort(self, wr: SlotWriter) -> None:
        self._fence()
        lock = self._hword(wr.slot, C.H_SEQLOCK)
        self._w[lock] = int(self._w[lock]) + 1  # even again; header sequence stays -1 (no payload)
        self._bump_changes()
        wr._open, self._pending = False, None

    def _bump_changes(self) -> None:
        """After a header change: the count a reader compares moves only once the change is visible."""
        self._fence()
        self._w[C.W_CHANGES] += 1

    def heartbeat(self) -> None:
        """Tell readers the writer is alive while it has nothing to publish."""
        self._check_open()
        if not self.is_owner:
            raise RingBufferError("only the ring's creator updates its heartbeat")
        self._w[C.W_HEARTBEAT] = time.monotonic_ns()

    # ---------------------------------------------------------------- the call gate

    def call_begun(self) -> None:
        """The writer starts a call whose payload its next commit will hold (the vision stage, as
        an observation's encoding begins): background work reading ``read_call_words`` yields to it."""
        self._check_owner("marks a call begun")
        self._w[C.W_CALL_BEGUN_NS] = time.monotonic_ns()
        self._fence()
        self._w[C.W_CALL_BEGUN] = self._next_seq + 1

    def call_words(self) -> CallWords:
        """The call gate as this mapping holds it now (``read_call_words`` for a process that has
        the ring attached or owns it: no file read)."""
        self._check_open()
        return CallWords.of(self._w)

    def call_abandoned(self) -> None:
        """The call ``call_begun`` announced commits nothing (its encoding failed): the newest call
        begun is the last committed one again, which a reader may still be finishing."""
        self._check_owner("abandons a call")
        self._w[C.W_CALL_BEGUN] = self._next_seq

    def call_done(self, seq: int) -> None:
        """A reader finished the call of payload ``seq`` (the policy stage, chunk denoised or slot
        found overwritten). The only words a reader writes; one reader per ring does (the policy)."""
        self._check_open()
        self._w[C.W_CALL_DONE_NS] = time.monotonic_ns()
        self._fence()
        self._w[C.W_CALL_DONE] = max(int(self._w[C.W_CALL_DONE]), int(seq) + 1)

    def _check_owner(self, what: str) -> None:
        self._check_open()
        if not self.is_owner:
            raise RingBufferError(f"ring {self.name!r} was attached, not created, by this process: only its "
                                  f"creator {what}")

    # ---------------------------------------------------------------- reader

    @property
    def latest_seq(self) -> int:
        """Sequence of the newest committed payload (-1 before the first commit)."""
        self._check_open()
        return int(self._w[C.W_LATEST])

    def read_latest(self, out: dict[str, torch.Tensor], min_seq: int = 0) -> SlotInfo | None:
        """Copy the newest committed payload with sequence >= ``min_seq`` into ``out``.

        ``out`` maps field names (all or some of the layout's) to preallocated tensors of the
        field's shape. Returns None when nothing new is there, or when ``read_retries`` attempts
        all raced with the writer (``stats.torn_giveups``); ``out`` is then unspecified.
        """
        self._check_open()
        self._check_out(out)
        for _ in range(self.read_retries):
            latest = int(self._w[C.W_LATEST])
            if latest < 0 or latest < min_seq:
                return None
            info = self._try_read(latest % self.slots, latest, out)
            if info is not None:
                return info
            self.stats.torn_retries += 1
        self.stats.torn_giveups += 1
        return None

    def read(self, slot: int, seq: int, out: dict[str, torch.Tensor]) -> SlotInfo | None:
        """Copy the announced payload "slot ``slot`` holds sequence ``seq``" into ``out``.

        Returns None (``stats.overwritten``) if the writer has reused the slot since, before or
        during the copy: that payload is gone for good, so there is nothing to retry.
        """
        self._check_open()
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        self._check_out(out)
        info = self._try_read(slot, seq, out)
        if info is None:
            self.stats.overwritten += 1
        return info

    def slot_seq(self, slot: int) -> int:
        """The sequence slot ``slot`` holds now (-1: empty or being written): one word, no copy, a
        hint to decide whether a slot changed since it was last read (``pin`` then checks)."""
        self._check_open()
        w = self._w
        if int(w[self._hword(slot, C.H_SEQLOCK)]) & 1:
            return -1
        return int(w[self._hword(slot, C.H_SEQ)])

    @property
    def changes(self) -> int:
        """How many times a slot header changed (a write begun, committed or aborted): read before
        ``slot_seqs``, an equal count later means no slot changed since (one word, no header read)."""
        self._check_open()
        n = int(self._w[C.W_CHANGES])
        self._fence()   # the headers read after this are no older than the count
        return n

    def slot_seqs(self) -> np.ndarray:
        """``slot_seq`` of every slot at once (one vectorised read of the headers)."""
        self._check_open()
        step = C.SLOT_HEADER // 8
        locks = self._w[self._hw + C.H_SEQLOCK: self._hw + self.slots * step: step]
        seqs = self._w[self._hw + C.H_SEQ: self._hw + self.slots * step: step].astype(np.int64)
        return np.where(locks & 1, -1, seqs)

    def unchanged_since(self, changes: int) -> bool:
        """Read after the caller's reads of pinned views are complete: True when no slot header
        changed since ``changes`` was read (``changes``), so every pin taken after that read is
        still valid (one word, where ``seqlocks`` reads every slot's)."""
        self._check_open()
        self._payload.copies_done()
        self._fence()
        return int(self._w[C.W_CHANGES]) == changes

    def seqlocks(self) -> np.ndarray:
        """Every slot's seqlock now (a copy), read after the caller's reads of pinned views are
        complete: where it equals a pin's ``lock_word``, that pin is still valid (``valid()``
        for all slots at once, one vectorised read of the headers)."""
        self._check_open()
        self._payload.copies_done()
        self._fence()
        step = C.SLOT_HEADER // 8
        return self._w[self._hw + C.H_SEQLOCK: self._hw + self.slots * step: step].astype(np.int64)

    def field_view(self, name: str) -> torch.Tensor:
        """Field ``name`` of every slot as one ``[slots, *shape]`` tensor, without a copy.

        Slots sit ``stride`` bytes apart in one allocation, so the field of slot s is the field of
        slot 0 moved by s strides: a reader can compute over all slots at once (the working set's
        retrieval features, one matrix-vector product) instead of copying them out. Like a pin's
        views, what it reads counts only for slots whose pins are still valid afterwards."""
        self._check_open()
        first = self._payload.views[0][name]
        step, rem = divmod(int(self._w[C.W_STRIDE]), first.element_size())
        if rem:   # strides are page (host) or 256-byte (CUDA) multiples: never expected
            raise RingBufferError(f"ring {self.name!r}: slot stride is not a multiple of field {name!r}'s "
                                  f"{first.element_size()}-byte elements")
        return first.as_strided((self.slots, *first.shape), (step, *first.stride()), first.storage_offset())

    def pin(self, slot: int, seq: int | None = None) -> PinnedSlot | None:
        """The payload in ``slot`` (sequence ``seq``; None: whatever committed payload is there) as
        zero-copy views, or None when the slot is empty, being written or holds another sequence.

        Check ``PinnedSlot.valid()`` after using the views: only then was what they held one
        committed payload throughout. The header (sequence, metadata) is checked here as a read
        checks it.
        """
        self._check_open()
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        w, lock = self._w, self._hword(slot, C.H_SEQLOCK)
        s1 = int(w[lock])
        if s1 & 1:
            return None
        self._fence()
        have = int(w[self._hword(slot, C.H_SEQ)])
        if have < 0 or (seq is not None and have != seq):
            return None
        stamp, n, kind = int(w[self._hword(slot, C.H_STAMP)]), int(w[self._hword(slot, C.H_META_LEN)]), \
            int(w[self._hword(slot, C.H_META_KIND)])
        crc = int(w[self._hword(slot, C.H_CHECKSUM)])
        meta_at = self._hdr + slot * C.SLOT_HEADER + C.META_OFFSET
        blob = bytes(self._map[meta_at:meta_at + max(0, min(n, C.META_BYTES))])
        self._fence()
        if int(w[lock]) != s1 or crc != C.header_checksum(have, stamp, n, kind, blob):
            return None
        return PinnedSlot(self, slot, have, _decode_meta(kind, blob), self._payload.views[slot], s1)

    def _pin_still_valid(self, slot: int, lock_word: int) -> bool:
        self._payload.copies_done()
        self._fence()
        return not self._closed and int(self._w[self._hword(slot, C.H_SEQLOCK)]) == lock_word

    def clear_slot(self, slot: int) -> None:
        """Mark ``slot`` empty (its header sequence -1): readers and pins of its old payload fail
        from now on. For a writer whose slots hold long-lived entries (the working set)."""
        self.begin_write(slot).abort()

    def _try_read(self, slot: int, seq: int, out: dict[str, torch.Tensor]) -> SlotInfo | None:
        w, lock = self._w, self._hword(slot, C.H_SEQLOCK)
        s1 = int(w[lock])
        if s1 & 1:
            return None
        self._fence()
        if int(w[self._hword(slot, C.H_SEQ)]) != seq:
            return None
        views = self._payload.views[slot]
        for name, dst in out.items():
            dst.copy_(views[name])
        stamp, n, kind = int(w[self._hword(slot, C.H_STAMP)]), int(w[self._hword(slot, C.H_META_LEN)]), \
            int(w[self._hword(slot, C.H_META_KIND)])
        crc = int(w[self._hword(slot, C.H_CHECKSUM)])
        meta_at = self._hdr + slot * C.SLOT_HEADER + C.META_OFFSET
        blob = self._map[meta_at:meta_at + max(0, min(n, C.META_BYTES))]
        self._payload.copies_done()
        self._fence()
        if int(w[lock]) != s1:
            return None
        if crc != C.header_checksum(seq, stamp, n, kind, blob):
            self.stats.checksum_failures += 1
            return None
        self.stats.reads += 1
        return SlotInfo(slot=slot, seq=seq, stamp_ns=stamp, meta=_decode_meta(kind, blob))

    def _check_out(self, out: dict[str, torch.Tensor]) -> None:
        if not out:
            raise ValueError("out must map at least one field name to a preallocated tensor")
        views = self._payload.views[0]
        for name, dst in out.items():
            if name not in views:
                raise KeyError(f"out has field {name!r}, not in the ring's layout {list(views)}")
            if dst.shape != views[name].shape:
                raise ValueError(f"out[{name!r}] has shape {tuple(dst.shape)}, the layout says "
                                 f"{tuple(views[name].shape)}")

    # ---------------------------------------------------------------- liveness

    @property
    def writer_pid(self) -> int:
        self._check_open()
        return int(self._w[C.W_PID])

    def heartbeat_age_s(self) -> float:
        self._check_open()
        return (time.monotonic_ns() - int(self._w[C.W_HEARTBEAT])) / 1e9

    def writer_alive(self, deadline_s: float) -> bool:
        """Heartbeat fresher than ``deadline_s`` and the writer process exists (not a zombie).
        A writer that closed its ring clears its pid, so it reads as gone at once."""
        return self.heartbeat_age_s() <= deadline_s and _pid_alive(self.writer_pid)

    def superseded(self) -> bool:
        """True when a reader's mapping is no longer the ring to read: its writer closed it or died,
        or the name now names another segment (a restarted writer created a new one).

        A restarted writer's sequences start again at 0, so an announcement "slot k holds
        sequence n" of the new ring can match a payload left in the old mapping: a reader must
        re-attach (by name) when this is True, before it reads an announced slot. Cheap enough
        to ask before every read (a pid probe and an 8-byte read of the named segment's header).
        The owner's own mapping is never superseded.
        """
        self._check_open()
        if self.is_owner:
            return False
        return not _pid_alive(int(self._w[C.W_PID])) or _segment_nonce(self.name) != self._nonce

    def replaced(self) -> bool:
        """True when the name now names another segment, or none (a restarted writer created a new
        one, or the writer closed it). Unlike ``superseded`` a dead writer alone does not count:
        for a ring whose committed payloads stay valid until rewritten (the working set), a dead
        writer's last payloads are still exactly what they were, and reading them is safe."""
        self._check_open()
        if self.is_owner:
            return False
        if self._inode is not None:   # one stat (asked before every call): our mapping keeps our inode in use,
            try:                      # so the name names our segment exactly when it names that inode
                return os.stat(os.path.join(SHM_DIR, self.name)).st_ino != self._inode
            except FileNotFoundError:
                return True
        return _segment_nonce(self.name) != self._nonce

    # ---------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RingBufferError(f"ring {self.name!r} is closed")

    def close(self) -> None:
        """Release this process's mapping; the owner also unlinks the segment. Idempotent.

        Tensors obtained from ``begin_write`` should not be kept past ``close``; if some are, the
        mapping lives on until they are freed (they never dangle).
        """
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._pending.abort()
        if self.is_owner:
            self._w[C.W_PID] = 0  # readers holding the old mapping see the writer as gone
        self._payload.close()
        self._writers, self._w, self._map = [], None, None  # type: ignore[assignment]
        if self.is_owner:
            self._unlink_if_ours()

    def _unlink_if_ours(self) -> None:
        """Unlink the name only if it still names *our* segment: after a ``replace_stale`` by a new
        writer (we were presumed dead), the name belongs to the new ring and must survive us."""
        try:
            current = _open_attached(self.name)
        except FileNotFoundError:
            current = None
        shared_tracker = False
        if current is not None:
            try:
                valid = current.size >= C.GLOBAL_BYTES and bytes(current.buf[0:8]) == C.MAGIC
                ours = valid and _read_word(current.buf, C.W_NONCE) == self._nonce
                shared_tracker = valid and _read_word(current.buf, C.W_TRACKER) == int(self._tracker)
            finally:
                current.close()
            if ours:
                _unlink(self._shm)
                return
        if not shared_tracker:  # the new owner's tracker entry (same name, same tracker) must stay
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]

    def __enter__(self) -> "RingBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self) -> Any:
        raise TypeError("a RingBuffer cannot be pickled: call RingBuffer.attach(name, layout) in the other process")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("writer" if self.is_owner else "reader")
        return f"RingBuffer({self.name!r}, slots={self.slots}, tag={self.layout.tag}, {state})"


_TOKEN = object()


def _unlink(shm: SharedMemory) -> None:
    """Remove the segment's name (mappings stay valid until closed); already gone is fine."""
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _encode_meta(meta: dict | bytes | None) -> tuple[int, bytes]:
    """Metadata is up to ``META_BYTES`` (256) bytes: raw bytes, or a dict stored as compact JSON."""
    if meta is None:
        return C.META_NONE, b""
    if isinstance(meta, (bytes, bytearray, memoryview)):
        kind, blob = C.META_BYTES_KIND, bytes(meta)
    elif isinstance(meta, dict):
        kind, blob = C.META_JSON, json.dumps(meta, separators=(",", ":")).encode()
    else:
        raise TypeError(f"slot metadata must be a dict, bytes or None, got {type(meta).__name__}")
    if len(blob) > C.META_BYTES:
        raise ValueError(f"slot metadata is {len(blob)} bytes encoded, the slot header holds {C.META_BYTES}")
    return kind, blob


def _decode_meta(kind: int, blob: bytes) -> dict | bytes | None:
    if kind == C.META_JSON:
        return json.loads(blob)
    return blob if kind == C.META_BYTES_KIND else None
