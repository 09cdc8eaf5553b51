"""Ring buffer: round trip, refusals, overwrite/torn detection, stale writers, multi-process stress.

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
from vla_runtime.ipc.stress import StressSpec, payload_matches, run_stress, small_layout, stamp_payload

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


def test_multi_process_stress_accepts_no_torn_read():
    """One writer and two reader processes (spawn), 2 slots, free-running writer: >= 20k
    hand-offs, every element of every payload carries its sequence, none torn accepted."""
    name = f"vla_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    spec = StressSpec(small_layout(1024).to_json(), slots=2, readers=2, handoffs_per_reader=10_000)
    res = run_stress(spec, timeout_s=300, name=name)
    assert res["handoffs"] >= 20_000
    assert res["torn_accepted"] == 0 and res["meta_mismatch"] == 0 and res["checksum_failures"] == 0
    assert all(r["accepted"] == 10_000 for r in res["per_reader"])
    assert res["writer_commits"] >= 10_000
    assert not _segment_exists(name)


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
