"""Dense against cached through the pipeline a robot runs, side by side in one run (JSON out).

Not part of CI. The same episode bags play the robot (as ``vla-runtime run`` does) through two
pipelines started side by side from one robot profile: one with the cache off, one with it on
(``--halves on``: both halves forced, as ``make demo`` compares; ``--halves auto``: what the
runtime picks by default from the repository's recorded half timing). Episodes alternate between the two, each
announced ahead (the cache manager's initial window, what a robot's reset gives it), and call i
of an episode draws the same noise in both, so the action deviation compares like with like.

    python bench/pipeline_cache.py --profile config/sim.yaml --checkpoint out/demo/checkpoint \\
        --repository out/demo/repo --episodes out/demo/episodes/held_out --processes 3 --out out/pc.json

Reports per mode the median of every phase and of the whole call, the speed-up per call, the
cached share of calls and why the others ran dense, the cost of selection on the critical path
(``select``), the action deviation of each cached chunk from the dense one (relative L2: mean,
worst) and each stage process's peak resident and unique memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla_runtime.io.bags import list_episode_bags, profile_topics, read_episode  # noqa: E402
from vla_runtime.nodes.pipeline import make_pipeline  # noqa: E402
from vla_runtime.nodes.stages import RingNames  # noqa: E402
from vla_runtime.commands.run import RunSpec, pipeline_spec  # noqa: E402


def _memory(pipeline) -> dict[str, dict[str, float]]:
    """Resident and unique (USS) memory of each stage process now, MB (psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for name, p in getattr(pipeline, "processes", {}).items():
        try:
            info = psutil.Process(p.pid).memory_full_info()
            out[name] = {"rss_mb": info.rss / 2**20, "uss_mb": info.uss / 2**20}
        except (psutil.Error, AttributeError):
            pass
    return out


def _peak(acc: dict, now: dict) -> None:
    for name, m in now.items():
        cur = acc.setdefault(name, {k: 0.0 for k in m})
        for k, v in m.items():
            cur[k] = max(cur[k], v)


def run(args: argparse.Namespace) -> dict:
    bags = [e for b in map(Path, args.episodes) for e in ([b] if (b / "metadata.yaml").exists() else list_episode_bags(b))]
    base = RunSpec(bags[0], Path(args.profile), Path(args.checkpoint) if args.checkpoint else None, args.processes,
                   True, Path(args.repository), args.call_period, args.seed, args.threads)
    cached_spec, profile = pipeline_spec(base)
    tag = f"pc{os.getpid()}"
    cached_spec = dataclasses.replace(cached_spec, rings=RingNames.tagged(tag + "c"), cache=dataclasses.replace(
        cached_spec.cache, enabled=True, context_cache=args.halves, action_cache=args.halves),
        episode_ready_s=args.episode_ready_s)
    dense_spec = dataclasses.replace(cached_spec, rings=RingNames.tagged(tag + "d"),
                                     cache=dataclasses.replace(cached_spec.cache, enabled=False))
    episodes = [read_episode(b, profile_topics(profile), args.call_period, state_dim=profile.state_dim) for b in bags]
    calls = {"dense": [], "cached": []}
    memory: dict = {"dense": {}, "cached": {}}
    chunks: dict = {}
    t0 = time.perf_counter()
    with make_pipeline(dense_spec, args.processes) as dense, make_pipeline(cached_spec, args.processes) as cached:
        start_s = time.perf_counter() - t0
        pipes = {"dense": dense, "cached": cached}
        for rep in range(args.repeats):
            for k, ep in enumerate(episodes):
                order = ("dense", "cached") if (rep + k) % 2 == 0 else ("cached", "dense")
                for mode in order:
                    p = pipes[mode]
                    p.start_episode(ep.instruction_at(0), noise_seed=1000 * rep + k)
                    for i, frame in enumerate(ep.frames):
                        t1 = time.perf_counter()
                        res = p.call(frame.images, np.asarray(frame.state), ep.instruction_at(i), start_tick=i)
                        wall = time.perf_counter() - t1
                        choice = p.last_choice
                        calls[mode].append({"episode": k, "repeat": rep, "call": i, "wall_s": wall,
                                            "phases": {n: float(v) for n, v in p.last_times.items()},
                                            "cached": bool(res.cached), "context": bool(res.meta.context_cache),
                                            "action": bool(res.used_reference),
                                            "dense_reason": None if choice is None or choice.found else choice.reason})
                        chunks[(mode, rep, k, i)] = np.asarray(res.chunk, dtype=np.float64)
                    _peak(memory[mode], _memory(p))
                    print(f"repeat {rep} episode {k} {mode}: {len(ep.frames)} calls, "
                          f"{sum(c['cached'] for c in calls[mode][-len(ep.frames):])} cached", file=sys.stderr)
    devs = []
    for x in calls["cached"]:
        if x["cached"]:
            at = (x["repeat"], x["episode"], x["call"])
            c, d = chunks[("cached", *at)], chunks[("dense", *at)]
            devs.append(float(np.linalg.norm(c - d) / max(np.linalg.norm(d), 1e-12)))

    def summary(cs: list[dict]) -> dict:
        phases = sorted({n for c in cs for n in c["phases"]})
        reasons: dict[str, int] = {}
        for c in cs:
            if not c["cached"]:
                reasons[c["dense_reason"] or "cache off"] = reasons.get(c["dense_reason"] or "cache off", 0) + 1
        return {"calls": len(cs), "cached_calls": sum(c["cached"] for c in cs),
                "cached_share": sum(c["cached"] for c in cs) / len(cs) if cs else None,
                "median_call_s": statistics.median(c["wall_s"] for c in cs),
                "mean_call_s": statistics.fmean(c["wall_s"] for c in cs),
                "median_phase_s": {n: statistics.median(c["phases"][n] for c in cs if n in c["phases"]) for n in phases},
                "max_select_s": max((c["phases"].get("select", 0.0) for c in cs), default=0.0),
                "dense_reasons": reasons}

    d, c = summary(calls["dense"]), summary(calls["cached"])
    return {"profile": str(args.profile), "checkpoint": str(cached_spec.checkpoint), "repository": args.repository,
            "processes": args.processes, "threads": args.threads, "halves": args.halves,
            "episode_ready_s": args.episode_ready_s, "episodes": [str(b) for b in bags],
            "repeats": args.repeats, "start_s": start_s, "load_average": os.getloadavg(),
            "dense": d, "cached": c,
            "speedup_per_call_median": d["median_call_s"] / c["median_call_s"],
            "speedup_per_call_mean": d["mean_call_s"] / c["mean_call_s"],
            "speedup_per_phase_median": {n: d["median_phase_s"][n] / c["median_phase_s"][n]
                                         for n in d["median_phase_s"] if n in c["median_phase_s"]},
            "action_deviation": {"cached_chunks": len(devs), "mean_rel_l2": statistics.fmean(devs) if devs else None,
                                 "worst_rel_l2": max(devs) if devs else None},
            "peak_memory_mb": memory}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--repository", required=True)
    ap.add_argument("--episodes", nargs="+", required=True, help="episode bags, or folders of them")
    ap.add_argument("--processes", type=int, default=3, choices=(1, 3))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--call-period", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--halves", choices=("on", "auto"), default="on",
                    help="on: both halves forced (default); auto: as the runtime picks from the recorded timing")
    ap.add_argument("--episode-ready-s", type=float, default=120.0,
                    help="how long an episode's announcement may wait for the initial window (a robot's reset)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2, default=float)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    d, c = report["dense"], report["cached"]
    print(f"dense {d['median_call_s'] * 1e3:.1f} ms, cached {c['median_call_s'] * 1e3:.1f} ms per call (median): "
          f"{report['speedup_per_call_median']:.2f}x; {c['cached_calls']}/{c['calls']} calls cached; select "
          f"{c['median_phase_s'].get('select', float('nan')) * 1e3:.2f} ms median; deviation "
          f"{report['action_deviation']['mean_rel_l2']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
