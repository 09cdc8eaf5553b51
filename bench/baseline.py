"""The package as it was at another git revision, importable beside this checkout's (for the
side-by-side benchmarks: ``window_selection.py``, ``halves_baseline.py``).

``git archive`` of ``<rev>:vla_runtime`` is unpacked under a temporary folder as the package
``vla_runtime_base``, so the old code runs exactly as it was committed while this checkout's
``vla_runtime`` stays the new side. The package's own imports are relative, so each side only
ever imports itself.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BASE = "vla_runtime_base"


def import_revision(rev: str, into: Path) -> str:
    """Unpack revision ``rev``'s package under ``into`` and put it on the path: returns the
    package name to import its modules from (``f"{name}.cache.halves"``)."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", f"--prefix={BASE}/", f"{rev}:vla_runtime"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    sys.path.insert(0, str(into))
    return BASE


def module(package: str, name: str) -> ModuleType:
    """``package.name`` (either side)."""
    return importlib.import_module(f"{package}.{name}")


def write_report(path: Path | None, report: dict) -> None:
    """The benchmark's JSON report at ``path`` (its folder made), when one was asked for."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


def side_by_side_parser(doc: str, old_side: str) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes: the checkpoint and repository both sides
    run on, the policy's cameras, the baseline revision (``old_side``: what of it runs) and the
    JSON file to write."""
    from vla_runtime.sim.metaworld_env import DEFAULT_CAMERAS

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--repository", required=True)
    ap.add_argument("--cameras", nargs="+", default=list(DEFAULT_CAMERAS), help="the policy's camera names")
    ap.add_argument("--baseline", default="main", help=f"git revision whose {old_side} is the old side")
    ap.add_argument("--out", type=Path, default=None, help="the report (JSON)")
    return ap
