"""CUDA kernels of the runtime (``cuda/*.cu``, compiled with CuPy) with their torch fallbacks.

Four entry points, each running the CUDA kernel on CUDA tensors when CuPy and a device are
there and the pure-torch fallback otherwise (always on CPU):

- ``masked_ffn``: the Action Cache's masked FFN update (rMuscle Eq. 4), reading only the
  selected neurons' weight rows, in place;
- ``selected_row_ffn``: the Context Cache's FFN over the rows chosen for recompute, scattered
  into an output pre-filled with the reference's FFN outputs (Eq. 3);
- ``fused_add_rms_norm`` / ``fused_add_ada_rms_norm``: residual add fused with Gemma RMSNorm /
  adaptive RMSNorm, fp32 statistics.

``kernel_backend()`` says which one runs here and why; ``use_backend('torch')`` (or the
environment variable ``VLA_RUNTIME_KERNELS=torch``) switches the kernels off. CuPy is imported
lazily, on the first call with CUDA tensors: importing this package never needs it.
"""

from .loader import KernelUnavailable
from .ops import (BACKENDS, ENV_BACKEND, Backend, backend_setting, fused_add_ada_rms_norm, fused_add_rms_norm,
                  kernel_backend, masked_ffn, selected_row_ffn, use_backend, would_use_cupy)

__all__ = ["BACKENDS", "ENV_BACKEND", "Backend", "KernelUnavailable", "backend_setting", "fused_add_ada_rms_norm",
           "fused_add_rms_norm", "kernel_backend", "masked_ffn", "selected_row_ffn", "use_backend", "would_use_cupy"]
