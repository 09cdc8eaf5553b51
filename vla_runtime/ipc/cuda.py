"""CUDA payload backend of the ring buffer: slots in one device allocation shared via CUDA IPC.

The control block (seqlocks, headers, heartbeat) stays in host shared memory exactly as for the
CPU backend; only the payload moves to the GPU, so the ring's protocol is unchanged:

- the writer allocates once (``cupy.cuda.runtime.malloc``) and publishes the allocation's
  ``ipcGetMemHandle`` bytes in the control block; readers ``ipcOpenMemHandle`` it;
- both wrap the bytes as one torch ``uint8`` tensor through DLPack (zero copy) and cut typed
  field views out of it (offsets are 64-aligned, slot strides 256-aligned);
- ordering: GPU work is asynchronous, so the writer synchronises its current stream *before* the
  seqlock release (every kernel that filled the slot has finished), and a reader synchronises
  after its copies *before* re-reading the seqlock (the copy really happened inside the window).
  Writes and reader copies must therefore be issued on the current torch stream.

Lifetime: the writer frees the allocation when it closes its ring; CUDA leaves memory opened by
another process undefined once freed, so readers close first (they see the writer's pid cleared
or its heartbeat go stale). A process cannot open its own IPC handle, so reader and writer of a
CUDA ring are always different processes.

CuPy is optional: this module imports without it; creating or attaching a CUDA ring without CuPy
or a GPU raises ``RuntimeError("CUDA ring buffer needs CuPy and an NVIDIA GPU: ...")``.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import SlotLayout

_NEEDS = "CUDA ring buffer needs CuPy and an NVIDIA GPU: "


def require_cupy() -> Any:
    """The ``cupy`` module, or a clear RuntimeError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(_NEEDS + f"CuPy is not installed ({e}); pip install cupy-cuda12x") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver, or a CuPy/CUDA version mismatch
        raise RuntimeError(_NEEDS + f"no usable CUDA driver/device ({e})") from e
    if count < 1:
        raise RuntimeError(_NEEDS + "no CUDA device found")
    return cupy


class CudaAllocation:
    """One raw device allocation: owned (malloc/free) by the writer, IPC-opened by readers."""

    def __init__(self, cupy: Any, ptr: int, nbytes: int, device: int, owned: bool) -> None:
        self._cupy, self.ptr, self.nbytes, self.device, self.owned = cupy, ptr, nbytes, device, owned

    @classmethod
    def allocate(cls, nbytes: int, device: int | None = None) -> "CudaAllocation":
        cupy = require_cupy()
        dev = _default_device() if device is None else int(device)
        with cupy.cuda.Device(dev):
            ptr = cupy.cuda.runtime.malloc(nbytes)
            cupy.cuda.runtime.memset(ptr, 0, nbytes)
        return cls(cupy, ptr, nbytes, dev, owned=True)

    @classmethod
    def open_ipc(cls, handle: bytes, device: int, nbytes: int) -> "CudaAllocation":
        cupy = require_cupy()
        with cupy.cuda.Device(device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        return cls(cupy, ptr, nbytes, device, owned=False)

    def ipc_handle(self) -> bytes:
        with self._cupy.cuda.Device(self.device):
            return bytes(self._cupy.cuda.runtime.ipcGetMemHandle(self.ptr))

    def as_tensor(self) -> torch.Tensor:
        """The whole allocation as a flat uint8 torch tensor (DLPack, no copy, does not own it)."""
        cupy = self._cupy
        mem = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self, self.device)
        arr = cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.utils.dlpack.from_dlpack(arr)

    def free(self) -> None:
        if self.ptr == 0:
            return
        with self._cupy.cuda.Device(self.device):
            if self.owned:
                self._cupy.cuda.runtime.free(self.ptr)
            else:
                self._cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
        self.ptr = 0


class CudaPayload:
    """Per-slot field views over a ``CudaAllocation`` plus the stream syncs that order them."""

    def __init__(self, alloc: CudaAllocation, stride: int, layout: SlotLayout, slots: int) -> None:
        if stride * slots > alloc.nbytes:
            raise RuntimeError(f"CUDA ring allocation of {alloc.nbytes} bytes is smaller than {slots} slots "
                               f"of {stride} bytes")
        self._alloc, self._device = alloc, torch.device("cuda", alloc.device)
        base = alloc.as_tensor()
        self.views = [{f.name: base[s * stride + off:s * stride + off + f.nbytes].view(f.dtype).view(f.shape)
                       for f, off in zip(layout.fields, layout.offsets)} for s in range(slots)]

    def writes_done(self) -> None:
        torch.cuda.current_stream(self._device).synchronize()

    def copies_done(self) -> None:
        torch.cuda.current_stream(self._device).synchronize()

    def close(self) -> None:
        self.views = []
        self._alloc.free()


def _default_device() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else 0
