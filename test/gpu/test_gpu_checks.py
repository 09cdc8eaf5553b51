"""The one-shot GPU script in its CPU dry-run mode: runs end to end through the shell wrapper,
writes the JSON the GPU run writes, and says which checks need a device. Also: with real GPU
settings on CPU tensors, the kernel comparison reports that no kernel ran instead of a false match."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "gpu" / "run_gpu_checks.sh"
KERNELS = {"masked_ffn", "selected_row_ffn", "fused_add_rms_norm", "fused_add_ada_rms_norm"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_checks")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": ""}
    env.pop("VLA_RUNTIME_KERNELS", None)
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run", "--out", str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "gpu_checks.json").read_text())


def test_dry_run_document_says_what_needs_a_device(dry_run):
    assert dry_run["schema"] == 1 and dry_run["mode"] == "cpu-dry-run" and dry_run["ok"] is True
    assert dry_run["not_run"] == []
    assert dry_run["needs_device"] == ["kernels", "ipc", "latency", "trained"]
    assert set(dry_run["checks"]) == {"environment", "kernels", "ipc", "latency", "trained"}
    assert dry_run["checks"]["environment"]["status"] == "ok"
    for name in dry_run["needs_device"]:
        assert dry_run["checks"][name]["status"] == "needs_device", dry_run["checks"][name]
        assert dry_run["checks"][name]["seconds"] >= 0


def test_dry_run_environment_names_the_backend_and_why(dry_run):
    env = dry_run["checks"]["environment"]["result"]
    assert env["cuda_available"] is False and env["gpu_name"] is None
    if env["cupy"] is None:
        assert env["kernel_backend"] == "torch" and "CuPy is not installed" in env["kernel_backend_reason"]
    assert env["kernel_backend_reason"]


def test_dry_run_runs_every_kernel_fallback(dry_run):
    cases = dry_run["checks"]["kernels"]["result"]["cases"]
    assert {c["kernel"] for c in cases} == KERNELS
    assert all(c["ok"] and c["fallback_finite"] and not c["compared"] and c["ms_torch"] > 0 for c in cases)


def test_dry_run_ipc_moves_payloads_between_processes(dry_run):
    ipc = dry_run["checks"]["ipc"]["result"]
    host = ipc["host_latency"]
    assert host["backend"] == "cpu" and host["handoffs"] == 40 and ipc["torn_accepted"] == 0
    assert set(host["latency_us"]) >= {"median", "p99"}


def test_dry_run_latency_has_dense_and_cached_phases(dry_run):
    lat = dry_run["checks"]["latency"]["result"]
    assert lat["preset"] == "pi05-tiny" and [c["cameras"] for c in lat["configs"]] == [1, 2]
    for config in lat["configs"]:
        for engine in ("dense", "cached_torch"):
            assert {"vision", "prefill", "denoise", "total"} <= set(config[engine]["median_ms"])
            assert config[engine]["peak_memory_mb"] > 0
        assert config["cached_torch"]["referenced"] is True and config["dense"]["referenced"] is False
        dev = config["deviation"]
        # On a CPU nothing is captured, so the graph and eager runs are the same computation on
        # the same inputs: bit-identical. The cache against a nearby reference changes the answer.
        assert dev["dense_eager_vs_dense_relative_l2"] == 0 and dev["cached_graph_vs_eager_relative_l2"] == 0
        assert dev["cached_torch_vs_dense_relative_l2"] > 0
        assert "cached_cupy" not in config


def test_dry_run_times_the_bundled_trained_checkpoint_at_the_evaluation_ratios(dry_run):
    trained = dry_run["checks"]["trained"]["result"]
    assert trained["preset"].endswith("pi05-mw-metaworld") and (trained["rho_p"], trained["rho_n"]) == (0.6, 0.75)
    [config] = trained["configs"]
    assert config["cameras"] == 2        # the checkpoint's own cameras (Meta-World's corner and topview)
    assert set(config["speedup_vs_dense"]["cached_torch"]) >= {"prefill", "denoise", "total"}
    assert config["cached_torch"]["referenced"] is True


def test_comparison_on_cpu_tensors_reports_that_no_kernel_ran():
    gpu_checks = _gpu_checks()
    shape, case = gpu_checks.kernel_cases(gpu_checks.TINY, torch.float32, "cpu")["fused_add_rms_norm"]
    row = gpu_checks.compare("fused_add_rms_norm", shape, case, "float32", "cpu", dry_run=False, repeats=1)
    assert row["ok"] is False and row["compared"] is False and "did not run" in row["why"]


def _gpu_checks():
    sys.path.insert(0, str(ROOT / "test" / "gpu"))
    try:
        import gpu_checks
    finally:
        sys.path.pop(0)
    return gpu_checks


@pytest.mark.parametrize("why", ["--skip", "budget"])
def test_a_check_that_did_not_run_fails_the_run(tmp_path, why):
    """A skipped check (asked for, or not started because the budget is used up) is not a pass."""
    gpu_checks = _gpu_checks()
    cut = ["--skip", "trained"] if why == "--skip" else ["--budget-s", "0"]
    argv = ["--cpu-dry-run", "--out", str(tmp_path), *cut]
    report = gpu_checks.Report(gpu_checks.parse_args(argv))
    ran = []

    def fake(plan, report):
        ran.append(1)
        return {}
    for name in gpu_checks.CHECKS:
        if why == "budget" and name == "environment":
            report.record(name, {"status": "ok"})          # the first check ran, then time was up
            continue
        gpu_checks.run_check(report, name, fake)
    doc = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert doc["ok"] is False
    if why == "--skip":
        assert len(ran) == len(gpu_checks.CHECKS) - 1 and doc["not_run"] == ["trained"]
    else:
        assert ran == [] and doc["not_run"] == list(gpu_checks.CHECKS[1:])
    assert all(doc["checks"][c]["status"] == "skipped" for c in doc["not_run"])


def test_all_checks_passing_is_ok_and_a_missing_one_is_not():
    gpu_checks = _gpu_checks()
    every = {c: {"status": "ok"} for c in gpu_checks.CHECKS}
    assert gpu_checks.passed(every)
    assert gpu_checks.passed(every | {"kernels": {"status": "needs_device"}})
    assert not gpu_checks.passed({c: v for c, v in every.items() if c != "ipc"})
    assert not gpu_checks.passed(every | {"ipc": {"status": "failed"}})
