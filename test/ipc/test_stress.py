"""The hand-off harness's backend choice (the CUDA run itself is in test/gpu/gpu_checks.py)."""

from __future__ import annotations

import pytest

from vla_runtime.ipc.stress import StressSpec, small_layout


def test_stress_spec_takes_the_cpu_or_cuda_backend_only():
    layout = small_layout(16).to_json()
    assert StressSpec(layout).backend == "cpu"                     # the default: host shared memory
    StressSpec(layout, backend="cuda", device=0)                     # accepted; the CUDA run itself needs a
                                                                     # GPU (test/gpu/gpu_checks.py, check_ipc)
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda'"):
        StressSpec(layout, backend="rocm")
