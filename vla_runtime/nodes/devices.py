"""Which device a node runs its model on: ``auto`` picks CUDA where this process sees a GPU and
the CPU otherwise, so one profile (and one launch file) starts on a workstation and on a laptop.

On the CPU fallback the node says what latency to expect, before the robot waits on a first
call: the checkpoint's floating-point work per call (``models.flops``) over this CPU's measured
matrix-multiply throughput (``engine.timing.gemm_gflops``, a fraction of a second). Real calls run
below the GEMM ceiling, so the figure is a lower bound, stated as such.
"""

from __future__ import annotations

import logging
import re

from ..models.config import Pi05Config

log = logging.getLogger(__name__)

DEVICE_SETTINGS = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_problem(value: object) -> str:
    """Why ``value`` is not a device setting ('' when it is one)."""
    if isinstance(value, str) and _DEVICE.match(value):
        return ""
    return f"must be {DEVICE_SETTINGS}, got {value!r}"


def resolve_device(setting: str, cuda_available: bool, cuda_count: int = 1) -> str:
    """The torch device for a profile's ``engine.device``: ``auto`` is ``cuda`` when a GPU is
    visible, else ``cpu``; an explicit ``cuda[:N]`` without that GPU is refused (ValueError
    naming the way out) rather than silently run elsewhere."""
    if problem := device_problem(setting):
        raise ValueError(f"engine.device {problem}")
    if setting == "auto":
        return "cuda" if cuda_available else "cpu"
    if setting.startswith("cuda"):
        if not cuda_available:
            raise ValueError(f"engine.device is {setting!r} but no CUDA device is available to this process; "
                             "use device:=auto (CUDA when present, else CPU) or device:=cpu")
        index = int(setting.split(":")[1]) if ":" in setting else 0
        if index >= cuda_count:
            raise ValueError(f"engine.device is {setting!r} but this process sees {cuda_count} CUDA device(s)")
    return setting


def cpu_latency_note(cfg: Pi05Config, cameras: int, gflops: float, control_hz: float | None = None) -> str:
    """What a CPU call will cost, from the model's FLOPs per call and the measured GEMM rate."""
    from ..models.flops import dense_flops

    work = dense_flops(cfg, cfg.max_prefix_len, cameras) / 1e9
    seconds = work / max(gflops, 1e-9)
    chunk_s = f"; a chunk of {cfg.chunk_size} actions lasts {cfg.chunk_size / control_hz:.2f} s at " \
              f"{control_hz:g} Hz" if control_hz else ""
    return (f"no CUDA device: running on the CPU (device:=auto). A call is {work:.3g} GFLOP and this CPU "
            f"multiplies at about {gflops:.0f} GFLOP/s, so expect at least {seconds:.3g} s per call{chunk_s}")


def measured_cpu_gflops(dtype) -> float:
    """This CPU's matrix-multiply rate in ``dtype`` (about 0.1 s)."""
    from ..engine.timing import gemm_gflops

    return gemm_gflops(384, dtype, "cpu", repeats=2)
