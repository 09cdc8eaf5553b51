"""Ring buffer: round trip, refusals, overwrite/torn detection, stale writers (the multi-process stress
run is in test_stress.py, with the harness it drives).

Every test uses a unique segment name and checks that nothing is left in /dev/shm afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest
import torch

from vla_runtime.ipc import control as C
from vla_runtime.ipc.layout import FieldSpec, SlotLayout
from vla_runtime.ipc.ring import (LayoutMismatchError, RingBuffer, RingBufferError, RingExistsError,
                                  RingNotFoundError)
from vla_runtime.ipc.stress import payload_matches, stamp_payload

LAYOUT = SlotLayout((FieldSpec("kv", (2, 8, 4), torch.float32), FieldSpec("state", (7,), torch.float64),
                     FieldSpec("ref", (1,), torch.int64), FieldSpec("mask", (8,), torch.uint8)))


def _segment_exists(name: str) -> bool:
    try:
        SharedMemory(name=name, create=False).close()
    except FileNotFoundError:
        return False
    # opened only to look: balance the resource-tracker registration SharedMemory made
    from multiprocessing import resource_tracker
    resource_tracker.unregister("/" + name, "shared_memory")
    return True


@pytest.fixture
def name():
    n = f"vla_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield n
    assert not _segment_exists(n), f"test leaked shared memory segment {n}"


def _out(layout: SlotLayout = LAYOUT) -> dict[str, torch.Tensor]:
    return {f.name: torch.full(f.shape, 99, dtype=f.dtype) for f in layout.fields}


def _write(ring: RingBuffer, value: int, meta=None) -> tuple[int, int]:
    with ring.begin_write() as w:
        stamp_payload(w.tensors, value)
        return w.commit(meta, stamp_ns=1000 + value)


def test_round_trip_zero_copy_views_and_metadata(name):
    with RingBuffer.create(name, LAYOUT, slots=3) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        out = _out()
        assert reader.read_latest(out) is None and reader.latest_seq == -1
        w = writer.begin_write()
        assert (w.slot, w.seq) == (0, 0)
        assert w["kv"].shape == (2, 8, 4) and w["state"].dtype == torch.float64
        w["kv"].copy_(torch.arange(64, dtype=torch.float32).view(2, 8, 4))
        w["state"].fill_(0.5)
        w["ref"].fill_(7)
        w["mask"].fill_(1)
        assert w.commit({"camera_stamp": 12, "reference": "ep3"}, stamp_ns=123) == (0, 0)
        info = reader.read_latest(out)
        assert (info.slot, info.seq, info.stamp_ns) == (0, 0, 123)
        assert info.meta == {"camera_stamp": 12, "reference": "ep3"}
        assert torch.equal(out["kv"], torch.arange(64, dtype=torch.float32).view(2, 8, 4))
        assert out["state"].eq(0.5).all() and out["ref"].item() == 7 and out["mask"].eq(1).all()
        # the writer's tensors are views of the segment: a second attach sees the bytes without a commit
        assert writer.begin_write()["kv"].data_ptr() != out["kv"].data_ptr()
        writer._pending.abort()
        _write(writer, 5, meta=b"\x00raw")
        assert reader.read_latest(out).meta == b"\x00raw"
        _write(writer, 6)
        assert reader.read_latest(out).meta is None
        # a reader may ask for a subset of the fields
        part = {"ref": torch.zeros(1, dtype=torch.int64)}
        assert reader.read_latest(part).seq == 2 and part["ref"].item() == 6


def test_read_latest_returns_the_newest_and_honours_min_seq(name):
    with RingBuffer.create(name, LAYOUT, slots=4) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        out = _out()
        for i in range(10):
            _write(writer, 100 + i, meta={"i": i})
        info = reader.read_latest(out)
        assert (info.seq, info.slot, info.meta) == (9, 9 % 4, {"i": 9})
        assert payload_matches(out, 109)
        assert reader.read_latest(out, min_seq=9).seq == 9
        assert reader.read_latest(out, min_seq=10) is None  # nothing newer yet: no wait, no retry
        assert reader.stats.torn_retries == 0 and reader.stats.reads == 2


def test_announced_slot_overwritten_is_detected(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        out = _out()
        slot, seq = _write(writer, 10)  # "slot 0 holds sequence 0" goes out over ROS ...
        assert reader.read(slot, seq, out).seq == 0 and payload_matches(out, 10)
        _write(writer, 11)
        assert reader.read(slot, seq, out) is not None  # slot 1 was used, slot 0 still intact
        _write(writer, 12)  # ... but the writer went round the ring before the reader came
        assert reader.read(slot, seq, out) is None
        assert reader.stats.overwritten == 1
        assert reader.read(0, 2, out).seq == 2 and payload_matches(out, 12)
        w = writer.begin_write()  # slot 1 being rewritten: its old payload (seq 1) is gone
        assert reader.read(1, 1, out) is None
        w.abort()  # an aborted slot holds nothing, even after the writer let go of it
        assert reader.read(1, 1, out) is None and reader.read(1, 3, out) is None
        assert reader.stats.overwritten == 4
        with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
            reader.read(2, 0, out)


def test_copy_raced_by_the_writer_is_thrown_away(name):
    """Make the writer lap the ring *during* every copy: no copy may be accepted."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, \
            RingBuffer.attach(name, LAYOUT, read_retries=5) as reader:
        _write(writer, 1)
        real = reader._payload.copies_done

        def writer_laps_during_copy():
            _write(writer, writer.latest_seq + 100)
            _write(writer, writer.latest_seq + 100)
            real()

        reader._payload.copies_done = writer_laps_during_copy
        out = _out()
        assert reader.read_latest(out) is None
        assert reader.stats.torn_retries == 5 and reader.stats.torn_giveups == 1 and reader.stats.reads == 0
        slot, seq = 1, writer.latest_seq
        assert reader.read(slot, seq, out) is None and reader.stats.overwritten == 1
        reader._payload.copies_done = real
        info = reader.read_latest(out)
        assert info.seq == writer.latest_seq and payload_matches(out, info.stamp_ns - 1000)


def test_reader_with_another_layout_is_refused_naming_the_difference(name):
    other = SlotLayout((FieldSpec("kv", (2, 9, 4), torch.float32), FieldSpec("state", (7,), torch.float64),
                        FieldSpec("ref", (1,), torch.int64), FieldSpec("mask", (8,), torch.uint8)))
    with RingBuffer.create(name, LAYOUT, slots=2):
        with pytest.raises(LayoutMismatchError, match=r"kv\[2, 9, 4\]:float32 vs kv\[2, 8, 4\]:float32"):
            RingBuffer.attach(name, other)
        with pytest.raises(LayoutMismatchError, match="version 2 vs 1"):
            RingBuffer.attach(name, SlotLayout(LAYOUT.fields, version=2))


def test_attach_refuses_missing_foreign_and_wrong_version_segments(name):
    with pytest.raises(RingNotFoundError, match="does not exist"):
        RingBuffer.attach(name, LAYOUT)
    foreign = SharedMemory(name=name, create=True, size=4096)
    try:
        with pytest.raises(RingNotFoundError, match="bad magic"):
            RingBuffer.attach(name, LAYOUT)
        with pytest.raises(RingExistsError, match="not an initialised vla_runtime ring"):
            RingBuffer.create(name, LAYOUT, 2, replace_stale=True)
    finally:
        foreign.close()
        foreign.unlink()
    with RingBuffer.create(name, LAYOUT, slots=2) as writer:
        writer._w[C.W_VERSION] = C.FORMAT_VERSION + 1
        with pytest.raises(RingBufferError, match=f"format version {C.FORMAT_VERSION + 1}"):
            RingBuffer.attach(name, LAYOUT)


def test_writer_contract_is_enforced(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        with pytest.raises(RingBufferError, match="only its creator writes"):
            reader.begin_write()
        w = writer.begin_write()
        with pytest.raises(RingBufferError, match="still open"):
            writer.begin_write()
        with pytest.raises(ValueError, match="holds 256"):
            w.commit({"x": "y" * 300})
        with pytest.raises(TypeError, match="dict, bytes or None"):
            w.commit([1, 2])
        assert w.commit({"ok": True}) == (0, 0)  # the failed commits left the write open, nothing published
        with pytest.raises(RingBufferError, match="not open"):
            w.commit()
        with pytest.raises(ValueError, match="shape"):
            reader.read_latest({"kv": torch.zeros(2, 8)})
        with pytest.raises(KeyError, match="not in the ring's layout"):
            reader.read_latest({"nope": torch.zeros(1)})
        with pytest.raises(TypeError, match="attach"):
            import pickle
            pickle.dumps(reader)
    with pytest.raises(ValueError, match="slots"):
        RingBuffer.create(name, LAYOUT, slots=0)
    with pytest.raises(TypeError, match="create"):
        RingBuffer(name=name, layout=LAYOUT, shm=None, owner=True, read_retries=1)


def test_writer_can_pick_the_slot_and_readers_can_adopt_the_layout(name):
    with RingBuffer.create(name, LAYOUT, slots=3) as ring:
        with ring.begin_write(slot=2) as w:
            stamp_payload(w.tensors, 5)
            assert w.commit({"k": 1}) == (2, 0)
        with ring.begin_write(slot=2) as w:   # the same slot again: the sequence still grows
            stamp_payload(w.tensors, 6)
            assert w.commit() == (2, 1)
        with pytest.raises(ValueError, match="slot must be in"):
            ring.begin_write(slot=3)
        layout = RingBuffer.peek_layout(name)
        assert layout == LAYOUT
        with RingBuffer.attach(name, layout) as reader:
            out = _out()
            assert reader.read(2, 0, out) is None          # replaced by sequence 1
            assert reader.read(2, 1, out) is not None and payload_matches(out, 6)
    with pytest.raises(RingNotFoundError):
        RingBuffer.peek_layout(name)


def test_close_is_idempotent_and_unlinks(name):
    writer = RingBuffer.create(name, LAYOUT, slots=2)
    reader = RingBuffer.attach(name, LAYOUT)
    _write(writer, 1)
    writer.close()
    writer.close()
    assert not _segment_exists(name)
    out = _out()
    assert reader.read_latest(out).seq == 0  # the reader's mapping outlives the name
    assert not reader.writer_alive(60.0)  # a closed writer reads as gone at once
    reader.close()
    reader.close()
    with pytest.raises(RingBufferError, match="closed"):
        reader.read_latest(out)
    ring = RingBuffer.create(name, LAYOUT, slots=2)
    del ring  # __del__ closes and unlinks
    assert not _segment_exists(name)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_segment_is_replaced_only_when_its_writer_is_dead(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as live:
        with pytest.raises(RingExistsError, match=f"pid {os.getpid()}, alive"):
            RingBuffer.create(name, LAYOUT, slots=2)
        with pytest.raises(RingExistsError, match="live writer"):
            RingBuffer.create(name, LAYOUT, slots=2, replace_stale=True)
        _write(live, 1)
        live._w[C.W_PID] = _dead_pid()  # the writer "crashed": its pid is gone, its segment is not
        with pytest.raises(RingExistsError, match="dead.*replace_stale=True"):
            RingBuffer.create(name, LAYOUT, slots=2)
        with RingBuffer.create(name, LAYOUT, slots=3, replace_stale=True) as fresh, \
                RingBuffer.attach(name, LAYOUT) as reader:
            assert reader.slots == 3 and reader.latest_seq == -1
            _write(fresh, 2)
            live.close()  # the presumed-dead writer closing late must not unlink the new ring
            assert _segment_exists(name)
            assert reader.read_latest(_out()).seq == 0


def test_crashed_writer_process_leaves_a_segment_that_replace_stale_removes(name):
    # The writer's whole process tree is SIGKILLed, its resource tracker included: killing only the
    # writer would let the tracker unlink the segment, at a moment of its own (a race with this test).
    code = ("import os, torch; from multiprocessing import resource_tracker; from vla_runtime.ipc.ring import "
            "RingBuffer; from vla_runtime.ipc.layout import SlotLayout; "
            f"r = RingBuffer.create({name!r}, SlotLayout.from_json({LAYOUT.to_json()!r}), 2); "
            "os.kill(resource_tracker._resource_tracker._pid, 9); os.kill(os.getpid(), 9)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    try:
        with RingBuffer.attach(name, LAYOUT) as orphan:
            assert not orphan.writer_alive(3600.0)
        with pytest.raises(RingExistsError, match="dead"):
            RingBuffer.create(name, LAYOUT, slots=2)
    finally:
        with RingBuffer.create(name, LAYOUT, slots=2, replace_stale=True) as ring:
            assert ring.writer_pid == os.getpid()


def test_a_restarted_writer_supersedes_the_mapping_readers_hold(name):
    """A restarted writer numbers its payloads from 0 again: an old mapping can hold a payload with
    the very sequence the new ring announces. ``superseded`` tells the reader to re-attach first."""
    out = _out()
    first = RingBuffer.create(name, LAYOUT, slots=2)
    old = RingBuffer.attach(name, LAYOUT)
    assert _write(first, 1) == (0, 0)
    assert not old.superseded() and not first.superseded()
    first._w[C.W_PID] = _dead_pid()                 # the writer crashed ...
    assert old.superseded()
    first._w[C.W_PID] = os.getpid()
    first.close()                                   # ... or shut down cleanly: gone either way
    assert old.superseded()
    with RingBuffer.create(name, LAYOUT, slots=2) as second:
        assert _write(second, 2) == (0, 0)          # same slot, same sequence, new payload
        assert old.superseded()
        assert old.read(0, 0, out) is not None and payload_matches(out, 1)   # what a stale reader would use
        with RingBuffer.attach(name, LAYOUT) as fresh:
            assert not fresh.superseded()
            assert fresh.read(0, 0, out) is not None and payload_matches(out, 2)
    old.close()
    with pytest.raises(RingBufferError, match="closed"):
        old.superseded()


def test_a_dead_writers_payloads_stay_readable_until_the_name_names_another_segment(name):
    """``replaced`` (the working set's test): a dead writer alone does not count, its committed
    payloads are still exactly what they were; a new segment under the name, or none, does."""
    first = RingBuffer.create(name, LAYOUT, slots=2)
    old = RingBuffer.attach(name, LAYOUT)
    _write(first, 1)
    first._w[C.W_PID] = _dead_pid()                 # the writer crashed
    assert old.superseded() and not old.replaced()
    first._w[C.W_PID] = os.getpid()
    first.close()                                   # the name names nothing now
    assert old.replaced()
    with RingBuffer.create(name, LAYOUT, slots=2):
        assert old.replaced()                       # another segment under the name
    old.close()


def test_a_pinned_payload_is_read_in_place_and_its_pin_fails_once_the_slot_is_written(name):
    """``pin``: zero-copy views of one committed payload; ``valid()`` after use says whether they
    held it throughout; a cleared slot (``clear_slot``) pins as empty."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        slot, seq = _write(writer, 3, meta={"k": 1})
        assert reader.slot_seq(slot) == seq and reader.slot_seq(1 - slot) == -1
        assert reader.slot_seqs()[[slot, 1 - slot]].tolist() == [seq, -1]
        pin = reader.pin(slot, seq)
        assert pin is not None and pin.meta == {"k": 1} and pin.seq == seq
        assert payload_matches({k: v.clone() for k, v in pin.views.items()}, 3) and pin.valid()
        assert pin.views["kv"].data_ptr() == reader.pin(slot).views["kv"].data_ptr()   # in place, no copy
        assert reader.pin(slot, seq + 1) is None                      # another sequence
        w = writer.begin_write(slot)                                  # a write begins under the pin ...
        assert not pin.valid() and reader.pin(slot) is None and reader.slot_seq(slot) == -1
        assert reader.slot_seqs()[slot] == -1                         # being written
        w.commit()                                                    # ... and ends: still not the pinned one
        assert not pin.valid() and reader.pin(slot, seq) is None
        writer.clear_slot(slot)
        assert reader.pin(slot) is None and reader.slot_seq(slot) == -1


def test_heartbeat_and_stale_writer_detection(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert reader.writer_alive(60.0) and reader.writer_pid == os.getpid()
        writer._w[C.W_HEARTBEAT] = time.monotonic_ns() - 30 * 10**9  # writer hung for 30 s
        assert not reader.writer_alive(10.0) and reader.heartbeat_age_s() >= 30
        writer.heartbeat()
        assert reader.writer_alive(10.0)
        writer._w[C.W_HEARTBEAT] = time.monotonic_ns() - 30 * 10**9
        _write(writer, 1)  # every commit is a heartbeat too
        assert reader.writer_alive(10.0)
        writer._w[C.W_PID] = _dead_pid()
        assert not reader.writer_alive(10.0)
        with pytest.raises(RingBufferError, match="creator"):
            reader.heartbeat()
        writer._w[C.W_PID] = os.getpid()


def test_cuda_backend_imports_and_fails_clearly_without_cupy_or_gpu(name):
    from vla_runtime.ipc import cuda

    try:
        cuda.require_cupy()
    except RuntimeError as e:
        assert str(e).startswith("CUDA ring buffer needs CuPy and an NVIDIA GPU: ")
        with pytest.raises(RuntimeError, match="^CUDA ring buffer needs CuPy and an NVIDIA GPU: "):
            RingBuffer.create(name, LAYOUT, slots=2, backend="cuda")
    else:
        pytest.skip("CuPy and a GPU are present: the clear-error path does not apply")
    with pytest.raises(ValueError, match="backend"):
        RingBuffer.create(name, LAYOUT, slots=2, backend="tpu")


# ---------------------------------------------------------------- boundaries found by the mutation run


def test_an_aborted_write_invalidates_pins_and_cannot_be_committed_after(name):
    """An abort ends a write the seqlock way (the lock word moves on to the next even value, never
    back to the one a pin recorded): a pin taken before the write fails, the slot reads as empty,
    and the aborted writer cannot commit."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        slot, seq = _write(writer, 4)
        pin = reader.pin(slot, seq)
        assert pin is not None and pin.valid()
        w = writer.begin_write(slot)
        stamp_payload(w.tensors, 9)                                   # the payload is partly rewritten ...
        w.abort()                                                     # ... and abandoned
        assert not pin.valid() and reader.pin(slot) is None and reader.slot_seq(slot) == -1
        with pytest.raises(RingBufferError, match="not open"):
            w.commit()
        assert writer.begin_write().commit() == (1, 1)               # the next write goes on normally


def test_slot_seqs_is_slot_seq_of_every_slot_including_a_write_just_begun(name):
    """Four slots: three committed round robin, one never written, one being rewritten. A writer
    that has made the lock word odd but not yet cleared the header sequence (the instant between
    the two stores of ``begin_write``) already reads as "being written"."""
    with RingBuffer.create(name, LAYOUT, slots=4) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        for v in range(3):
            _write(writer, v)
        assert reader.slot_seqs().tolist() == [0, 1, 2, -1] and reader.slot_seqs().dtype == np.int64
        w = writer.begin_write(1)
        assert reader.slot_seqs().tolist() == [0, -1, 2, -1] == [reader.slot_seq(s) for s in range(4)]
        w.commit()
        assert reader.slot_seqs().tolist() == [0, 3, 2, -1]
        lock = writer._hword(2, C.H_SEQLOCK)
        writer._w[lock] += 1                                          # odd, sequence 2 still in the header
        assert reader.slot_seqs().tolist() == [0, 3, -1, -1] and reader.slot_seq(2) == -1
        writer._w[lock] += 1


def test_clear_slot_clears_the_slot_it_is_given(name):
    with RingBuffer.create(name, LAYOUT, slots=3) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        for v in range(3):
            _write(writer, v)
        writer.clear_slot(1)
        assert reader.slot_seqs().tolist() == [0, -1, 2]


def test_pin_checks_its_slot_and_reads_the_header_of_that_slot(name):
    """Pins of a later slot with metadata and of a payload committed without metadata (an empty
    metadata blob checks as empty); a slot number out of range is refused, naming it."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        _write(writer, 1)                                             # slot 0: no metadata
        _write(writer, 2, meta={"ref": "ep1"})                        # slot 1
        p0, p1 = reader.pin(0, 0), reader.pin(1, 1)
        assert p0 is not None and p0.meta is None and p0.valid()
        assert p1 is not None and p1.meta == {"ref": "ep1"} and payload_matches(dict(p1.views), 2)
        for bad in (2, -1):
            with pytest.raises(ValueError, match=rf"slot must be in \[0, 2\), got {bad}"):
                reader.pin(bad)


def test_peek_layout_names_what_is_wrong_with_the_segment(name):
    with pytest.raises(RingNotFoundError, match=f"ring {name!r} does not exist"):
        RingBuffer.peek_layout(name)
    foreign = SharedMemory(name=name, create=True, size=4096)
    try:
        with pytest.raises(RingBufferError, match=f"ring {name!r} is not an initialised vla_runtime ring"):
            RingBuffer.peek_layout(name)
    finally:
        foreign.close()
        foreign.unlink()
    with RingBuffer.create(name, LAYOUT, slots=2) as writer:
        writer._map[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + 2] = b"{{"      # the layout JSON broken
        with pytest.raises(RingBufferError, match=f"ring {name!r}: the writer's layout description is unreadable"):
            RingBuffer.peek_layout(name)


def test_repr_says_which_end_and_whether_closed_and_pickling_says_what_to_do(name):
    import pickle

    writer = RingBuffer.create(name, LAYOUT, slots=2)
    reader = RingBuffer.attach(name, LAYOUT)
    assert repr(writer) == f"RingBuffer({name!r}, slots=2, tag={LAYOUT.tag}, writer)"
    assert repr(reader) == f"RingBuffer({name!r}, slots=2, tag={LAYOUT.tag}, reader)"
    assert writer.replaced() is False and reader.replaced() is False      # the owner is never replaced
    with pytest.raises(TypeError, match=r"a RingBuffer cannot be pickled: call RingBuffer.attach\(name, layout\)"):
        pickle.dumps(writer)
    reader.close()
    writer.close()
    assert repr(writer).endswith(", closed)") and repr(reader).endswith(", closed)")


def test_pid_alive_tells_live_dead_and_zombie_processes_even_with_a_parenthesis_in_the_name():
    """A crashed writer can linger as a zombie until its parent reaps it: it must count as dead.
    ``/proc/<pid>/stat`` puts the command name in parentheses before the state, and the name may
    itself hold ") ": the state is the first field after the *last* ')'."""
    from vla_runtime.ipc.ring import _pid_alive

    assert _pid_alive(os.getpid()) and _pid_alive(1)
    assert not _pid_alive(0) and not _pid_alive(-1)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    zombie = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) b')"])
    try:
        for _ in range(200):                               # wait (no time assert) until it has exited
            with open(f"/proc/{zombie.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.05)
        with open(f"/proc/{zombie.pid}/comm", "rb") as f:
            assert f.read().strip() == b"a) b"
        assert _pid_alive(live.pid) and not _pid_alive(zombie.pid)
    finally:
        live.kill()
        live.wait()
        zombie.wait()
    assert not _pid_alive(zombie.pid)                      # reaped: gone


def test_metadata_of_exactly_the_header_size_fits_and_one_byte_more_is_named(name):
    """Dicts are stored as compact JSON: {"x": "y" * 248} is 256 bytes that way (and more with the
    default separators), exactly what the header holds."""
    with RingBuffer.create(name, LAYOUT, slots=1) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        meta = {"x": "y" * 248}
        assert writer.begin_write().commit(meta) == (0, 0)
        out = _out()
        assert reader.read(0, 0, out).meta == meta                   # a one-slot ring reads too
        w = writer.begin_write()
        with pytest.raises(ValueError, match="slot metadata is 257 bytes encoded, the slot header holds 256"):
            w.commit({"x": "y" * 249})
        with pytest.raises(TypeError, match="slot metadata must be a dict, bytes or None, got list"):
            w.commit([1])
        w.abort()
        with pytest.raises(ValueError, match="out must map at least one field name to a preallocated tensor"):
            reader.read_latest({})


def test_checksum_failures_and_torn_giveups_are_counted_per_event(name):
    """A header whose checksum does not match is refused and counted each time; a slot held odd
    (a writer mid-write) through every retry is a torn give-up, counted each time."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        slot, seq = _write(writer, 1)
        crc = writer._hword(slot, C.H_CHECKSUM)
        writer._w[crc] ^= 1
        out = _out()
        assert reader.read(slot, seq, out) is None and reader.read(slot, seq, out) is None
        assert reader.stats.checksum_failures == 2
        writer._w[crc] ^= 1
        assert reader.read(slot, seq, out) is not None and reader.stats.checksum_failures == 2
        lock = writer._hword(slot, C.H_SEQLOCK)
        writer._w[lock] += 1
        assert reader.read_latest(out) is None and reader.read_latest(out) is None
        assert reader.stats.torn_giveups == 2
        writer._w[lock] += 1


def test_the_smallest_ring_and_one_read_attempt_are_accepted_and_less_is_named(name):
    with RingBuffer.create(name, LAYOUT, slots=1, read_retries=1) as writer:
        _write(writer, 2)
        with RingBuffer.attach(name, LAYOUT, read_retries=1) as reader:
            out = _out()
            assert reader.read_latest(out).seq == 0 and payload_matches(out, 2)
    with pytest.raises(ValueError, match="slots must be an int >= 1, got 0"):
        RingBuffer.create(name, LAYOUT, slots=0)
    with pytest.raises(ValueError, match="read_retries must be >= 1, got 0"):
        RingBuffer.create(name, LAYOUT, slots=1, read_retries=0)


def test_field_view_is_one_field_of_every_slot_in_place_and_seqlocks_check_many_pins(name):
    """``field_view``: a ``[slots, *shape]`` tensor whose row s is slot s's field, sharing the
    segment (what the writer commits later shows through it); ``seqlocks`` equals each pin's
    ``lock_word`` until that slot is written."""
    with RingBuffer.create(name, LAYOUT, slots=3) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        for v in range(2):
            _write(writer, v)
        kv, state = reader.field_view("kv"), reader.field_view("state")
        assert kv.shape == (3, 2, 8, 4) and state.shape == (3, 7) and state.dtype == torch.float64
        pins = [reader.pin(s) for s in range(2)]
        for s, pin in enumerate(pins):
            assert kv[s].data_ptr() == pin.views["kv"].data_ptr() and torch.equal(kv[s], pin.views["kv"])
            assert torch.equal(state[s], pin.views["state"])
        assert reader.seqlocks()[:2].tolist() == [p.lock_word for p in pins]
        before = kv[0].clone()
        _write(writer, 7)                                             # slot 2, then slot 0 rewritten
        _write(writer, 8)
        assert not torch.equal(kv[0], before) and torch.equal(kv[0], reader.pin(0).views["kv"])   # no copy was taken
        locks = reader.seqlocks()
        assert locks[0] != pins[0].lock_word and locks[1] == pins[1].lock_word
        assert not pins[0].valid() and pins[1].valid()
        with pytest.raises(KeyError):
            reader.field_view("nope")


# ---------------------------------------------------------------- the segment's bytes, the seqlock, the refusals


def _control_words(name: str) -> np.ndarray:
    """The global words of the segment as another process would see them, read from the file under
    /dev/shm (not through the ring's own mapping)."""
    with open(f"/dev/shm/{name}", "rb") as f:
        return np.frombuffer(f.read(C.GLOBAL_BYTES), dtype=np.int64)


def test_the_segment_holds_the_documented_control_block_page_aligned_slots_and_empty_headers(name):
    """The byte layout of control.py, read back from the file: control block rounded up to a page,
    then ``slots`` payloads one page-rounded stride apart (this layout's 448 bytes take one page, so
    a 64- or 256-byte stride would show), every header's sequence -1 before the first write."""
    from vla_runtime.ipc.layout import align_up

    layout_json = LAYOUT.to_json().encode()
    ctrl = align_up(C.control_nbytes(len(layout_json), 3), 4096)
    assert LAYOUT.nbytes == 448 and ctrl == 4096
    with RingBuffer.create(name, LAYOUT, slots=3) as writer:
        assert os.stat(f"/dev/shm/{name}").st_size == ctrl + 3 * 4096
        w = _control_words(name)
        with open(f"/dev/shm/{name}", "rb") as f:
            raw = f.read(ctrl)
        assert raw[0:8] == C.MAGIC
        assert (w[C.W_VERSION], w[C.W_SLOTS], w[C.W_BACKEND]) == (C.FORMAT_VERSION, 3, C.BACKEND_HOST)
        assert (w[C.W_PID], w[C.W_LATEST]) == (os.getpid(), -1)
        assert (w[C.W_PAYLOAD_OFFSET], w[C.W_STRIDE], w[C.W_LAYOUT_LEN]) == (ctrl, 4096, len(layout_json))
        assert w[C.W_NONCE] > 0 and w[C.W_CHANGES] == 0
        assert raw[C.TAG_OFFSET:C.TAG_OFFSET + C.TAG_BYTES] == LAYOUT.tag.encode()
        assert raw[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + len(layout_json)] == layout_json
        hdr = C.headers_offset(len(layout_json))
        headers = np.frombuffer(raw[hdr:hdr + 3 * C.SLOT_HEADER], dtype=np.int64).reshape(3, C.SLOT_HEADER // 8)
        assert headers[:, C.H_SEQLOCK].tolist() == [0, 0, 0] and headers[:, C.H_SEQ].tolist() == [-1, -1, -1]
        # the writer's views sit exactly there: slot s, field f at payload + s * stride + offset f
        base = writer.begin_write(0)["kv"].data_ptr()
        writer._pending.abort()
        assert base % 4096 == 0                                     # the payload starts on a page
        for s in range(3):
            wr = writer.begin_write(s)
            for f, off in zip(LAYOUT.fields, LAYOUT.offsets):
                assert wr[f.name].data_ptr() - base == s * 4096 + off, (s, f.name)
            wr.abort()


def test_a_control_block_or_payload_over_a_page_takes_whole_pages(name):
    """16 slot headers (5.5 KiB of control block) and a 4.4 KiB payload: two pages each."""
    big = SlotLayout((FieldSpec("x", (1100,), torch.float32), FieldSpec("n", (1,), torch.int64)))
    assert C.control_nbytes(len(big.to_json().encode()), 16) > 4096 and 4096 < big.nbytes <= 8192
    with RingBuffer.create(name, big, slots=16) as writer:
        w = _control_words(name)
        assert (w[C.W_PAYLOAD_OFFSET], w[C.W_STRIDE]) == (8192, 8192)
        assert os.stat(f"/dev/shm/{name}").st_size == 8192 + 16 * 8192
        for s in (0, 15):
            with writer.begin_write(s) as wr:
                wr["x"].fill_(s + 0.5)
                wr["n"].fill_(s)
                wr.commit()
        with RingBuffer.attach(name, big) as reader:
            out = {"x": torch.empty(1100), "n": torch.empty(1, dtype=torch.int64)}
            assert reader.read(15, 1, out).slot == 15 and out["x"].eq(15.5).all() and out["n"].item() == 15
            assert reader.read(0, 0, out).slot == 0 and out["x"].eq(0.5).all() and out["n"].item() == 0


def test_the_seqlock_is_odd_exactly_while_a_write_is_open_and_every_write_moves_it_by_two(name):
    """The protocol's lock word, seen by a reader: begin_write makes it odd and clears the header's
    sequence, commit and abort each make it even again (one more), so a pin's word never comes back."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert reader.seqlocks().tolist() == [0, 0] and reader.seqlocks().dtype == np.int64
        w = writer.begin_write()
        assert reader.seqlocks().tolist() == [1, 0]
        stamp_payload(w.tensors, 1)
        w.commit()
        assert reader.seqlocks().tolist() == [2, 0] and reader.slot_seq(0) == 0
        writer.begin_write().abort()
        assert reader.seqlocks().tolist() == [2, 2] and reader.slot_seq(1) == -1
        w = writer.begin_write(0)
        hdr = writer._hword(0, C.H_SEQ)
        assert reader.seqlocks().tolist() == [3, 2] and int(writer._w[hdr]) == -1   # header cleared at once
        w.abort()
        assert reader.seqlocks().tolist() == [4, 2] and int(writer._w[hdr]) == -1
        with writer.begin_write(1) as w:                              # a block ending without a commit aborts
            pass
        assert reader.seqlocks().tolist() == [4, 4]
        locks = reader.seqlocks()
        locks[0] = 99                                                 # a copy: the caller cannot move the lock
        assert reader.seqlocks().tolist() == [4, 4]


def test_every_header_change_moves_the_change_count_and_reads_do_not(name):
    """``changes`` is what a reader compares to skip reading every slot's header (``WindowView``):
    begin, commit and abort each move it by one (also through ``clear_slot``), reads and pins never."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert reader.changes == 0
        w = writer.begin_write()
        assert reader.changes == 1
        w.commit()
        assert reader.changes == 2 and writer.changes == 2
        reader.read(0, 0, _out()), reader.pin(0), reader.slot_seqs(), reader.seqlocks()
        assert reader.changes == 2
        writer.begin_write().abort()
        assert reader.changes == 4
        writer.clear_slot(0)
        assert reader.changes == 6 and reader.slot_seq(0) == -1
        assert int(_control_words(name)[C.W_CHANGES]) == 6
        assert reader.unchanged_since(6) and not reader.unchanged_since(5)
        writer.begin_write(1)
        assert not reader.unchanged_since(6)                   # a write begun is a change already


def test_a_commit_stamps_now_unless_given_a_stamp_and_publishes_latest_and_heartbeat(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        writer._w[C.W_HEARTBEAT] = 0
        before = time.monotonic_ns()
        assert writer.begin_write().commit() == (0, 0)
        after = time.monotonic_ns()
        info = reader.read_latest(_out())
        assert before <= info.stamp_ns <= after and before <= int(_control_words(name)[C.W_HEARTBEAT]) <= after
        assert writer.begin_write().commit(stamp_ns=7.9) == (1, 1)   # any number, stored as an int
        assert reader.read(1, 1, _out()).stamp_ns == 7 and reader.latest_seq == 1


def test_closing_the_writer_with_a_write_open_aborts_it_and_clears_the_pid(name):
    writer = RingBuffer.create(name, LAYOUT, slots=2)
    reader = RingBuffer.attach(name, LAYOUT)
    try:
        _write(writer, 1)
        w = writer.begin_write(0)                                     # rewriting slot 0, never committed
        writer.close()
        assert reader.seqlocks().tolist() == [4, 0] and reader.slot_seq(0) == -1
        assert reader.read(0, 0, _out()) is None and reader.read_latest(_out()) is None
        assert reader.writer_pid == 0
        with pytest.raises(RingBufferError, match=r"^slot 0 is not open for writing \(commit/abort already called\)$"):
            w.commit()
    finally:
        reader.close()


def test_every_refusal_names_the_offending_value(name):
    """Whole messages, so a refusal that loses the value or the advice shows."""
    with pytest.raises(ValueError, match=r"^layout must be a SlotLayout, got str$"):
        RingBuffer.create(name, "kv", slots=2)
    with pytest.raises(ValueError, match=r"^slots must be an int >= 1, got 2\.0$"):
        RingBuffer.create(name, LAYOUT, slots=2.0)
    with pytest.raises(ValueError, match=r"^backend must be 'cpu' or 'cuda', got 'tpu'$"):
        RingBuffer.create(name, LAYOUT, slots=2, backend="tpu")
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        with pytest.raises(RingBufferError, match=rf"^ring {name!r} was attached, not created, by this process: "
                                                  r"only its creator writes$"):
            reader.begin_write()
        with pytest.raises(RingBufferError, match=r"^only the ring's creator updates its heartbeat$"):
            reader.heartbeat()
        with pytest.raises(ValueError, match=r"^slot must be in \[0, 2\), got 2$"):
            writer.begin_write(2)
        with pytest.raises(ValueError, match=r"^slot must be in \[0, 2\), got -1$"):
            writer.begin_write(-1)
        writer.begin_write(1)
        with pytest.raises(RingBufferError, match=r"^slot 1 \(sequence 0\) is still open: commit or abort it "
                                                  r"before the next begin_write$"):
            writer.begin_write()
        writer._pending.abort()
        with pytest.raises(KeyError, match=r"out has field 'nope', not in the ring's layout "
                                           r"\['kv', 'state', 'ref', 'mask'\]"):
            reader.read(0, 0, {"nope": torch.zeros(1)})
        with pytest.raises(ValueError, match=r"^out\['kv'\] has shape \(2, 8\), the layout says \(2, 8, 4\)$"):
            reader.read(0, 0, {"kv": torch.zeros(2, 8)})
        with pytest.raises(ValueError, match=r"^slot must be in \[0, 2\), got 2$"):
            reader.read(2, 0, _out())
        with pytest.raises(ValueError, match=r"^out must map at least one field name to a preallocated tensor$"):
            reader.read(0, 0, {})
        with pytest.raises(TypeError, match=r"^a RingBuffer cannot be pickled: call RingBuffer\.attach\(name, "
                                            r"layout\) in the other process$"):
            import pickle
            pickle.dumps(reader)
    with pytest.raises(RingBufferError, match=rf"^ring {name!r} is closed$"):
        reader.latest_seq
    with pytest.raises(RingNotFoundError, match=rf"^ring {name!r} does not exist after waiting 0\.05s$"):
        RingBuffer.attach(name, LAYOUT, timeout_s=0.05)
    with pytest.raises(RingNotFoundError, match=rf"^ring {name!r} does not exist$"):
        RingBuffer.attach(name, LAYOUT)
    with pytest.raises(TypeError, match=r"^use RingBuffer.create\(...\) or RingBuffer.attach\(...\)$"):
        RingBuffer(name=name, layout=LAYOUT, shm=None, owner=True, read_retries=1)


def test_an_existing_segment_is_refused_with_its_writer_and_the_way_out(name):
    with RingBuffer.create(name, LAYOUT, slots=2) as live:
        pid = os.getpid()
        with pytest.raises(RingExistsError, match=rf"^shared memory segment {name!r} already exists \(writer pid "
                                                  rf"{pid}, alive\); another writer owns it, or a crashed one left "
                                                  r"it: pass replace_stale=True to remove a dead writer's segment$"):
            RingBuffer.create(name, LAYOUT, slots=2)
        with pytest.raises(RingExistsError, match=rf"^ring {name!r} is owned by a live writer \(pid {pid}\); "
                                                  r"refusing to replace it$"):
            RingBuffer.create(name, LAYOUT, slots=2, replace_stale=True)
        live._w[C.W_PID] = dead = _dead_pid()
        with pytest.raises(RingExistsError, match=rf"\(writer pid {dead}, dead\)"):
            RingBuffer.create(name, LAYOUT, slots=2)
        live._w[C.W_PID] = pid
    foreign = SharedMemory(name=name, create=True, size=4096)
    try:
        with pytest.raises(RingExistsError, match=rf"^shared memory segment {name!r} already exists; another"):
            RingBuffer.create(name, LAYOUT, slots=2)
        with pytest.raises(RingExistsError, match=rf"^shared memory segment {name!r} exists but is not an initialised "
                                                  rf"vla_runtime ring; refusing to remove it \(delete /dev/shm/{name} "
                                                  r"by hand if it is yours\)$"):
            RingBuffer.create(name, LAYOUT, slots=2, replace_stale=True)
        with pytest.raises(RingNotFoundError, match=rf"^ring {name!r} is not an initialised vla_runtime ring "
                                                    r"\(bad magic\)$"):
            RingBuffer.attach(name, LAYOUT)
    finally:
        foreign.close()
        foreign.unlink()


def test_a_reader_of_another_layout_is_told_both_tags_and_what_differs(name):
    other = SlotLayout((FieldSpec("kv", (2, 8, 4), torch.float32),))
    with RingBuffer.create(name, LAYOUT, slots=2) as writer:
        with pytest.raises(LayoutMismatchError, match=rf"^ring {name!r}: layout tag {LAYOUT.tag} != this reader's "
                                                      rf"{other.tag} \(reader vs writer: fields only in the other "
                                                      r"layout: \['state', 'ref', 'mask'\]\)$"):
            RingBuffer.attach(name, other)
        writer._map[C.LAYOUT_OFFSET:C.LAYOUT_OFFSET + 2] = b"{{"          # the description unreadable ...
        with pytest.raises(LayoutMismatchError, match=r"\(reader vs writer: writer's layout description unreadable\)$"):
            RingBuffer.attach(name, other)
        writer._map[C.TAG_OFFSET] = 0xFF                                  # ... and the tag not even ASCII
        with pytest.raises(LayoutMismatchError, match="layout tag \ufffd"):
            RingBuffer.attach(name, LAYOUT)


def test_attach_waits_for_the_writer_to_create_the_ring(name):
    """A reader started before its writer waits (up to ``timeout_s``) instead of failing."""
    import threading

    made: list[RingBuffer] = []
    t = threading.Timer(0.3, lambda: made.append(RingBuffer.create(name, LAYOUT, slots=2)))
    t.start()
    try:
        with RingBuffer.attach(name, LAYOUT, timeout_s=60.0) as reader:
            assert reader.slots == 2 and reader.writer_pid == os.getpid()
    finally:
        t.join()
        for ring in made:
            ring.close()


def test_heartbeat_age_and_the_writer_deadline_are_exact_on_a_given_clock(name, monkeypatch):
    """``writer_alive``: a heartbeat exactly ``deadline_s`` old still counts, a nanosecond more does not."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        writer._w[C.W_HEARTBEAT] = 10**12
        monkeypatch.setattr("vla_runtime.ipc.ring.time.monotonic_ns", lambda: 10**12 + 1_500_000_000)
        assert reader.heartbeat_age_s() == 1.5
        assert reader.writer_alive(1.5) and not reader.writer_alive(1.499999999)
        writer.heartbeat()
        assert reader.heartbeat_age_s() == 0.0


def test_pid_alive_counts_a_process_it_may_not_signal_as_alive(monkeypatch):
    """Another user's process answers ``kill(pid, 0)`` with EPERM: it exists."""
    from vla_runtime.ipc.ring import _pid_alive

    def refuse(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("vla_runtime.ipc.ring.os.kill", refuse)
    assert _pid_alive(12345)


def test_replaced_tells_segments_apart_by_inode_not_by_their_bytes(name):
    """A byte-for-byte copy of the segment put under the name (same nonce, same pid) is another
    segment: what the reader's mapping shows is no longer what the name names."""
    writer = RingBuffer.create(name, LAYOUT, slots=2)
    reader = RingBuffer.attach(name, LAYOUT)
    path = f"/dev/shm/{name}"
    try:
        _write(writer, 1)
        assert not reader.replaced()
        with open(path, "rb") as f:
            copy = f.read()
        os.unlink(path)
        assert reader.replaced()                                      # no segment under the name
        with open(path, "xb") as f:
            f.write(copy)
        assert reader.replaced()                                      # another one, identical bytes
    finally:
        reader.close()
        writer.close()                                                # the copy carries our nonce: removed


class _TrackerSpy:
    """Records this process's resource-tracker unregistrations of one segment (and forwards them)."""

    def __init__(self, monkeypatch, name: str) -> None:
        from multiprocessing import resource_tracker

        self.calls = 0
        real = resource_tracker.unregister

        def unregister(n, rtype):
            if n == "/" + name and rtype == "shared_memory":
                self.calls += 1
            real(n, rtype)

        monkeypatch.setattr(resource_tracker, "unregister", unregister)


def test_the_creators_tracker_id_is_this_processs_tracker_pipe(monkeypatch, name):
    from multiprocessing import resource_tracker
    from types import SimpleNamespace

    from vla_runtime.ipc.ring import _tracker_id

    with RingBuffer.create(name, LAYOUT, slots=1):
        mine = os.fstat(resource_tracker._resource_tracker._fd).st_ino
        assert mine != 0 and _tracker_id() == mine and _control_words(name)[C.W_TRACKER] == mine
    monkeypatch.setattr(resource_tracker, "_resource_tracker", SimpleNamespace(_fd=None))
    assert _tracker_id() == 0                                         # no tracker started
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    monkeypatch.setattr(resource_tracker, "_resource_tracker", SimpleNamespace(_fd=w))
    assert _tracker_id() == 0                                         # its pipe gone


def test_a_reader_unregisters_the_segment_only_from_a_tracker_that_is_not_the_creators(monkeypatch, name):
    """An independent reader's tracker would unlink the writer's ring when the reader exits; a reader
    sharing the creator's tracker must leave the creator's registration alone."""
    from multiprocessing import resource_tracker

    with RingBuffer.create(name, LAYOUT, slots=1) as writer:
        spy = _TrackerSpy(monkeypatch, name)
        RingBuffer.attach(name, LAYOUT).close()
        assert spy.calls == 0                                         # one tracker: nothing to undo
        writer._w[C.W_TRACKER] += 1                                   # the creator's tracker is another one
        RingBuffer.attach(name, LAYOUT).close()
        assert spy.calls == 1
        resource_tracker.register("/" + name, "shared_memory")       # restore the creator's entry
        writer._w[C.W_TRACKER] = 0                                    # a creator without a tracker
        RingBuffer.attach(name, LAYOUT).close()
        assert spy.calls == 2
        resource_tracker.register("/" + name, "shared_memory")
        writer._w[C.W_TRACKER] = writer._tracker


def test_a_late_close_drops_its_tracker_entry_when_the_name_is_gone_and_keeps_a_new_rings(monkeypatch, name):
    """A writer presumed dead closes late and never unlinks a name it does not own. With the name
    gone it drops its tracker entry (the tracker must not unlink a later segment of that name at
    exit); when a new ring created in this process (the same tracker) holds the name, the entry
    is the new ring's and stays."""
    spy = _TrackerSpy(monkeypatch, name)
    gone = RingBuffer.create(name, LAYOUT, slots=1)
    os.unlink(f"/dev/shm/{name}")                                     # removed behind its back
    gone.close()
    assert spy.calls == 1
    old = RingBuffer.create(name, LAYOUT, slots=1)
    old._w[C.W_PID] = _dead_pid()
    with RingBuffer.create(name, LAYOUT, slots=1, replace_stale=True):
        calls = spy.calls
        old.close()
        assert spy.calls == calls and _segment_exists(name)


def test_without_dev_shm_a_reader_compares_creation_nonces_instead(monkeypatch, name, tmp_path):
    """Where POSIX shared memory is not a folder of files (not Linux) a reader maps the named
    segment to read its nonce. Regression: a missing /dev/shm used to read as "no segment of that
    name", so every reader there saw its live writer's ring as superseded and replaced."""
    monkeypatch.setattr("vla_runtime.ipc.ring.SHM_DIR", str(tmp_path / "no_shm_here"))
    from vla_runtime.ipc.ring import _segment_nonce

    assert _segment_nonce(name) is None
    writer = RingBuffer.create(name, LAYOUT, slots=2)
    reader = RingBuffer.attach(name, LAYOUT)
    try:
        assert _segment_nonce(name) == writer._nonce == reader._nonce
        assert not reader.superseded() and not reader.replaced()
        writer._map[0:8] = bytes(8)                                   # no longer an initialised ring
        assert _segment_nonce(name) is None and reader.superseded() and reader.replaced()
        writer._map[0:8] = C.MAGIC
        writer.close()
        assert reader.superseded() and reader.replaced()             # the name names nothing
        with RingBuffer.create(name, LAYOUT, slots=2):
            assert reader.superseded() and reader.replaced()         # another ring: another nonce
    finally:
        reader.close()
        writer.close()


def test_a_segment_without_the_magic_is_no_ring_to_a_reader(name):
    """A reader's check of the name reads the magic too (a wiped or foreign control block under the
    name, even one holding our nonce, is not our ring)."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert not reader.superseded()
        writer._map[0:8] = bytes(8)
        assert reader.superseded()
        writer._map[0:8] = C.MAGIC
        assert not reader.superseded()


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_seqlocks_and_slot_seqs_have_one_entry_per_slot(name, slots):
    """Up to 8 slots, the headers reach past the first 7/8 of the control block's words."""
    with RingBuffer.create(name, LAYOUT, slots=slots) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert reader.seqlocks().tolist() == [0] * slots and reader.slot_seqs().tolist() == [-1] * slots
        w = writer.begin_write(slots - 1)
        assert reader.seqlocks().tolist() == [0] * (slots - 1) + [1]
        w.commit()
        assert reader.seqlocks().tolist() == [0] * (slots - 1) + [2]
        assert reader.slot_seqs().tolist() == [-1] * (slots - 1) + [0]
        assert reader.field_view("ref").shape == (slots, 1)


def test_a_commit_writes_the_documented_slot_header(name):
    """Header words of a committed slot, read from the file: sequence, stamp, metadata length and
    kind (none, bytes, compact JSON), the CRC over them, the metadata bytes at +64."""
    with RingBuffer.create(name, LAYOUT, slots=3) as writer:
        hdr = C.headers_offset(len(LAYOUT.to_json().encode()))
        writer.begin_write().commit(None, stamp_ns=11)
        writer.begin_write().commit(b"\x01\x02", stamp_ns=12)
        writer.begin_write().commit({"a": 1}, stamp_ns=13)
        with open(f"/dev/shm/{name}", "rb") as f:
            raw = f.read(hdr + 3 * C.SLOT_HEADER)
        for s, (kind, blob) in enumerate([(C.META_NONE, b""), (C.META_BYTES_KIND, b"\x01\x02"),
                                          (C.META_JSON, b'{"a":1}')]):
            at = hdr + s * C.SLOT_HEADER
            words = np.frombuffer(raw[at:at + 48], dtype=np.int64).tolist()
            assert words[:5] == [2, s, 11 + s, len(blob), kind], s
            assert words[5] == C.header_checksum(s, 11 + s, len(blob), kind, blob)
            assert raw[at + C.META_OFFSET:at + C.META_OFFSET + len(blob)] == blob


def test_field_view_refuses_a_stride_that_is_not_a_whole_number_of_elements(name):
    """Never the case for a ring this code created (page strides); a damaged control block is named
    instead of being viewed misaligned."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        assert reader.field_view("state").stride() == (4096 // 8, 1)          # one stride in elements
        writer._w[C.W_STRIDE] = 4096 + 4
        assert reader.field_view("kv").stride() == (4100 // 4, 32, 4, 1)     # whole float32 elements
        with pytest.raises(RingBufferError, match=rf"^ring {name!r}: slot stride is not a multiple of field "
                                                  r"'state''s 8-byte elements$"):
            reader.field_view("state")
        writer._w[C.W_STRIDE] = 4096


def test_a_pin_raced_by_a_write_or_with_a_damaged_header_is_refused(name):
    """``pin`` re-reads the lock word after reading the header: a write that began meanwhile
    (injected at the fence between the two reads) refuses the pin, as does a header whose
    checksum does not match."""
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        slot, seq = _write(writer, 1, meta={"k": 1})
        fences = []

        def writer_starts_after_the_header_is_read():
            fences.append(1)
            if len(fences) == 2:                                      # pin's second fence: header read
                writer.begin_write(slot)

        reader._fence = writer_starts_after_the_header_is_read
        assert reader.pin(slot, seq) is None and len(fences) == 2
        writer._pending.abort()
        reader._fence = lambda: None
        slot, seq = _write(writer, 2)
        assert reader.pin(slot, seq) is not None
        crc = writer._hword(slot, C.H_CHECKSUM)
        writer._w[crc] ^= 1
        assert reader.pin(slot, seq) is None
        writer._w[crc] ^= 1
        assert reader.pin(slot, seq) is not None


def test_pid_alive_probes_without_signalling_and_trusts_kill_when_proc_is_unreadable(monkeypatch):
    """The probe is signal 0: a live process receives nothing (checked with every signal blocked in
    it, so any signal sent would be left pending). A process ``kill`` found but whose /proc entry
    cannot be read (it exited in between, or /proc is not mounted) counts as alive."""
    from vla_runtime.ipc.ring import _pid_alive

    code = ("import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals()); "
            "print('ready', flush=True); sys.stdin.readline(); print(sorted(signal.sigpending()), flush=True)")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert _pid_alive(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[]"
    finally:
        child.kill()
        child.wait()

    def no_proc(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr("vla_runtime.ipc.ring.open", no_proc, raising=False)
    assert _pid_alive(os.getpid())


def test_a_segment_too_small_for_a_control_block_is_no_ring(name):
    """64 bytes that start with the magic: refused as no ring, never viewed as a 256-byte block."""
    tiny = SharedMemory(name=name, create=True, size=64)
    tiny.buf[0:8] = C.MAGIC
    try:
        with pytest.raises(RingNotFoundError, match=rf"^ring {name!r} is not an initialised vla_runtime ring"):
            RingBuffer.attach(name, LAYOUT)
        with pytest.raises(RingBufferError, match=rf"^ring {name!r} is not an initialised vla_runtime ring"):
            RingBuffer.peek_layout(name)
        with pytest.raises(RingExistsError, match="not an initialised vla_runtime ring"):
            RingBuffer.create(name, LAYOUT, slots=1, replace_stale=True)
    finally:
        tiny.close()
        tiny.unlink()


def test_the_call_gate_says_which_call_is_in_progress_without_attaching(name):
    """The vision stage (the writer) marks a call begun, the policy (a reader) done; a process
    beside them reads both from the control block without mapping the ring."""
    from vla_runtime.ipc.ring import read_call_words
    assert read_call_words(name) is None                       # no ring of that name: no gate
    with RingBuffer.create(name, LAYOUT, slots=2) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        idle = read_call_words(name)
        assert (idle.begun, idle.done, idle.in_flight, idle.last_call_s()) == (0, 0, False, None)
        writer.call_begun()                                    # call of sequence 0 begins
        t_begun = time.monotonic_ns()
        busy = read_call_words(name)
        assert busy.begun == 1 and busy.in_flight and busy.last_call_s() is None
        assert busy.begun_ns <= t_begun
        _, seq = _write(writer, 1)
        assert seq == 0 and read_call_words(name).in_flight    # committed, not yet denoised
        writer.call_begun()                                    # streaming: call 1 begins meanwhile
        reader.call_done(seq)                                  # call 0 done: call 1 still runs
        words = read_call_words(name)
        assert (words.begun, words.done, words.in_flight) == (2, 1, True)
        writer.call_abandoned()                                # call 1's encoding failed
        words = read_call_words(name)
        assert (words.begun, words.done, words.in_flight) == (1, 1, False)
        assert words.last_call_s() is not None                 # no call runs: a duration is known
        reader.call_done(0)                                    # a late repeat never moves done back
        writer.call_begun()
        reader.call_done(seq + 1)
        assert not read_call_words(name).in_flight
        with pytest.raises(RingBufferError, match="only its creator"):
            reader.call_begun()
        with pytest.raises(RingBufferError, match="only its creator"):
            reader.call_abandoned()
