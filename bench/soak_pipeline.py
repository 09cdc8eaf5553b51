"""Soak of the three-process pipeline (vision, cache manager, policy) on the pi05-tiny demo robot.

    python bench/soak_pipeline.py --calls 100000 --out out/soak_pipeline.json    # the issue's long run
    python bench/soak_pipeline.py --calls 2000                                    # a few minutes less

Reports calls/s, NaN calls, RSS of every stage process and the rings' shared memory at the
start (after the warm-up) and the end with samples in between, segments left after shutdown,
and a crash check (all three stages SIGKILLed, restarted under the same names). Exit status 1
when a chunk had NaN/Inf, shared memory leaked, or a process's RSS grew by more than 0.5 KB per
call (least-squares over the samples). See ``vla_runtime/commands/pipeline_soak.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vla_runtime.commands.pipeline_soak import run_pipeline_soak, summary  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100_000, help="policy calls after the warm-up")
    ap.add_argument("--warmup", type=int, default=50, help="calls before the 'start' memory snapshot")
    ap.add_argument("--samples", type=int, default=20, help="memory samples during the run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--work", default="out/soak_pipeline", help="demo robot and repository (made once)")
    ap.add_argument("--no-crash-check", action="store_true", help="skip the SIGKILL-and-restart check")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    report = run_pipeline_soak(args.work, calls=args.calls, warmup=args.warmup, samples=args.samples,
                               threads=args.threads, crash_check=not args.no_crash_check,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    print(summary(report), file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] and report["memory"]["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
