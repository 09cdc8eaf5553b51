"""Reference selection in the vision process, old against new, side by side in one run (JSON out).

Not part of CI. What a call pays to choose its reference (``WindowSelector.choose``: keeping its
view of the published window up to date, then retrieval) for two implementations attached to
the same working set: this checkout's and a baseline revision's (``--baseline``, default
``main``), imported from ``git archive`` of that revision as the package ``vla_runtime_base``,
so the old code runs exactly as it was. The window is the real one: a cache stage of this
checkout publishes it, begins each episode (the initial window, untimed, as during a robot's
reset) and slides it after every call from the new selection (untimed: on a robot it overlaps
execution), so both selectors see the same window changes at every call. Then each selector
that has idle work (``WindowSelector.idle``: taking in those changes, which the vision process
does between calls) does it, timed apart (``idle``): it is off the call's path.

The robot replays the repository's reference episodes (each call's stored retrieval features and
joint state). Per call both selectors choose, in alternating order, on one thread (each after
``--pollute-mb`` of other memory traffic, untimed: in the vision process the ViT pass runs just
before the selection and leaves little of its data in the CPU's caches); the report
gives the median and p90 per-call cost of each (wall clock, and this thread's CPU time, which a
loaded machine inflates less), their ratio, how often they agree and the load average (the
machine may be shared).

    python bench/window_selection.py --checkpoint checkpoints/pi05-mw-metaworld \\
        --repository out/closed_loop/repository --out out/window_selection.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla_runtime.cache.repository import ReferenceRepository  # noqa: E402
from vla_runtime.engine.policy import Pi05Policy  # noqa: E402
from vla_runtime.nodes.profile import CacheSpec  # noqa: E402
from vla_runtime.nodes.selection import WindowSelector  # noqa: E402
from vla_runtime.nodes.stages import CacheStage, RingNames, manager_config  # noqa: E402

from baseline import import_revision, module, side_by_side_parser  # noqa: E402


def baseline_selector_class(rev: str, into: Path) -> type:
    """``WindowSelector`` of revision ``rev``, from its own package (``bench/baseline.py``)."""
    return module(import_revision(rev, into), "nodes.selection").WindowSelector


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": float(np.percentile(xs, 90)) * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3, "max_ms": max(xs) * 1e3}


def _idle(side: dict) -> str:
    return "none" if side["idle"] is None else f"{side['idle']['median_ms']:.3f} ms median"


def between_calls(selectors: dict, idle: dict[str, list[float]]) -> None:
    """The vision process's work between calls, for each selector that has some (timed apart)."""
    for name, sel in selectors.items():
        work = getattr(sel, "idle", None)
        if work is not None:
            t0 = time.perf_counter()
            work()
            idle[name].append(time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    repo = ReferenceRepository.open(args.repository)
    policy = Pi05Policy.from_checkpoint(args.checkpoint, camera_names=list(args.cameras))
    spec = CacheSpec(enabled=True, repository=str(args.repository), context_cache="on", action_cache="on")
    rings = RingNames.tagged(f"ws{os.getpid()}")
    stage = CacheStage(policy, spec, rings)
    if not stage.enabled:
        raise SystemExit(f"cache stage refused: {stage.disabled_reason}")
    retrieval = manager_config(spec, repo).retrieval
    tmp = tempfile.TemporaryDirectory(prefix="selbench")
    selectors = {"new": WindowSelector(repo, retrieval, rings.working_set, first_search_wait_s=600.0),
                 "old": baseline_selector_class(args.baseline, Path(tmp.name))(
                     repo, retrieval, rings.working_set, first_search_wait_s=600.0)}
    cost: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}   # this thread's CPU time: what load does not inflate
    idle: dict[str, list[float]] = {"old": [], "new": []}  # the work between calls (not on a call's path)
    found = {"old": 0, "new": 0}
    traffic = np.ones(int(args.pollute_mb * 2**20) // 4, dtype=np.float32)

    def pollute() -> None:
        """Read and write ``traffic`` once (what the ViT pass does to the caches before a selection)."""
        if traffic.size:
            np.multiply(traffic, 1.0, out=traffic)
    agree = calls = 0
    differ: list[dict] = []
    episode = 0
    try:
        for rep in range(args.repeats):
            for task in repo.tasks():
                for record in repo.episodes(task):
                    stage.begin(task, episode)
                    between_calls(selectors, idle)
                    for i in range(record.num_calls):
                        call = repo.load_call(record.episode_id, i)
                        features, state = call.retrieval, call.state_history[-1].numpy()
                        order = ("old", "new") if (calls % 2 == 0) else ("new", "old")
                        choices = {}
                        for name in order:
                            pollute()
                            c0, t0 = time.thread_time(), time.perf_counter()
                            choices[name] = selectors[name].choose(calls, task, episode, features, state)
                            cost[name].append(time.perf_counter() - t0)
                            cpu[name].append(time.thread_time() - c0)
                        keys = {n: c.selection.match.key if c.found else None for n, c in choices.items()}
                        agree += keys["old"] == keys["new"]
                        if keys["old"] != keys["new"]:
                            differ.append({"call": calls, "task": task, "episode": record.episode_id, "index": i,
                                           **{n: [c.selection.match.key, c.selection.match.similarity,
                                                  c.selection.match.joint_distance] if c.found else c.reason
                                              for n, c in choices.items()}})
                        for n in found:
                            found[n] += choices[n].found
                        calls += 1
                        stage.follow(choices["new"].selection)
                        stage.upkeep()
                        between_calls(selectors, idle)
                    episode += 1
            print(f"repeat {rep}: {calls} calls", file=sys.stderr)
    finally:
        for s in selectors.values():
            s.close()
        stage.close()
        tmp.cleanup()
    old, new = _stats(cost["old"]), _stats(cost["new"])
    old_cpu, new_cpu = _stats(cpu["old"]), _stats(cpu["new"])
    return {"checkpoint": str(args.checkpoint), "repository": str(args.repository), "baseline": args.baseline,
            "threads": torch.get_num_threads(), "repeats": args.repeats, "pollute_mb": args.pollute_mb, "calls": calls,
            "window": {"episodes": spec.episodes, "lookahead": spec.lookahead},
            "old": {**old, "found": found["old"], "thread_cpu": old_cpu,
                    "idle": _stats(idle["old"]) if idle["old"] else None},
            "new": {**new, "found": found["new"], "thread_cpu": new_cpu,
                    "idle": _stats(idle["new"]) if idle["new"] else None},
            "median_ratio_old_over_new": old["median_ms"] / new["median_ms"],
            "thread_cpu_median_ratio_old_over_new": old_cpu["median_ms"] / new_cpu["median_ms"],
            "same_choice": agree, "different_choices": differ,
            "load_average_start": load_start, "load_average_end": os.getloadavg()}


def main() -> int:
    ap = side_by_side_parser(__doc__, "WindowSelector")
    ap.add_argument("--repeats", type=int, default=3, help="passes over every reference episode")
    ap.add_argument("--pollute-mb", type=float, default=0.0,
                    help="MB of other memory traffic before each selection (the ViT pass before it; 0: none)")
    args = ap.parse_args()
    report = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    o, n = report["old"], report["new"]
    print(f"selection per call over {report['calls']} calls: old {o['median_ms']:.3f} ms median "
          f"({o['p90_ms']:.3f} p90), new {n['median_ms']:.3f} ms ({n['p90_ms']:.3f} p90), "
          f"{report['median_ratio_old_over_new']:.2f}x (thread CPU: old {o['thread_cpu']['median_ms']:.3f}, new "
          f"{n['thread_cpu']['median_ms']:.3f} ms median); between calls, new {_idle(n)}; "
          f"same choice {report['same_choice']}/{report['calls']}; "
          f"load average {report['load_average_start'][0]:.2f} -> {report['load_average_end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
