"""Mutation score of the core modules with mutmut, module by module, each in its own copy.

For every module named below, the checkout (tracked and untracked-but-not-ignored files) is
copied to a temporary folder, a ``setup.cfg`` there tells mutmut to mutate only that module and
to run only that module's fast tests, and ``mutmut run`` goes over it with a time limit. The
worktree is never mutated. Results per module (killed / total, survivors with their diffs) go
to ``--out`` as JSON; a module cut by its time limit is reported as such, with what it had.

    python bench/mutation_score.py --out out/mutation.json            # every module (hours on 2 cores)
    python bench/mutation_score.py --only engine/safety.py --limit-s 1200
    python bench/mutation_score.py --only engine/safety.py --survivors-of out/mutation.json

``--survivors-of`` re-runs, in a fresh copy (so mutmut maps the current tests to functions anew),
only the mutants a previous full run of the same module left alive (survived, or no test). Tests are only ever added
between the two runs, so what the first run killed stays killed; the report adds the re-run's
kills to the first run's and keeps its total. The module's source must be unchanged (its hash is
recorded and compared), else mutant names would not denote the same mutants. A first run cut
by its time limit is re-scored over the part it tested (``partial`` in the report).

``make mutation`` runs it (not part of ``make test``). Killed counts mutmut's "killed" and
"timeout" (the tests stopped the mutant); survived is what no test noticed. docs/mutation.md
holds the last figures and the survivors argued equivalent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import REPO, copy_repo  # noqa: E402  (the same copy of the checkout)

# module (under vla_runtime/) -> its fast tests; smallest modules first
MODULES: dict[str, tuple[str, ...]] = {
    "cache/context_cache.py": ("test/cache/test_context_cache.py", "test/cache/test_dual_cache.py",
                               "test/engine/test_cached.py"),
    "cache/masks.py": ("test/cache/test_masks.py", "test/cache/test_dual_cache.py", "test/engine/test_cached.py"),
    "cache/action_cache.py": ("test/cache/test_action_cache.py", "test/cache/test_dual_cache.py",
                              "test/engine/test_cached.py"),
    "cache/entry.py": ("test/cache/test_entry.py", "test/cache/test_dual_cache.py"),
    "cache/selector.py": ("test/cache/test_selector.py",),
    "models/layers.py": ("test/models/test_layers.py", "test/models/test_pi05.py", "test/kernels/test_fallback.py"),
    "engine/scheduler.py": ("test/engine/test_scheduler.py",),
    "engine/safety.py": ("test/engine/test_safety.py",),
    "cache/window.py": ("test/cache/test_window.py",),
    "cache/halves.py": ("test/cache/test_halves.py",),
    "cache/half_profile.py": ("test/cache/test_half_profile.py",),
    "cache/manager.py": ("test/cache/test_manager.py", "test/cache/test_manager_builder.py"),
    "cache/builder.py": ("test/cache/test_builder.py", "test/cache/test_manager_builder.py",
                         "test/cache/test_builder_dataset.py"),
    "cache/retrieval.py": ("test/cache/test_retrieval.py",),
    "engine/stitching.py": ("test/engine/test_stitching.py",),
    "models/checkpoint.py": ("test/models/test_checkpoint.py", "test/models/test_checkpoint_layout.py",
                             "test/models/test_shared_weights.py", "test/models/test_parts.py"),
    "cache/repository.py": ("test/cache/test_repository.py",),
    "ipc/ring.py": ("test/ipc/test_ring.py",),
}
# The hypothesis property tests (test/engine/test_properties.py, test/ipc/test_ring_properties.py)
# are left out: hundreds of examples per mutant would multiply the run time; they are run on the
# survivors by hand (docs/mutation.md).
KILLED = {"killed", "timeout"}


def setup_cfg(module: str, tests: tuple[str, ...]) -> str:
    lines = ["[mutmut]", "source_paths = vla_runtime/", f"only_mutate = vla_runtime/{module}",
             "pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in tests]
    lines += ["also_copy =", "    pytest.ini", "    config/", "    cuda/", "    checkpoints/",
              "process_isolation = forkserver", ""]
    return "\n".join(lines)


def statuses(root: Path) -> dict[str, str]:
    """mutant name -> status, from ``mutmut results --all true`` (one ``name: status`` a line)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=root,
                         capture_output=True, text=True).stdout
    result = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            result[name] = status.strip()
    return result


def diff(root: Path, mutant: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=root, capture_output=True,
                          text=True).stdout


def source_hash(module: str) -> str:
    return hashlib.sha256((REPO / "vla_runtime" / module).read_bytes()).hexdigest()


def score(module: str, tests: tuple[str, ...], limit_s: float, children: int,
          only_mutants: list[str] | None = None) -> dict:
    """One mutmut run over ``module`` (every mutant, or only ``only_mutants``) in a fresh copy."""
    with tempfile.TemporaryDirectory(prefix="mutmut_") as tmp:
        root = Path(tmp)
        copy_repo(root)
        (root / "setup.cfg").write_text(setup_cfg(module, tests))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        t0 = time.monotonic()
        try:
            subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children),
                            *(only_mutants or [])], cwd=root, env=env, capture_output=True, text=True,
                           timeout=limit_s)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        seconds = round(time.monotonic() - t0)
        st = statuses(root)
        counts: dict[str, int] = {}
        for s in st.values():
            counts[s] = counts.get(s, 0) + 1
        if only_mutants:
            st = {n: s for n, s in st.items() if n in only_mutants}
        tested = {n: s for n, s in st.items() if s not in ("not checked", "skipped")}
        killed = sum(s in KILLED for s in tested.values())
        survivors = sorted(n for n, s in tested.items() if s == "survived")
        untested = sorted(n for n, s in tested.items() if s == "no tests")
        return {"module": module, "source_sha256": source_hash(module), "tests": list(tests),
                "finished": finished, "seconds": seconds,
                "counts": counts, "total": len(st), "tested": len(tested), "killed": killed,
                "score": round(killed / len(tested), 4) if tested else None,
                "untested": untested, "survivors": {n: diff(root, n) for n in survivors}}


def rescore(first: dict, tests: tuple[str, ...], limit_s: float, children: int) -> dict:
    """Re-run ``first``'s survivors with today's ``tests``; kills add to ``first``'s."""
    module = first["module"]
    if first.get("source_sha256") != source_hash(module):
        raise SystemExit(f"{module} changed since the run being re-scored (source hash differs): "
                         "run it in full")
    # what no test covered then may be covered now: it is re-run with the survivors
    again = score(module, tests, limit_s, children,
                  only_mutants=sorted(first["survivors"]) + first.get("untested", []))
    killed = first["killed"] + again["killed"]
    # a first run cut by its time limit tested only part of the module: the score is over that part
    return {**again, "rescored_from": {"killed": first["killed"], "tested": first["tested"],
                                       "seconds": first["seconds"], "finished": first["finished"]},
            "counts": None, "total": first["total"], "tested": first["tested"], "killed": killed,
            "score": round(killed / first["tested"], 4), "finished": again["finished"] and first["finished"],
            "partial": not first["finished"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="module(s) under vla_runtime/, e.g. engine/safety.py")
    ap.add_argument("--limit-s", type=float, default=1800.0, help="time limit per module")
    ap.add_argument("--children", type=int, default=2, help="mutants tested at once")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "mutation.json")
    ap.add_argument("--tests", nargs="+", metavar="TEST",
                    help="run these tests instead of the module's list in MODULES (one --only module; e.g. "
                         "its fast mirrored file alone: a lower bound of the listed tests' score, in far less time)")
    ap.add_argument("--survivors-of", type=Path, metavar="JSON",
                    help="a previous report: re-run only its survivors of each module (--only) it holds")
    args = ap.parse_args()
    unknown = [m for m in args.only if m not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; known: {sorted(MODULES)}")
    if args.tests and len(args.only) != 1:
        raise SystemExit("--tests needs exactly one --only module")
    table = {**MODULES, **({args.only[0]: tuple(args.tests)} if args.tests else {})}
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    for module, tests in table.items():
        if args.only and module not in args.only:
            continue
        if args.survivors_of:
            previous = json.loads(args.survivors_of.read_text())
            if module not in previous:
                continue
            r = rescore(previous[module], tests, args.limit_s, args.children)
        else:
            r = score(module, tests, args.limit_s, args.children)
        report[module] = r
        print(f"{module}: {r['killed']}/{r['tested']} killed ({r['score']}), {len(r['survivors'])} survived, "
              f"{'finished' if r['finished'] else 'cut by the time limit'} in {r['seconds']} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
