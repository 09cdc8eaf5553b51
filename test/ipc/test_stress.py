"""The hand-off harness: one writer and reader processes on a host ring (the CUDA run itself is in
test/gpu/gpu_checks.py), and its backend choice."""

from __future__ import annotations

import os
import uuid

import pytest

from vla_runtime.ipc.stress import StressSpec, run_stress, small_layout


def test_stress_spec_takes_the_cpu_or_cuda_backend_only():
    layout = small_layout(16).to_json()
    assert StressSpec(layout).backend == "cpu"                     # the default: host shared memory
    StressSpec(layout, backend="cuda", device=0)                     # accepted; the CUDA run itself needs a
                                                                     # GPU (test/gpu/gpu_checks.py, check_ipc)
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda'"):
        StressSpec(layout, backend="rocm")


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
    assert not os.path.exists(f"/dev/shm/{name}")             # the writer unlinked its segment
