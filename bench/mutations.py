"""Re-apply issue 22's five deliberate bugs, each to a fresh copy of the repository, and report
whether the named test catches it (JSON).

Each mutation is a literal (old -> new) source edit: the script refuses to run one whose ``old``
text is not found exactly once, so a refactor that moves the code makes this script fail loudly
instead of silently testing an unmutated copy. The copy holds the git-tracked files (plus any
untracked, not ignored ones) of this checkout in a temporary folder; pytest runs there with that
folder first on ``sys.path``, so the worktree itself is never modified. A mutation is "caught"
when its tests fail on the mutated copy and pass on an unmutated copy (the baseline run).

    python bench/mutations.py [--out out/mutations.json] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    function: str
    bug: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("context_least_drifted", "ContextCache.__call__",
             "recompute the least-drifted tokens instead of the most",
             "vla_runtime/cache/context_cache.py",
             ".topk(k, sorted=False).indices", ".topk(k, largest=False, sorted=False).indices",
             ("test/engine/test_cached.py::test_cached_engine_follows_the_plain_formulas",
              "test/cache/test_context_cache.py::test_context_cache_scatters_selected_rows_over_reference_outputs")),
    Mutation("action_layer0_mask", "ActionCache._anchor", "every layer uses layer 0's mask",
             "vla_runtime/cache/action_cache.py",
             "neurons = self.masks[self.group_of[step], layer]", "neurons = self.masks[self.group_of[step], 0]",
             ("test/cache/test_dual_cache.py::test_anchor_update_is_exact_with_all_neurons_and_follows_eq4_otherwise",
              "test/engine/test_cached.py::test_cached_engine_follows_the_plain_formulas")),
    Mutation("retrieval_no_similarity_filter", "Retriever._query",
             "the similarity filter before the joint-history rerank removed",
             "vla_runtime/cache/retrieval.py",
             "        values, idx = values[keep], idx[keep]\n", "",
             ("test/cache/test_retrieval.py::test_similarity_filter_runs_before_the_joint_rerank",)),
    Mutation("safety_skipped_tick", "SafetyFilter.filter", "a skipped tick no longer allows its extra step",
             "vla_runtime/engine/safety.py",
             "elapsed = 1 if self._last_tick is None else tick - self._last_tick", "elapsed = 1",
             ("test/engine/test_safety.py::test_velocity_limit",)),
    Mutation("checkpoint_vision_kqv", "layout_groups", "vision q/k/v keys read in the order k, q, v",
             "vla_runtime/models/checkpoint.py",
             '_proj.weight", (v.width, v.width)) for x in "qkv"))',
             '_proj.weight", (v.width, v.width)) for x in "kqv"))',
             ("test/models/test_checkpoint_layout.py::test_every_internal_weight_holds_what_its_public_tensor_feeds",)),
)


def copy_repo(dest: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files (no build output, no .git)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(root: Path, m: Mutation) -> None:
    path = root / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name}: {m.old!r} occurs {text.count(m.old)} times in {m.file}, expected once")
    path.write_text(text.replace(m.old, m.new))


def run_tests(root: Path, tests: tuple[str, ...], timeout_s: float) -> dict:
    """pytest in ``root`` with ``root`` first on sys.path (its vla_runtime is the one imported)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    outcomes = {}
    for line in proc.stdout.splitlines():     # -rA summary lines: "PASSED test/...::name[id]"
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED") and "::" in rest:
            outcomes[rest.split(" - ")[0]] = word
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "summary": (proc.stdout.strip().splitlines() or [""])[-1], "tests": outcomes}


def check_imports_copy(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(root)}
    where = subprocess.run([sys.executable, "-c", "import vla_runtime; print(vla_runtime.__file__)"], cwd=root,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the copy is not what gets imported: vla_runtime comes from {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here as well")
    ap.add_argument("--only", action="append", default=[], help="mutation name(s) to run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = []
    with tempfile.TemporaryDirectory(prefix="mutations_") as tmp:
        base = Path(tmp) / "base"
        copy_repo(base)
        check_imports_copy(base)
        for m in chosen:
            baseline = run_tests(base, m.tests, args.timeout)
            mutant_root = Path(tmp) / m.name
            shutil.copytree(base, mutant_root)
            apply(mutant_root, m)
            mutant = run_tests(mutant_root, m.tests, args.timeout)
            shutil.rmtree(mutant_root)
            results.append({**{k: v for k, v in asdict(m).items() if k not in ("old", "new")},
                            "baseline_passes": baseline["returncode"] == 0,
                            "caught": baseline["returncode"] == 0 and mutant["returncode"] == 1,
                            "baseline": baseline, "mutant": mutant})
    report = {"mutations": results, "caught": sum(r["caught"] for r in results), "total": len(results)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
