"""The dense engine's call, this checkout against a baseline revision, side by side in one run
(JSON out).

Not part of CI. Both sides load the same checkpoint with their own package (``bench/baseline.py``)
and run the same calls (the repository's recorded observations, the same noise) back to back,
call by call, who goes first alternating, on one thread: a machine whose speed moves over the run
moves both alike. Reports each phase's median per side and the median of the per-call ratios
old / new with a 95 % interval (``PhaseTiming.paired``). It explains a change to the model code;
the figure a user meets is the pipeline's (``vla-runtime eval``, ``make demo``).

    python bench/dense_baseline.py --checkpoint checkpoints/pi05-mw-metaworld \\
        --repository out/closed_loop/repository --baseline main --rounds 3 --out out/dense_baseline.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baseline import import_revision, module, side_by_side_parser, write_report  # noqa: E402

PHASES = ("vision", "prefill", "denoise", "total")


def calls_of(repository: str, per_task: int) -> list[tuple]:
    """(images, image_mask, tokens, token_mask) of the first ``per_task`` calls of each task's first
    episode, as the model takes them."""
    from vla_runtime.cache.manager import stored_images_to_model
    from vla_runtime.cache.repository import ReferenceRepository

    repo = ReferenceRepository.open(repository, verify=False)
    calls = []
    for task in repo.tasks():
        episode = repo.episodes(task)[0].episode_id
        for i in range(min(per_task, repo.episode(episode).num_calls)):
            c = repo.load_call(episode, i)
            calls.append((stored_images_to_model(c.images)[None], c.image_mask[None], c.tokens[None],
                          c.token_mask[None]))
    if not calls:
        raise SystemExit(f"{repository} holds no call")
    return calls


def load_side(package: str, checkpoint: str, cameras: list[str]):
    """(engine, ``ModelInputs``) of one side, from its own package."""
    policy = module(package, "engine.policy").Pi05Policy.from_checkpoint(checkpoint, camera_names=cameras)
    return policy.engine, module(package, "engine.dense").ModelInputs


def run(args: argparse.Namespace) -> dict:
    from vla_runtime.cache.halves import PhaseTiming

    torch.set_num_threads(1)
    load_start = os.getloadavg()
    tmp = tempfile.TemporaryDirectory(prefix="densebench")
    sides = {"new": load_side("vla_runtime", args.checkpoint, args.cameras),
             "old": load_side(import_revision(args.baseline, Path(tmp.name)), args.checkpoint, args.cameras)}
    calls = calls_of(args.repository, args.calls_per_task)
    gen = torch.Generator().manual_seed(0)
    noises = [torch.randn(1, sides["new"][0].cfg.chunk_size, sides["new"][0].cfg.action_dim, generator=gen)
              for _ in calls]
    samples = {s: {p: [] for p in PHASES} for s in sides}
    actions_gap = 0.0
    try:
        for name in sides:                                   # warm-up
            engine, inputs = sides[name]
            engine.infer(inputs(*calls[0]), noise=noises[0])
        for r in range(args.rounds):
            for i, (call, noise) in enumerate(zip(calls, noises)):
                out = {}
                for name in (("new", "old") if (r + i) % 2 == 0 else ("old", "new")):
                    engine, inputs = sides[name]
                    out[name] = engine.infer(inputs(*call), noise=noise)
                    for p, v in out[name].times.as_dict().items():
                        if p in samples[name]:
                            samples[name][p].append(v)
                new, old = out["new"].actions.float(), out["old"].actions.float()
                actions_gap = max(actions_gap, float((new - old).norm() / old.norm().clamp_min(1e-12)))
            print(f"round {r}: total new {statistics.median(samples['new']['total']) * 1e3:.2f} ms, "
                  f"old {statistics.median(samples['old']['total']) * 1e3:.2f} ms", file=sys.stderr)
    finally:
        tmp.cleanup()
    phases = {}
    for p in PHASES:
        # PhaseTiming.paired(dense, cached) is dense / cached per pair: here old / new, the speed-up
        t = PhaseTiming.paired(samples["old"][p], samples["new"][p]).as_dict()
        phases[p] = {"new_median_ms": statistics.median(samples["new"][p]) * 1e3,
                     "old_median_ms": statistics.median(samples["old"][p]) * 1e3,
                     "speedup": t["ratio"], "speedup_low": t["ratio_low"], "speedup_high": t["ratio_high"]}
    return {"checkpoint": args.checkpoint, "repository": args.repository, "baseline": args.baseline,
            "calls": len(calls), "rounds": args.rounds, "threads": torch.get_num_threads(), "phases": phases,
            "worst_relative_action_gap": actions_gap,
            "load_average_start": load_start, "load_average_end": os.getloadavg()}


def main() -> int:
    ap = side_by_side_parser(__doc__, "model code")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the calls")
    ap.add_argument("--calls-per-task", dest="calls_per_task", type=int, default=8, help="calls per task")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls_per_task < 1:
        ap.error("--rounds and --calls-per-task must be at least 1")
    report = run(args)
    write_report(args.out, report)
    for p, f in report["phases"].items():
        print(f"{p}: new {f['new_median_ms']:.2f} ms, old {f['old_median_ms']:.2f} ms, "
              f"{f['speedup']:.3f}x (95 % interval {f['speedup_low']:.3f}-{f['speedup_high']:.3f})")
    print(f"actions: worst relative L2 gap new vs old {report['worst_relative_action_gap']:.2e}")
    print(f"load average {report['load_average_start'][0]:.2f} -> {report['load_average_end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
