"""Property tests of the ring's sequence protocol (hypothesis): any sequence of commits, aborts,
targeted writes and slot clears, seen by a reader attached in the same process.

A model of what the protocol promises is kept alongside (which sequence each slot holds, the
newest committed sequence), and after every operation the reader must agree with it: commits
number payloads 0, 1, 2, ... whatever was aborted in between; a read of "slot k holds
sequence n" succeeds exactly while slot k still holds n, and then with n's payload; the latest
read never returns anything but the newest commit, intact, and finds it while its slot holds it
for a round-robin writer; nothing aborted is ever readable. (``read_latest`` looks in slot
``seq % slots``: a writer that targets slots announces them and readers use ``read``.)
"""

from __future__ import annotations

import os
import uuid

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vla_runtime.ipc.layout import FieldSpec, SlotLayout
from vla_runtime.ipc.ring import RingBuffer

LAYOUT = SlotLayout((FieldSpec("x", (4,), torch.float32), FieldSpec("tag", (1,), torch.int64)))

ops = st.lists(st.one_of(
    st.tuples(st.just("commit"), st.none()),
    st.tuples(st.just("commit"), st.integers(0, 3)),       # a targeted slot (working-set writers)
    st.tuples(st.just("abort"), st.none()),
    st.tuples(st.just("abort"), st.integers(0, 3)),
    st.tuples(st.just("clear"), st.integers(0, 3)),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 4), script=ops)
def test_reader_agrees_with_the_sequence_protocol(slots, script):
    name = f"vla_prop_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    holds = [-1] * slots            # model: the sequence each slot holds (-1 none)
    committed: list[tuple[int, int]] = []
    out = {"x": torch.empty(4), "tag": torch.empty(1, dtype=torch.int64)}
    with RingBuffer.create(name, LAYOUT, slots=slots) as writer, RingBuffer.attach(name, LAYOUT) as reader:
        for op, target in script:
            slot = None if target is None else target % slots
            if op == "clear":
                writer.clear_slot(slot)
                holds[slot] = -1
            else:
                wr = writer.begin_write(slot)
                expected_slot = wr.seq % slots if slot is None else slot
                assert wr.slot == expected_slot
                assert wr.seq == len(committed)                 # aborted writes do not use up a number
                holds[wr.slot] = -1                              # being rewritten: the old payload is gone
                if op == "abort":
                    wr.abort()
                else:
                    wr["x"].fill_(float(wr.seq))
                    wr["tag"].fill_(wr.seq)
                    assert wr.commit({"seq": wr.seq}) == (wr.slot, wr.seq)
                    holds[wr.slot] = wr.seq
                    committed.append((wr.slot, wr.seq))
            # the reader's view after every operation
            assert reader.latest_seq == (committed[-1][1] if committed else -1)
            assert reader.slot_seqs().tolist() == holds
            for s, n in committed:
                info = reader.read(s, n, out)
                assert (info is not None) == (holds[s] == n), (s, n, holds)
                if info is not None:
                    assert info.seq == n and info.meta == {"seq": n}
                    assert torch.all(out["x"] == n) and int(out["tag"]) == n
            latest = reader.read_latest(out)
            if latest is not None:                               # only ever the newest payload, intact
                assert latest.seq == committed[-1][1] and holds[latest.slot] == latest.seq
                assert int(out["tag"]) == latest.seq and torch.all(out["x"] == latest.seq)
            round_robin = all(t is None for o, t in script if o != "clear")
            if round_robin and committed and holds[committed[-1][0]] == committed[-1][1]:
                assert latest is not None                        # a round-robin writer's newest is found
            assert reader.read_latest(out, min_seq=len(committed) + 1) is None   # nothing newer exists
