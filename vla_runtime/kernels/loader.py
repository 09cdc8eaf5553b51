"""Compiles the CUDA kernels of ``cuda/`` with CuPy, lazily, once per module and device.

CuPy is optional: this module imports without it, and nothing here imports CuPy until a kernel
is first needed on a CUDA tensor. Every way of not being able to run a kernel (CuPy missing, no
driver or device, sources not found, a compile error) surfaces as ``KernelUnavailable`` with a
message that says what is missing and what to do; the dispatch functions turn that into the torch
fallback, and ``kernel_backend()`` reports it.

Sources are handed to ``cupy.RawModule`` as text with the local headers inlined, so CuPy's
compile cache (keyed on the text) sees every edit of a header, and NVRTC needs no include path.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

ENV_SOURCES = "VLA_RUNTIME_CUDA_DIR"
MODULES: dict[str, str] = {
    "masked_ffn": "masked_ffn.cu",
    "selected_row_ffn": "selected_row_ffn.cu",
    "rms_norm": "rms_norm.cu",
}
INSTALL_HINT = "install CuPy for the machine's CUDA (pip install cupy-cuda12x or cupy-cuda13x)"
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)


class KernelUnavailable(RuntimeError):
    """A CUDA kernel cannot run here; the message names the reason (the torch fallback still can)."""


def source_dirs() -> list[Path]:
    """Where the ``.cu`` sources are looked for, in order: ``$VLA_RUNTIME_CUDA_DIR``, the source
    tree's ``cuda/`` (a checkout or an editable install, what ``make setup`` makes), then
    ``share/vla_runtime/cuda`` of the install prefix (pip's ``sys.prefix``, or colcon's, which is
    five levels above this file in ``lib/pythonX.Y/site-packages``)."""
    here = Path(__file__).resolve()
    dirs = [Path(os.environ[ENV_SOURCES])] if os.environ.get(ENV_SOURCES) else []
    dirs.append(here.parents[2] / "cuda")
    for prefix in (Path(sys.prefix), here.parents[5] if len(here.parents) > 5 else None):
        if prefix is not None:
            dirs.append(prefix / "share" / "vla_runtime" / "cuda")
    return dirs


def source_dir() -> Path:
    """The first directory holding every kernel source, or ``KernelUnavailable``."""
    for d in source_dirs():
        if all((d / f).is_file() for f in MODULES.values()):
            return d
    raise KernelUnavailable("CUDA kernel sources (" + ", ".join(MODULES.values()) + ") not found in any of "
                            + ", ".join(str(d) for d in source_dirs()) + f"; set {ENV_SOURCES}")


def read_source(module: str, directory: Path | None = None) -> str:
    """The source of one kernel module with its local ``#include "..."`` headers inlined (once each)."""
    if module not in MODULES:
        raise KeyError(f"unknown kernel module {module!r}; known: {sorted(MODULES)}")
    directory = source_dir() if directory is None else directory
    return _inline(directory / MODULES[module], set())


def _inline(path: Path, seen: set[Path]) -> str:
    if path in seen:
        return ""
    seen.add(path)

    def include(match: re.Match) -> str:
        header = path.parent / match.group(1)
        if not header.is_file():
            raise KernelUnavailable(f"{path.name} includes {match.group(1)}, not found next to it")
        return _inline(header, seen)

    text = _PRAGMA_ONCE.sub("", path.read_text())  # inlined once each already; meaningless in one text
    return _LOCAL_INCLUDE.sub(include, text)  # a function's result is inserted verbatim


def import_cupy() -> Any:
    """The ``cupy`` module, or ``KernelUnavailable`` saying it is not installed or does not load."""
    try:
        import cupy
    except ImportError as e:
        raise KernelUnavailable(f"CuPy is not installed ({e}); {INSTALL_HINT}. The torch fallbacks run "
                                f"instead") from e
    except Exception as e:  # a CuPy build for another CUDA can fail at import with other errors
        raise KernelUnavailable(f"CuPy failed to import ({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    return cupy


def device_summary(cupy: Any) -> str:
    """'N CUDA device(s): names', or ``KernelUnavailable`` when there is no usable driver/device."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError without a driver, or a CuPy/driver version mismatch
        raise KernelUnavailable(f"CuPy is installed but finds no usable CUDA driver or device "
                                f"({type(e).__name__}: {e})") from e
    if count < 1:
        raise KernelUnavailable("CuPy is installed but no CUDA device is visible")
    names = []
    for i in range(count):
        try:
            name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # names are informational only
            names.append(f"device {i}")
    return f"{count} CUDA device(s): {', '.join(names)}"


def availability() -> str:
    """'CuPy <version>, N CUDA device(s): ...; kernels from <dir>', or ``KernelUnavailable`` saying
    what is missing. Probed once (the dispatch asks on every call) until ``reset()``."""
    with _registry.lock:
        if _registry.probe is None:
            try:
                cupy = import_cupy()
                _registry.probe = f"CuPy {cupy.__version__}, {device_summary(cupy)}; kernels from {source_dir()}"
            except KernelUnavailable as e:
                _registry.probe = e
        probe = _registry.probe
    if isinstance(probe, KernelUnavailable):
        raise KernelUnavailable(str(probe))
    return probe


class _Registry:
    """Compiled modules per (module, device index), their kernels, the failures seen, the probe.
    One re-entrant lock: compiling probes availability under it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.modules: dict[tuple[str, int], Any] = {}
        self.functions: dict[tuple[str, int, str], Any] = {}
        self.failures: dict[tuple[str, int], str] = {}
        self.probe: str | KernelUnavailable | None = None


_registry = _Registry()


def function(module: str, name: str, device: int) -> Any:
    """The ``RawKernel`` ``name`` of ``module`` compiled for CUDA device ``device``.

    Compiles the module on first use on that device; a failure is remembered (and re-raised as
    ``KernelUnavailable`` on later calls) so a broken build costs one attempt, not one per call.
    """
    key = (module, device)
    with _registry.lock:
        fn = _registry.functions.get((module, device, name))
        if fn is not None:
            return fn
        if key in _registry.failures:
            raise KernelUnavailable(_registry.failures[key])
        mod = _registry.modules.get(key)
        if mod is None:
            mod = _compile(module, device)
        try:
            with import_cupy().cuda.Device(device):
                fn = mod.get_function(name)
        except Exception as e:
            msg = f"CUDA kernel {name} of {MODULES[module]} is not usable on device {device}: {type(e).__name__}: {e}"
            _registry.failures[key] = msg
            raise KernelUnavailable(msg) from e
        _registry.functions[(module, device, name)] = fn
        return fn


def _compile(module: str, device: int) -> Any:
    """RawModule of one source for one device (caller holds the lock); failures are recorded."""
    key = (module, device)
    try:
        availability()
        cupy = import_cupy()
        code = read_source(module)
        with cupy.cuda.Device(device):
            mod = cupy.RawModule(code=code)  # NVRTC for the current device's architecture; C++11 suffices
            compile_now = getattr(mod, "compile", None)  # CuPy >= 9; older ones compile at get_function
            if compile_now is not None:
                compile_now()  # now, not at the first launch: errors surface here, once
    except KernelUnavailable as e:
        _registry.failures[key] = str(e)
        raise
    except Exception as e:
        msg = f"CUDA kernels of {MODULES[module]} failed to compile on device {device}: {type(e).__name__}: {e}"
        _registry.failures[key] = msg
        raise KernelUnavailable(msg) from e
    _registry.modules[key] = mod
    return mod


def compile_all(device: int) -> dict[str, str | None]:
    """Compile every module for ``device`` now; maps module -> None (ok) or the failure message."""
    result: dict[str, str | None] = {}
    for module in MODULES:
        try:
            with _registry.lock:
                if (module, device) in _registry.failures:
                    raise KernelUnavailable(_registry.failures[(module, device)])
                if (module, device) not in _registry.modules:
                    _compile(module, device)
            result[module] = None
        except KernelUnavailable as e:
            result[module] = str(e)
    return result


def failures(device: int | None = None) -> dict[str, str]:
    """Compile/load failures seen so far on ``device`` (any device: None), per module."""
    with _registry.lock:
        return {m: msg for (m, d), msg in _registry.failures.items() if device is None or d == device}


def reset() -> None:
    """Forget compiled modules and failures (tests; after installing CuPy in a running process)."""
    with _registry.lock:
        _registry.modules.clear()
        _registry.functions.clear()
        _registry.failures.clear()
        _registry.probe = None


def stream_context(device: int, stream_ptr: int) -> Any:
    """Context manager making CuPy launch on ``device`` into the given (torch) stream."""
    from contextlib import ExitStack

    cupy = import_cupy()
    stack = ExitStack()
    stack.enter_context(cupy.cuda.Device(device))
    stack.enter_context(cupy.cuda.ExternalStream(stream_ptr))
    return stack
