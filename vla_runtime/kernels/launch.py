"""Launches of the CUDA kernels on torch tensors: launch shapes, argument packing, stream.

The kernels stay simple (one warp per (row, neuron) dot product, one thread per output column,
one block per normalised row); every shape decision lives here. Kernels run on torch's current
stream of the tensors' device, so they order correctly with the surrounding torch ops and can be
captured in a CUDA graph. Callers (``ops.py``) have already checked device, dtypes and
contiguity (``launchable``); index vectors must hold valid indices (they come from ``topk`` and
the cache's masks): a kernel does not bounds-check them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import loader

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
ACT_WARPS = 8          # warps per block of the gated-activation kernels (one (row, neuron) each)
DOWN_THREADS = 128     # threads per block of the down projections (one output column each)
DOWN_ROWS = 4          # output rows per thread; must equal VLA_DOWN_ROWS in cuda/ffn.cuh
NORM_THREADS = 256     # threads per block of the norms (one row per block)
launches: dict[str, int] = {}  # kernel name -> launches in this process (diagnostics: did a kernel run?)


def launchable(*tensors: Tensor | None, vectors: tuple[Tensor | None, ...] = (),
               index: tuple[Tensor | None, ...] = ()) -> bool:
    """Whether the kernels can take these tensors as they are: activations of one supported dtype,
    contiguous on one CUDA device; per-feature vectors (norm scale/shift/gate) floating point on
    that device (passed to the kernel as fp32, see ``_fp32``); int64 contiguous index vectors."""
    first = tensors[0]
    if first is None or first.device.type != "cuda" or first.dtype not in SUFFIX:
        return False
    same = lambda t: t.device == first.device  # noqa: E731
    return (all(t is None or (t.dtype == first.dtype and same(t) and t.is_contiguous()) for t in tensors)
            and all(t is None or (t.is_floating_point() and same(t)) for t in vectors)
            and all(t is None or (t.dtype == torch.int64 and same(t) and t.is_contiguous()) for t in index))


def _fp32(v: Tensor | None) -> Tensor | None:
    """A per-feature vector as contiguous fp32. Exact: the torch path promotes a bf16/fp16 vector to
    fp32 in these mixed ops too (a bf16 model converted with ``.to`` keeps its tables in bf16)."""
    return None if v is None else v.to(torch.float32).contiguous()


def _ptr(t: Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _i32(v: int) -> np.int32:
    if not 0 <= v < 2 ** 31:
        raise ValueError(f"kernel size argument {v} out of int32 range")
    return np.int32(v)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run(module: str, name: str, like: Tensor, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
    device = like.device.index if like.device.index is not None else torch.cuda.current_device()
    fn = loader.function(module, f"{name}_{SUFFIX[like.dtype]}", device)
    with loader.stream_context(device, torch.cuda.current_stream(like.device).cuda_stream):
        fn(grid, block, args)
    launches[name] = launches.get(name, 0) + 1


def _output(out: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Where a kernel writes: ``out`` when it is contiguous, else a fresh buffer copied into it after."""
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out must be {list(shape)}, got {list(out.shape)}")
    if out is not None and out.is_contiguous():
        return out
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def masked_ffn(x: Tensor, gate_up: Tensor, down_t: Tensor, neurons: Tensor, h_anchor: Tensor | None,
               y_anchor: Tensor | None, out: Tensor | None) -> Tensor:
    """Masked FFN update (cuda/masked_ffn.cu): x [T, W], gate_up [nb, 2B, W], down_t [H, W], neurons [K]."""
    t, w = x.shape
    k = neurons.numel()
    block = gate_up.shape[1] // 2
    if gate_up.shape[2] != w or down_t.shape[1] != w or gate_up.shape[0] * block != down_t.shape[0]:
        raise ValueError(f"weights {list(gate_up.shape)} / {list(down_t.shape)} do not fit x {list(x.shape)}")
    for name, a, shape in (("h_anchor", h_anchor, (t, k)), ("y_anchor", y_anchor, (t, w))):
        if a is not None and tuple(a.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(a.shape)}")
    target = _output(out, (t, w), x)
    if t == 0:
        return target if out is None else out
    act = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if k:
        _run("masked_ffn", "masked_ffn_act", x, (k, _cdiv(t, ACT_WARPS)), (32 * ACT_WARPS,),
             (_ptr(x), _ptr(gate_up), _ptr(neurons), _ptr(h_anchor), _ptr(act), _i32(t), _i32(k), _i32(w),
              _i32(block)))
    _run("masked_ffn", "masked_ffn_down", x, (_cdiv(w, DOWN_THREADS), _cdiv(t, DOWN_ROWS)), (DOWN_THREADS,),
         (_ptr(act), _ptr(down_t), _ptr(neurons), _ptr(y_anchor), _ptr(target), _i32(t), _i32(k), _i32(w)))
    return _finish(target, out)


def selected_row_ffn(x: Tensor, rows: Tensor, gate_up: Tensor, down_t: Tensor, out: Tensor) -> Tensor:
    """Selected-row FFN with scatter (cuda/selected_row_ffn.cu): out[rows] = MLP(x[rows]), x/out [P, W]."""
    p, w = x.shape
    r = rows.numel()
    h = down_t.shape[0]
    block = gate_up.shape[1] // 2
    if gate_up.shape[2] != w or down_t.shape[1] != w or gate_up.shape[0] * block != h:
        raise ValueError(f"weights {list(gate_up.shape)} / {list(down_t.shape)} do not fit x {list(x.shape)}")
    target = out if out.is_contiguous() else out.contiguous()  # other rows must keep their values
    if tuple(out.shape) != (p, w):
        raise ValueError(f"out must be {[p, w]}, got {list(out.shape)}")
    if r == 0:
        return out
    act = torch.empty(r, h, dtype=torch.float32, device=x.device)
    _run("selected_row_ffn", "selected_row_ffn_act", x, (h, _cdiv(r, ACT_WARPS)), (32 * ACT_WARPS,),
         (_ptr(x), _ptr(rows), _ptr(gate_up), _ptr(act), _i32(r), _i32(h), _i32(w), _i32(block)))
    _run("selected_row_ffn", "selected_row_ffn_down", x, (_cdiv(w, DOWN_THREADS), _cdiv(r, DOWN_ROWS)),
         (DOWN_THREADS,), (_ptr(act), _ptr(down_t), _ptr(rows), _ptr(target), _i32(r), _i32(h), _i32(w),
                           _i32(block)))
    return _finish(target, out)


def fused_add_rms_norm(residual: Tensor, delta: Tensor | None, scale: Tensor, eps: float,
                       out: Tensor | None) -> tuple[Tensor, Tensor]:
    """residual += delta; normed = RMSNorm(residual) * scale (cuda/rms_norm.cu), residual contiguous."""
    w, rows = _norm_shape(residual, delta, scale=scale)
    scale = _fp32(scale)
    normed = _output(out, tuple(residual.shape), residual)
    if rows:
        _run("rms_norm", "fused_add_rms_norm", residual, (rows,), (NORM_THREADS,),
             (_ptr(residual), _ptr(delta), _ptr(scale), _ptr(normed), _i32(w), np.float32(eps)))
    return residual, _finish(normed, out)


def fused_add_ada_rms_norm(residual: Tensor, delta: Tensor | None, gate: Tensor | None, scale: Tensor,
                           shift: Tensor | None, eps: float, out: Tensor | None) -> tuple[Tensor, Tensor]:
    """residual += delta * gate; normed = RMSNorm(residual) * scale + shift (cuda/rms_norm.cu)."""
    w, rows = _norm_shape(residual, delta, scale=scale, gate=gate, shift=shift)
    gate, scale, shift = _fp32(gate), _fp32(scale), _fp32(shift)
    normed = _output(out, tuple(residual.shape), residual)
    if rows:
        _run("rms_norm", "fused_add_ada_rms_norm", residual, (rows,), (NORM_THREADS,),
             (_ptr(residual), _ptr(delta), _ptr(gate), _ptr(scale), _ptr(shift), _ptr(normed), _i32(w),
              np.float32(eps)))
    return residual, _finish(normed, out)


def _norm_shape(residual: Tensor, delta: Tensor | None, **vectors: Tensor | None) -> tuple[int, int]:
    """(width, rows) of a norm launch, after checking that delta and the fp32 vectors fit."""
    w = residual.shape[-1]
    if delta is not None and delta.shape != residual.shape:
        raise ValueError(f"delta must be shaped like the residual {list(residual.shape)}, got {list(delta.shape)}")
    for name, v in vectors.items():
        if v is not None and v.numel() != w:
            raise ValueError(f"{name} must hold {w} values (one per feature), got {list(v.shape)}")
    return w, residual.numel() // max(w, 1)


def _finish(target: Tensor, out: Tensor | None) -> Tensor:
    if out is None or target is out:
        return target
    return out.copy_(target)
