"""``vla-runtime bench --stream``: synchronous vs streaming control, per stitching mode (JSON).

Runs the control-loop harness (:mod:`vla_runtime.sim.control_loop`) with a real pi0.5 policy
(the random-weight demo preset, or ``--checkpoint``) in simulated time: once in the
synchronous baseline (execute half a chunk, then observe and wait), then streaming with each
stitching mode. Latency is either each call's measured wall time on this machine, or injected
(``--latency-ms``, e.g. 40 for full pi0.5 on an RTX 4090); the engine runs for its actions
either way. Stall rate and reaction latency depend only on latency and scheduling, so they
are meaningful with random weights; boundary jerk also reflects the (random) actions and is
for comparing modes with each other, not with a trained policy.
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..engine.stitching import STITCH_MODES, StitchConfig
from ..sim.control_loop import HarnessConfig, HarnessResult, run_harness, spread_events


@dataclass
class StreamBenchSpec:
    preset: str = "pi05-small"
    checkpoint: str | None = None
    cameras: tuple[str, ...] = ("top", "wrist")
    latency_ms: float | None = None       # None: measured wall time of each call
    duration_s: float = 10.0
    control_hz: float = 50.0
    n_execute: int | None = None          # None: half a chunk
    stream_horizon: int | None = 1        # 1: continuous re-planning; None: just in time (n_execute)
    modes: tuple[str, ...] = STITCH_MODES
    threads: int | None = None
    seed: int = 0

    def validate(self) -> "StreamBenchSpec":
        if self.latency_ms is not None and not self.latency_ms >= 0:
            raise ValueError(f"--latency-ms must be >= 0, got {self.latency_ms}")
        if not self.duration_s >= 2.0:
            raise ValueError(f"--duration must be >= 2 s (events need time to be reacted to), got {self.duration_s}")
        unknown = set(self.modes) - set(STITCH_MODES)
        if unknown or not self.modes:
            raise ValueError(f"stitching modes must be among {STITCH_MODES}, got {self.modes}")
        return self


def _summary(r: HarnessResult, sync: HarnessResult | None) -> dict:
    med, base = r.reaction_latency_median_s, (sync.reaction_latency_median_s if sync else None)
    return {"stall_rate": round(r.stall_rate, 4), "reaction_median_ms": None if med is None else round(1e3 * med, 1),
            "reaction_reduction_vs_sync": None if (med is None or not base) else round(1.0 - med / base, 3),
            "boundary_rms_jerk": round(r.boundary_jerk.get("boundary_rms_jerk", float("nan")), 2),
            "rms_jerk": round(r.boundary_jerk.get("rms_jerk", float("nan")), 2),
            "calls": r.calls, "concurrent_calls_max": r.concurrent_calls_max, "late_chunks": r.late_chunks,
            "latency_p50_ms": round(1e3 * r.latency_s.get("p50", float("nan")), 1)}


def run_stream_bench(spec: StreamBenchSpec, log=print) -> dict:
    import torch

    from ..engine.policy import Pi05Policy
    from .demo import DEMO_TASK, DemoSpec, make_demo

    spec = spec.validate()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    with tempfile.TemporaryDirectory(prefix="vla-stream-bench-") as tmp:
        task = DEMO_TASK
        if spec.checkpoint:
            ckpt, cams = spec.checkpoint, list(spec.cameras)
        else:
            log(f"building the {spec.preset} demo checkpoint (random weights) ...")
            info = make_demo(Path(tmp) / "demo", DemoSpec(preset=spec.preset, episodes=2, held_out=1,
                                                          steps_per_episode=20, seed=spec.seed), log=lambda _: None)
            ckpt, cams, task = info["checkpoint"], info["cameras"], info["task"]
        policy = Pi05Policy.from_checkpoint(ckpt, camera_names=cams)
    latency = "measured" if spec.latency_ms is None else spec.latency_ms / 1e3
    events = spread_events(spec.duration_s - 1.0, every_s=1.0, seed=spec.seed)
    base = dict(control_hz=spec.control_hz, duration_s=spec.duration_s, n_execute=spec.n_execute, latency=latency,
                event_times_s=events, seed=spec.seed, task=task, render=policy.state_dim == 7)
    runs: dict[str, dict] = {}
    summary: dict[str, dict] = {}
    log(f"sync baseline, latency {latency!r} ...")
    sync = run_harness(HarnessConfig(mode="sync", **base), policy=policy)
    runs["sync"], summary["sync"] = sync.as_dict(), _summary(sync, None)
    for mode in spec.modes:
        log(f"streaming, stitching {mode!r} ...")
        r = run_harness(HarnessConfig(mode="stream", stitch=StitchConfig(mode=mode), stream_horizon=spec.stream_horizon,
                                      **base), policy=policy)
        runs[f"stream/{mode}"], summary[f"stream/{mode}"] = r.as_dict(), _summary(r, sync)
    if spec.stream_horizon is not None:
        mode = spec.modes[0]
        log(f"streaming just in time (next chunk due when this one's horizon ends), stitching {mode!r} ...")
        r = run_harness(HarnessConfig(mode="stream", stitch=StitchConfig(mode=mode), **base), policy=policy)
        runs[f"stream-jit/{mode}"], summary[f"stream-jit/{mode}"] = r.as_dict(), _summary(r, sync)
    chunk = policy.engine.cfg.chunk_size
    return {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "preset": None if spec.checkpoint else spec.preset, "checkpoint": spec.checkpoint,
        "latency": "measured" if spec.latency_ms is None else {"injected_ms": spec.latency_ms},
        "control_hz": spec.control_hz, "duration_s": spec.duration_s, "chunk_size": chunk,
        "n_execute": spec.n_execute or chunk // 2, "stream_horizon": spec.stream_horizon, "events_s": list(events), "summary": summary, "runs": runs,
        "notes": ["simulated time: figures depend on latency and scheduling, not on this machine's speed, "
                  "except that 'measured' latency is this machine's wall time per call",
                  "warm-up (the first call, waited for in every mode) is excluded from the stall rate",
                  "freeze keeps the ticks before the new chunk's start (the plan's time model does that for "
                  "every mode) and freezes freeze_steps more when set; with the default (unset) and a "
                  "tick-by-tick controller it executes like replace"],
    }
