"""A full memory fence callable from Python, for the ring buffer's seqlock.

The seqlock needs two orderings: the writer's payload stores must become visible before its
"even" sequence store, and the reader's payload loads must complete before its second sequence
load (and after its first). Every step is a separate call into C (numpy element store, torch
copy kernel), so the compiler cannot move accesses across them; what remains is the CPU.

- x86-64 (TSO): stores are seen in program order by other cores and loads are not reordered with
  older loads, which is exactly what a seqlock needs; cross-thread work done by torch's
  intra-op pool is joined through a synchronising primitive before the call returns, and x86
  stores are causally ordered. The fence is therefore a no-op.
- Weakly ordered CPUs (aarch64, e.g. Jetson): we unlock and re-lock a private pthread mutex.
  The unlock is a store-release (orders every earlier access before it) and the lock an
  acquire RMW (orders every later access after it); on ARMv8 a release followed by an acquire
  is not reordered (RCsc), so the pair is a full barrier. Cost: two uncontended libc calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Callable

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i686", "x86"}


def _noop() -> None:
    return None


class _MutexFence:
    """Unlock-then-lock of a mutex this object alone holds: a full barrier on release/acquire CPUs."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("pthread") or ctypes.util.find_library("c")
        if name is None:
            raise RuntimeError("memory fence: cannot find libpthread/libc for a mutex-based barrier")
        lib = ctypes.CDLL(name)
        self._lock, self._unlock = lib.pthread_mutex_lock, lib.pthread_mutex_unlock
        self._mutex = ctypes.create_string_buffer(128)  # zeroed == PTHREAD_MUTEX_INITIALIZER on glibc
        if self._lock(self._mutex) != 0:
            raise RuntimeError("memory fence: pthread_mutex_lock failed")

    def __call__(self) -> None:
        self._unlock(self._mutex)
        self._lock(self._mutex)


def make_fence(machine: str | None = None) -> Callable[[], None]:
    """A full fence for this CPU (a no-op where the hardware already orders what we need)."""
    machine = (machine or platform.machine()).lower()
    return _noop if machine in _TSO_MACHINES else _MutexFence()
