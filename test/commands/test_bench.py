"""The benchmark tool's JSON (shape and sanity of the figures; never timing thresholds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vla_runtime.cli import main
from vla_runtime.models.config import preset
from vla_runtime.commands.bench import BenchSpec, run_bench


def test_bench_reports_phases_memory_and_efficiency():
    r = run_bench(BenchSpec(preset="pi05-tiny", cameras=2, repeats=2, warmup=1, gemm_size=256), log=lambda m: None)
    assert set(r["median_s"]) == {"vision", "prefill", "denoise", "total"}
    assert len(r["all_s"]) == 2
    for k in ("vision", "prefill", "denoise", "total"):
        assert r["median_s"][k] > 0 and math.isfinite(r["fraction_of_gemm"][k])
        assert r["useful_gflop"][k] > 0
    assert r["gemm_gflops"] > 0 and r["peak_memory_mb"] > 0
    assert r["config"]["prefix_tokens"] == 2 * preset("pi05-tiny").num_image_tokens + 64
    json.dumps(r)  # serialisable


def test_bench_spec_is_validated():
    with pytest.raises(ValueError, match="dtype"):
        BenchSpec(dtype="int8").validate()
    with pytest.raises(ValueError, match="cameras"):
        run_bench(BenchSpec(preset="pi05-tiny", cameras=5, repeats=1), log=lambda m: None)


def test_cli_bench_writes_json(tmp_path: Path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "pi05-tiny", "--cameras", "1", "--repeats", "1", "--gemm-size", "128",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["spec"]["cameras"] == 1 and data["median_s"]["total"] > 0
    # stdout: a short summary with the JSON's own figures and where the JSON is; the bar on stderr
    printed = capsys.readouterr()
    assert "{" not in printed.out and str(out) in printed.out and len(printed.out.splitlines()) <= 8
    total = next(line for line in printed.out.splitlines() if line.split()[:1] == ["total"])
    assert f"{1e3 * data['median_s']['total']:.1f} ms" in total
    assert "calls (1 warm-up, 1 timed)" in printed.err
    # --out -: the JSON alone on stdout, for a pipe
    assert main(["bench", "--preset", "pi05-tiny", "--cameras", "1", "--repeats", "1", "--gemm-size", "128",
                 "--out", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["cameras"] == 1


def test_cli_inspect_and_refusal(tiny_checkpoint_dir: Path, tmp_path: Path, capsys):
    assert main(["inspect", str(tiny_checkpoint_dir), "--hash", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "lerobot" and info["depths"]["vlm"] == 3 and info["content_hash"].startswith("sha256:")
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
