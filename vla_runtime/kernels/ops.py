"""The kernel entry points: each runs the CUDA kernel or its torch fallback, per call.

Choice, per call: the CuPy kernel when the tensors are CUDA tensors it can take as they are
(supported dtype, contiguous, one device) and the backend allows it; the torch fallback
otherwise (always on CPU). The backend comes from ``use_backend(...)`` when set, else from the
environment variable ``VLA_RUNTIME_KERNELS``:

- ``auto``: the kernels where CuPy and a device are there; a kernel that fails to compile is
  reported once (warning) and its fallback used from then on;
- ``torch`` (default): the fallbacks everywhere. The default until the kernels have been
  checked on a GPU (``test/gpu/run_gpu_checks.sh`` compares them with the fallbacks and times
  both); a robot should not be the first place a kernel runs;
- ``cupy``: the kernels on CUDA tensors, and an error instead of a silent fallback when they
  cannot run.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from . import fallback, launch, loader
from .loader import KernelUnavailable

ENV_BACKEND = "VLA_RUNTIME_KERNELS"
BACKENDS = ("auto", "torch", "cupy")
DEFAULT_BACKEND = "torch"
_override = threading.local()
_warned: set[str] = set()


class Backend(NamedTuple):
    """What the dispatch functions run on CUDA tensors, and why."""

    name: str    # 'cupy' or 'torch'
    reason: str


def backend_setting() -> str:
    """The requested backend: ``use_backend`` override, else ``$VLA_RUNTIME_KERNELS``, else the default."""
    value = (getattr(_override, "value", None) or os.environ.get(ENV_BACKEND, DEFAULT_BACKEND).strip().lower()
             or DEFAULT_BACKEND)
    if value not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed calls (this thread) with backend ``name`` ('auto', 'torch' or 'cupy')."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    previous = getattr(_override, "value", None)
    _override.value = name
    try:
        yield
    finally:
        _override.value = previous


def kernel_backend(device: torch.device | str | int | None = None, compile_kernels: bool = False) -> Backend:
    """Which backend the dispatch functions use for CUDA tensors here, with the reason.

    Cheap by default (imports CuPy once, counts devices). With ``compile_kernels`` every module is
    compiled for ``device`` (default: the current CUDA device) and a failure is reported.
    CPU tensors always take the torch fallbacks, whatever this says.
    """
    if backend_setting() == "torch":
        if os.environ.get(ENV_BACKEND) is None and getattr(_override, "value", None) is None:
            return Backend("torch", f"the CUDA kernels are off by default until checked on a GPU "
                                    f"(test/gpu/run_gpu_checks.sh); {ENV_BACKEND}=auto turns them on")
        return Backend("torch", f"{ENV_BACKEND}=torch: the CUDA kernels are switched off")
    try:
        summary = loader.availability()
    except KernelUnavailable as e:
        return Backend("torch", str(e))
    index = _device_index(device)
    if compile_kernels:
        loader.compile_all(index)
    failed = loader.failures(index)
    if failed:
        return Backend("torch", "; ".join(failed.values()))
    how = "compiled" if compile_kernels else "compiled on first use"
    return Backend("cupy", f"{summary} ({how} for device {index})")


def would_use_cupy(like: Tensor, module: str) -> bool:
    """Whether a call of ``module``'s kernels on tensors like ``like`` (device, dtype) goes to CUDA,
    as far as can be told before launching (a compile failure at the first launch still falls
    back). Lets a caller skip preparing what only the fallback needs."""
    if like.device.type != "cuda" or like.dtype not in launch.SUFFIX or not _cupy_allowed():
        return False
    return module not in loader.failures(_device_index(like.device))


def _device_index(device: torch.device | str | int | None) -> int:
    if isinstance(device, int):
        return device
    d = torch.device("cuda") if device is None else torch.device(device)
    if d.type != "cuda":
        return 0
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _cupy_allowed() -> bool:
    """Whether the backend setting lets CUDA tensors go to the kernels here; in 'cupy' mode a
    missing CuPy or device is an error instead of a silent fallback."""
    setting = backend_setting()
    if setting == "torch":
        return False
    try:
        loader.availability()
    except KernelUnavailable:
        if setting == "cupy":
            raise
        return False
    return True


def _fell_back(kernel: str, error: KernelUnavailable) -> None:
    """A kernel could not run: an error in 'cupy' mode, else one warning per kernel, then the fallback."""
    if backend_setting() == "cupy":
        raise error
    if kernel not in _warned:
        _warned.add(kernel)
        warnings.warn(f"vla_runtime.kernels.{kernel}: using the torch fallback: {error}", RuntimeWarning, stacklevel=3)


def masked_ffn(x: Tensor, gate_up: Tensor, down_t: Tensor, neurons: Tensor, *, h_anchor: Tensor | None = None,
               y_anchor: Tensor | None = None, out: Tensor | None = None,
               gathered: tuple[Tensor, Tensor] | None = None, work: Tensor | None = None) -> Tensor:
    """The Action Cache's masked FFN update: ``y_anchor + (h[:, M] - h_anchor) @ down_t[M]``.

    x [T, W] (post-norm FFN input of one denoising step), ``gate_up`` [nb, 2B, W] and ``down_t``
    [H, W] the expert MLP's blocked weights, ``neurons`` [K] int64 the mask M; ``h_anchor`` [T, K]
    and ``y_anchor`` [T, W] the anchor step's activations of M and MLP output (both optional).
    The kernel reads the selected weight rows in place; ``gathered`` (compact weights prepared
    once per group) and ``work`` ([T, 2K] scratch) serve the torch fallback only.
    """
    if launch.launchable(x, gate_up, down_t, h_anchor, y_anchor, index=(neurons,)) and _cupy_allowed():
        try:
            return launch.masked_ffn(x, gate_up, down_t, neurons, h_anchor, y_anchor, out)
        except KernelUnavailable as e:
            _fell_back("masked_ffn", e)
    return fallback.masked_ffn(x, gate_up, down_t, neurons, h_anchor, y_anchor, out, gathered, work)


def selected_row_ffn(x: Tensor, rows: Tensor, gate_up: Tensor, down_t: Tensor, out: Tensor) -> Tensor:
    """The Context Cache's FFN: ``out[rows] = MLP(x[rows])``, other rows of ``out`` untouched.

    x and out [P, W] (``out`` pre-filled with the reference's FFN outputs), ``rows`` [R] int64
    the rows to recompute, ``gate_up`` [nb, 2B, W] / ``down_t`` [H, W] the VLM layer's MLP.
    """
    if launch.launchable(x, gate_up, down_t, index=(rows,)) and _cupy_allowed():
        try:
            return launch.selected_row_ffn(x, rows, gate_up, down_t, out)
        except KernelUnavailable as e:
            _fell_back("selected_row_ffn", e)
    return fallback.selected_row_ffn(x, rows, gate_up, down_t, out)


def fused_add_rms_norm(residual: Tensor, delta: Tensor | None, scale: Tensor, eps: float,
                       out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``residual += delta`` in place, then Gemma RMSNorm (fp32 statistics) times the folded
    ``scale`` (1 + weight, [W]). Returns (residual, normed)."""
    if launch.launchable(residual, delta, vectors=(scale,)) and _cupy_allowed():
        try:
            return launch.fused_add_rms_norm(residual, delta, scale, eps, out)
        except KernelUnavailable as e:
            _fell_back("fused_add_rms_norm", e)
    return fallback.fused_add_rms_norm(residual, delta, scale, eps, out)


def fused_add_ada_rms_norm(residual: Tensor, delta: Tensor | None, gate: Tensor | None, scale: Tensor,
                           shift: Tensor | None, eps: float, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``residual += delta * gate`` in place, then adaptive RMSNorm: ``rms_norm(residual) * scale +
    shift`` with (1 + scale, shift, gate) one step's row of the expert's modulation table.
    Returns (residual, normed)."""
    if launch.launchable(residual, delta, vectors=(gate, scale, shift)) and _cupy_allowed():
        try:
            return launch.fused_add_ada_rms_norm(residual, delta, gate, scale, shift, eps, out)
        except KernelUnavailable as e:
            _fell_back("fused_add_ada_rms_norm", e)
    return fallback.fused_add_ada_rms_norm(residual, delta, gate, scale, shift, eps, out)
