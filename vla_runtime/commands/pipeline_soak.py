"""Soak of the three-process pipeline: many policy calls, flat memory, no NaN, no leaked shared memory.

The vision, cache-manager and policy stages run as three OS processes (``ProcessPipeline``: the
node deployment without ROS, the same stage code and shared-memory rings) on a small demo robot
(pi05-tiny, random weights, a reference repository from its own episodes, so most calls are
cached and the cache manager's window keeps sliding). The held-out episodes are replayed over
and over, each replay a new episode for the cache manager. Reported:

- calls, calls per second, calls with NaN/Inf in the chunk, cached calls;
- resident memory (RSS) of every stage process and of this one, and the shared memory of the
  pipeline's rings (``/dev/shm``), after the warm-up ("start") and at the end, plus samples in
  between (the trend is what "flat" is judged on);
- shared-memory segments left after a clean shutdown (must be none);
- a crash: every stage process SIGKILLed mid-run leaves its segments behind; a restarted
  pipeline with the same names replaces them (the dead writers' segments, ``replace_stale``),
  serves calls, and after its shutdown nothing is left.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..cache.builder import BuildConfig, build_repository
from ..engine.policy import Pi05Policy
from ..io.bags import list_episode_bags, read_episode
from ..nodes.pipeline import PipelineSpec, ProcessPipeline
from ..nodes.profile import CacheSpec, EngineSpec
from ..nodes.stages import RingNames
from .demo import DemoSpec, demo_topics, make_demo

SHM = Path("/dev/shm")
CAMS = ("top", "wrist")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def segments(prefix: str) -> dict[str, int]:
    """The shared-memory segments whose name starts with ``prefix``: name -> bytes in use."""
    out = {}
    for p in SHM.glob(f"{prefix}*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out[p.name] = st.st_blocks * 512
    return out


def dev_shm_used() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def prepare_demo(work: Path, log: Callable[[str], None]) -> tuple[Path, Path, list]:
    """A pi05-tiny demo robot and its reference repository under ``work`` (made once)."""
    ckpt, repo = work / "demo" / "checkpoint", work / "repo"
    if not (repo / "index.json").is_file():
        log(f"building the demo robot and its reference repository in {work}")
        info = make_demo(work / "demo", DemoSpec(preset="pi05-tiny", episodes=6, held_out=2, steps_per_episode=60),
                         log=lambda m: None)
        policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMS))
        build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), repo,
                         demo_topics(CAMS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
    episodes = [read_episode(b, demo_topics(CAMS), call_period=0.5)
                for b in list_episode_bags(work / "demo" / "episodes" / "held_out")]
    return ckpt, repo, episodes


FLAT_KB_PER_CALL = 0.5   # RSS trend above this (50 MB per 100k calls) is not flat


def rss_slopes(trend: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares RSS slope of every process over the samples, KB per call."""
    if len(trend) < 2:
        return {}
    x = np.asarray([t["calls"] for t in trend], dtype=np.float64)
    out = {}
    for name in trend[0]["rss_mb"]:
        y = np.asarray([t["rss_mb"][name] for t in trend], dtype=np.float64) * 1024
        out[name] = round(float(np.polyfit(x, y, 1)[0]), 4)
    return out


def _snapshot(pipeline: ProcessPipeline, prefix: str) -> dict[str, Any]:
    rss = {name: rss_bytes(p.pid) for name, p in pipeline.processes.items()}
    rss["parent"] = rss_bytes(os.getpid())
    segs = segments(prefix)
    return {"rss_bytes": rss, "shm_bytes": sum(segs.values()), "segments": len(segs), "dev_shm_used_bytes": dev_shm_used()}


def run_pipeline_soak(work: str | Path, calls: int = 200, warmup: int = 20, samples: int = 20,
                      threads: int = 1, crash_check: bool = True, prefix: str | None = None,
                      demo: tuple[Path, Path, list] | None = None,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """``demo``: (checkpoint, repository, episodes) of a pi05-tiny demo robot to use instead of
    making one in ``work``."""
    if calls < 1 or warmup < 0:
        raise ValueError("calls must be >= 1 and warmup >= 0")
    ckpt, repo, episodes = demo if demo is not None else prepare_demo(Path(work), log)
    prefix = prefix or f"soak{os.getpid()}"
    rings = RingNames.tagged(prefix)
    spec = PipelineSpec(ckpt, CAMS, CacheSpec(enabled=True, repository=str(repo)),
                        EngineSpec(preset="pi05-tiny", threads=threads), rings=rings, seed=0,
                        time_available_s=1.0, state_dim=7)
    frames = [(e, f) for e in episodes for f in e.frames]

    def drive(pipeline: ProcessPipeline, n: int, i0: int, stats: dict, on_sample=None, every: int = 0) -> int:
        for i in range(i0, i0 + n):
            ep, frame = frames[i % len(frames)]
            if frame is ep.frames[0]:
                # each replay of an episode is a new episode, announced as a robot's reset would:
                # the cache manager builds its initial window before the first call
                pipeline.start_episode(ep.task)
            res = pipeline.call(frame.images, np.asarray(frame.state), ep.task, start_tick=i)
            stats["calls"] += 1
            stats["nan_calls"] += int(not np.isfinite(res.chunk).all())
            stats["cached_calls"] += int(res.cached)
            if on_sample is not None and every and (i - i0 + 1) % every == 0:
                on_sample(i - i0 + 1)
        return i0 + n

    report: dict[str, Any] = {"preset": "pi05-tiny", "processes": 3, "threads_per_stage": threads,
                              "rings": list(rings.__dict__.values()), "warmup_calls": warmup}
    stats = {"calls": 0, "nan_calls": 0, "cached_calls": 0}
    t_start = time.perf_counter()
    with ProcessPipeline(spec) as pipeline:
        report["start_s"] = time.perf_counter() - t_start
        i = drive(pipeline, warmup, 0, {"calls": 0, "nan_calls": 0, "cached_calls": 0})
        start = _snapshot(pipeline, prefix)
        trend: list[dict[str, Any]] = []

        def sample(done: int) -> None:
            s = _snapshot(pipeline, prefix)
            trend.append({"calls": done, "seconds": round(time.perf_counter() - t0, 2),
                          "rss_mb": {k: round(v / 2**20, 1) for k, v in s["rss_bytes"].items()},
                          "shm_mb": round(s["shm_bytes"] / 2**20, 2)})
            log(f"{done}/{calls} calls, {done / (time.perf_counter() - t0):.1f}/s, RSS MB "
                f"{trend[-1]['rss_mb']}, rings {trend[-1]['shm_mb']} MB, NaN calls {stats['nan_calls']}")

        t0 = time.perf_counter()
        drive(pipeline, calls, i, stats, sample, max(1, calls // max(1, samples)))
        seconds = time.perf_counter() - t0
        end = _snapshot(pipeline, prefix)
    report.update(stats, seconds=seconds, calls_per_s=stats["calls"] / seconds, samples=trend)
    report["memory"] = {
        "start": start, "end": end,
        "rss_growth_mb": {k: round((end["rss_bytes"][k] - start["rss_bytes"][k]) / 2**20, 2) for k in start["rss_bytes"]},
        "rss_max_mb": {k: max(t["rss_mb"][k] for t in trend) for k in trend[0]["rss_mb"]} if trend else {},
        "shm_growth_bytes": end["shm_bytes"] - start["shm_bytes"],
        "rss_slope_kb_per_call": rss_slopes(trend)}
    report["memory"]["flat"] = (report["memory"]["shm_growth_bytes"] == 0 and all(
        v <= FLAT_KB_PER_CALL for v in report["memory"]["rss_slope_kb_per_call"].values()))
    report["leaked_after_shutdown"] = sorted(segments(prefix))
    if crash_check:
        report["crash"] = crash_and_restart(spec, prefix, frames, log)
    report["ok"] = (report["nan_calls"] == 0 and not report["leaked_after_shutdown"]
                    and (not crash_check or report["crash"]["ok"]))
    return report


def crash_and_restart(spec: PipelineSpec, prefix: str, frames: list, log: Callable[[str], None]) -> dict[str, Any]:
    """SIGKILL every stage mid-run, then start again under the same names: the dead writers'
    segments are replaced, calls are served, and a clean shutdown leaves nothing behind."""
    out: dict[str, Any] = {}
    pipeline = ProcessPipeline(spec)
    try:
        for i in range(3):
            ep, frame = frames[i % len(frames)]
            pipeline.call(frame.images, np.asarray(frame.state), ep.task)
        for p in pipeline.processes.values():
            os.kill(p.pid, signal.SIGKILL)
        for p in pipeline.processes.values():
            p.join(10)
        out["segments_after_kill"] = sorted(segments(prefix))
    finally:
        pipeline.close()
    log(f"all three stages SIGKILLed: left behind {out['segments_after_kill']}; restarting")
    calls, finite = 0, True
    with ProcessPipeline(spec) as again:
        out["segments_after_restart"] = sorted(segments(prefix))
        for i in range(5):
            ep, frame = frames[i % len(frames)]
            res = again.call(frame.images, np.asarray(frame.state), ep.task)
            calls += 1
            finite &= bool(np.isfinite(res.chunk).all())
    out["restart_calls"], out["restart_finite"] = calls, finite
    out["leaked_after_restart_shutdown"] = sorted(segments(prefix))
    out["ok"] = finite and calls == 5 and not out["leaked_after_restart_shutdown"]
    return out


def summary(report: dict[str, Any]) -> str:
    m = report["memory"]
    mb = lambda b: f"{b / 2**20:.1f}"   # noqa: E731
    rss = ", ".join(f"{k} {mb(m['start']['rss_bytes'][k])}->{mb(m['end']['rss_bytes'][k])} MB"
                    for k in m["start"]["rss_bytes"])
    slopes = ", ".join(f"{k} {v:.3f}" for k, v in m["rss_slope_kb_per_call"].items())
    return (f"{report['calls']} calls in {report['seconds']:.1f} s ({report['calls_per_s']:.1f}/s), "
            f"{report['cached_calls']} cached, {report['nan_calls']} with NaN; RSS {rss} (KB per call: {slopes}; "
            f"{'flat' if m['flat'] else 'NOT flat'}); rings "
            f"{mb(m['start']['shm_bytes'])}->{mb(m['end']['shm_bytes'])} MB, /dev/shm used "
            f"{mb(m['start']['dev_shm_used_bytes'])}->{mb(m['end']['dev_shm_used_bytes'])} MB; leaked after "
            f"shutdown: {report['leaked_after_shutdown'] or 'none'}"
            + (f"; crash: {len(report['crash']['segments_after_kill'])} segments left by the SIGKILLed stages, "
               f"replaced on restart, leaked after: {report['crash']['leaked_after_restart_shutdown'] or 'none'}"
               if "crash" in report else ""))
