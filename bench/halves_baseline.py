"""Each half of the cache timed against dense, this checkout against a baseline revision, side by
side in one run (JSON out).

Not part of CI. What ``auto`` decides from (``time_repository_halves``: the repository's own calls,
each run dense and cached back to back, the median of the pairs' ratios with its 95 % interval),
measured ``--rounds`` times for each side, the sides alternating round by round (who goes first
alternating too), so that a machine whose speed moves over the run moves both alike. The baseline
is the package as committed at ``--baseline`` (``bench/baseline.py``), loaded with its own copy of
the model. Reports each round and, per side and half, the median and range of the rounds' ratios.
In one process, one thread: it explains a change to a half's code; the figure a user meets is
``vla-runtime eval``'s, through the three processes.

    python bench/halves_baseline.py --checkpoint checkpoints/pi05-mw-metaworld \\
        --repository out/closed_loop/repository --baseline 67a4b8f --rounds 6 --out out/halves_baseline.json
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

HALVES = ("context_cache", "action_cache")


def load_side(package: str, checkpoint: str, cameras: list[str], repository: str):
    """(model, ``time_repository_halves``, repository) of one side, all from its own package."""
    policy = module(package, "engine.policy").Pi05Policy.from_checkpoint(checkpoint, camera_names=cameras)
    repo = module(package, "cache.repository").ReferenceRepository.open(repository, verify=False)
    return policy.engine.model, module(package, "cache.half_profile").time_repository_halves, repo


def summarise(rounds: list[dict]) -> dict:
    """Per half: the median, lowest and highest of the rounds' paired ratios, and how many rounds'
    95 % interval lay above 1.0 (where ``auto`` would run the half)."""
    out = {}
    for half in HALVES:
        ratios = [r[half]["ratio"] for r in rounds]
        out[half] = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
                     "rounds_shown_faster": sum(r[half]["ratio_low"] is not None and r[half]["ratio_low"] > 1.0
                                                for r in rounds)}
    return out


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    tmp = tempfile.TemporaryDirectory(prefix="halvesbench")
    sides = {"new": load_side("vla_runtime", args.checkpoint, args.cameras, args.repository),
             "old": load_side(import_revision(args.baseline, Path(tmp.name)), args.checkpoint, args.cameras,
                              args.repository)}
    rounds: dict[str, list[dict]] = {"new": [], "old": []}
    try:
        for r in range(args.rounds):
            for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
                model, time_halves, repo = sides[name]
                timing = time_halves(model, repo, args.rho_p, repeats=args.repeats).as_dict()
                rounds[name].append(timing)
                a, c = timing["action_cache"], timing["context_cache"]
                print(f"round {r} {name}: action cache {a['ratio']:.3f}x, context cache {c['ratio']:.3f}x",
                      file=sys.stderr)
    finally:
        tmp.cleanup()
    return {"checkpoint": args.checkpoint, "repository": args.repository, "baseline": args.baseline,
            "rho_p": args.rho_p, "rounds": args.rounds, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "new": {"summary": summarise(rounds["new"]), "rounds": rounds["new"]},
            "old": {"summary": summarise(rounds["old"]), "rounds": rounds["old"]},
            "load_average_start": load_start, "load_average_end": os.getloadavg()}


def main() -> int:
    ap = side_by_side_parser(__doc__, "cache code")
    ap.add_argument("--rho-p", dest="rho_p", type=float, default=0.6, help="the Context Cache's fraction recomputed")
    ap.add_argument("--rounds", type=int, default=6, help="timings per side, the sides alternating")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the repository's calls per timing")
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    report = run(args)
    write_report(args.out, report)
    for half in HALVES:
        n, o = report["new"]["summary"][half], report["old"]["summary"][half]
        print(f"{half.replace('_', ' ')}: new {n['median_ratio']:.3f}x ({n['min_ratio']:.3f}-{n['max_ratio']:.3f}, "
              f"shown faster in {n['rounds_shown_faster']}/{report['rounds']}), old {o['median_ratio']:.3f}x "
              f"({o['min_ratio']:.3f}-{o['max_ratio']:.3f}, {o['rounds_shown_faster']}/{report['rounds']}) of dense")
    print(f"load average {report['load_average_start'][0]:.2f} -> {report['load_average_end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
