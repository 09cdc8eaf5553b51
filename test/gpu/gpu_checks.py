"""One-shot GPU checks (issue 7): kernels vs torch fallbacks, CUDA IPC ring buffer, pi0.5 latency.

Run through ``test/gpu/run_gpu_checks.sh`` on a machine with one NVIDIA GPU; writes
``gpu_checks.json`` into ``--out`` (default ``$OUT``, else ``out/gpu_checks``) after every check,
so a run cut short still leaves what it measured. Checks:

- ``environment``: Python, torch, CUDA, GPU name, CuPy, which kernel backend runs and why
  (the kernels are compiled here, so a compile error shows up in this check);
- ``kernels``: every CUDA kernel against its torch fallback on full-size pi0.5 shapes in fp32,
  bf16 and fp16: max abs / relative difference against a per-dtype tolerance, and the median time
  of both;
- ``ipc``: the ring buffer's CUDA IPC backend across real processes (one writer, readers in other
  processes) with a full-size pi0.5 prefix slot: paced hand-off latency (commit -> copy complete,
  median / p99), a free-running stress phase, and torn copies accepted (must be 0); the host
  backend's latency on the same slot for comparison;
- ``latency``: full-size pi0.5 (random weights, bf16) with 1/2/3 cameras: per-phase medians of the
  dense engine and of the cached engine (Context + Action Cache against a reference recorded from
  a nearby observation) with the torch fallbacks and with the CUDA kernels, action deviation, and
  peak GPU memory of each;
- ``trained``: the same figures for the bundled trained checkpoint (``checkpoints/pi05-mw-metaworld``,
  the closed-loop policy of issue 6) at its cameras and at the closed-loop evaluation's ratios
  (rho_p 0.6, rho_n 0.75): what its cached/dense per-call ratio is on a GPU, where the closed loop
  on the CPU measured 0.96-0.97x.

``--cpu-dry-run`` runs the same code on CPU with the tiny preset up to where a device is needed
(kernels: the fallbacks only; IPC: the host backend; latency: pi05-tiny in fp32) and lists in
``needs_device`` the checks whose figures only a GPU gives. CI runs that mode
(test/gpu/test_gpu_checks.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a checkout runs without installing the package

import torch  # noqa: E402

from vla_runtime import kernels  # noqa: E402
from vla_runtime.kernels import launch  # noqa: E402

SCHEMA = 1
CHECKS = ("environment", "kernels", "ipc", "latency", "trained")
NEEDS_DEVICE = ("kernels", "ipc", "latency", "trained")  # what a CPU dry run cannot measure
TRAINED = ROOT / "checkpoints" / "pi05-mw-metaworld"
TRAINED_RATIOS = (0.6, 0.75)   # rho_p, rho_n of the closed-loop evaluation (the model card's)
# Max |kernel - fallback| relative to max |fallback| accepted per dtype: a few units in the last
# place of the activation dtype (the kernels round where the torch path rounds; only summation
# order differs), and summation-order noise for fp32.
TOLERANCE = {"float32": 5e-5, "bfloat16": 2e-2, "float16": 4e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- plan and report

@dataclass
class Plan:
    """What this run does: the full GPU run, or the CPU dry run with tiny sizes."""

    dry_run: bool
    out_dir: Path
    budget_s: float
    preset: str
    dtype: str
    cameras: list[int]
    repeats: int
    warmup: int
    ipc_handoffs: int
    skip: set[str] = field(default_factory=set)

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def parse_args(argv: list[str] | None) -> Plan:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "gpu_checks"),
                   help="directory for gpu_checks.json (default: $OUT, else out/gpu_checks)")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, up to where a device is needed")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new work after this many seconds")
    p.add_argument("--preset", default=None, help="model size (default pi05; pi05-tiny in the dry run)")
    p.add_argument("--cameras", default=None, help="comma-separated camera counts (default 1,2,3; dry run 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per configuration (default 10; dry 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; dry 0)")
    p.add_argument("--ipc-handoffs", type=int, default=None, help="paced hand-offs in the IPC check (default 1000)")
    p.add_argument("--skip", default="", help=f"comma-separated checks to skip, of {', '.join(CHECKS[1:])}")
    a = p.parse_args(argv)
    dry = a.cpu_dry_run
    skip = {s for s in a.skip.split(",") if s}
    unknown = skip - set(CHECKS[1:])
    if unknown:
        p.error(f"unknown checks to skip: {sorted(unknown)}")
    return Plan(dry_run=dry, out_dir=Path(a.out), budget_s=a.budget_s,
                preset=a.preset or ("pi05-tiny" if dry else "pi05"), dtype="float32" if dry else "bfloat16",
                cameras=[int(c) for c in (a.cameras or ("1,2" if dry else "1,2,3")).split(",")],
                repeats=a.repeats if a.repeats is not None else (1 if dry else 10),
                warmup=a.warmup if a.warmup is not None else (0 if dry else 2),
                ipc_handoffs=a.ipc_handoffs if a.ipc_handoffs is not None else (40 if dry else 1000), skip=skip)


class Report:
    """The JSON document, rewritten after every check."""

    def __init__(self, plan: Plan):
        self.plan, self.t0 = plan, time.monotonic()
        self.data: dict[str, Any] = {
            "schema": SCHEMA, "mode": "cpu-dry-run" if plan.dry_run else "gpu",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "needs_device": list(NEEDS_DEVICE) if plan.dry_run else [],
            "plan": {"preset": plan.preset, "dtype": plan.dtype, "cameras": plan.cameras, "repeats": plan.repeats,
                     "warmup": plan.warmup, "budget_s": plan.budget_s},
            "checks": {}, "ok": None, "wall_s": None,
        }
        self.path = plan.out_dir / "gpu_checks.json"

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def record(self, name: str, entry: dict) -> None:
        self.data["checks"][name] = entry
        self.write()

    def write(self) -> None:
        self.data["wall_s"] = self.elapsed()
        self.data["not_run"] = [c for c in CHECKS if self.data["checks"].get(c, {}).get("status") in (None, "skipped")]
        self.data["ok"] = passed(self.data["checks"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def passed(checks: dict[str, dict]) -> bool:
    """Every check ran and passed (a dry run's ``needs_device`` ran as far as a CPU can). A check
    skipped by ``--skip`` or by the time budget did not pass: a run cut short is not ``ok``."""
    return set(checks) == set(CHECKS) and all(c["status"] in ("ok", "needs_device") for c in checks.values())


def run_check(report: Report, name: str, fn: Callable[[Plan, Report], dict]) -> None:
    """Run one check: status ok / failed / needs_device (dry run) / skipped, its result or error."""
    plan = report.plan
    t0 = time.monotonic()
    if name in plan.skip:
        entry = {"status": "skipped", "reason": "--skip"}
    elif report.elapsed() > plan.budget_s:
        entry = {"status": "skipped", "reason": f"time budget of {plan.budget_s:.0f} s used up"}
    else:
        try:
            result = fn(plan, report)
            failed = result.pop("failed", None)
            status = "failed" if failed else ("needs_device" if plan.dry_run and name in NEEDS_DEVICE else "ok")
            entry = {"status": status, "result": result} | ({"failure": failed} if failed else {})
        except Exception as e:  # one broken check must not lose the others' figures
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    entry["seconds"] = time.monotonic() - t0
    report.record(name, entry)
    print(f"[gpu-checks] {name}: {entry['status']} ({entry['seconds']:.1f} s)"
          + (f" - {entry.get('error') or entry.get('failure') or entry.get('reason')}" if entry["status"] in
             ("failed", "skipped") else ""), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- environment

def check_environment(plan: Plan, report: Report) -> dict:
    cuda = torch.cuda.is_available()
    if not plan.dry_run and not cuda:
        raise RuntimeError("no CUDA device visible to torch; run with --cpu-dry-run on a machine without a GPU")
    t0 = time.monotonic()
    with kernels.use_backend("auto"):   # what this machine can run, whatever the runtime default
        backend = kernels.kernel_backend(compile_kernels=cuda)
    info = {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": cuda,
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if cuda else None,
        "cupy": _cupy_version(), "kernel_backend": backend.name, "kernel_backend_reason": backend.reason,
        "kernel_compile_s": time.monotonic() - t0 if cuda else None,
    }
    if cuda and backend.name != "cupy":
        info["failed"] = f"the CUDA kernels cannot run: {backend.reason}"
    return info


def _cupy_version() -> str | None:
    try:
        import cupy
    except Exception:
        return None
    return str(cupy.__version__)


# ----------------------------------------------------------------------------- kernels vs fallbacks

@dataclass(frozen=True)
class Sizes:
    """Shapes of the kernel cases: full-size pi0.5 (3 cameras, 64 prompt tokens) or tiny."""

    expert_width: int
    expert_mlp: int
    vlm_width: int
    vlm_mlp: int
    block: int
    chunk: int
    visual_tokens: int
    text_tokens: int
    rho_p: float = 0.4
    rho_n: float = 0.5


FULL = Sizes(expert_width=1024, expert_mlp=4096, vlm_width=2048, vlm_mlp=16384, block=2048, chunk=50,
             visual_tokens=768, text_tokens=64)
TINY = Sizes(expert_width=64, expert_mlp=128, vlm_width=96, vlm_mlp=256, block=64, chunk=10, visual_tokens=24,
             text_tokens=6)

Case = Callable[[], torch.Tensor]  # runs the op on fresh copies of its inputs, returns what it computed


def _weights(width: int, mlp: int, block: int, dtype: torch.dtype, device: str, g: torch.Generator):
    gate_up = (torch.randn(mlp // block, 2 * block, width, generator=g) * 0.02).to(device, dtype)
    down_t = (torch.randn(mlp, width, generator=g) * 0.02).to(device, dtype)
    return gate_up, down_t


def kernel_cases(s: Sizes, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, tuple[dict, Case]]:
    """The four kernels on random inputs of the given sizes: name -> (shape summary, case)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    vec = lambda n, base=0.0: (base + 0.1 * torch.randn(n, generator=g)).to(device)  # noqa: E731, fp32 tables
    t, w, h = s.chunk, s.expert_width, s.expert_mlp
    k = math.ceil(s.rho_n * h)
    egu, edown = _weights(w, h, min(s.block, h), dtype, device, g)
    neurons = torch.randperm(h, generator=g)[:k].sort().values.to(device)
    x_t, h_anchor, y_anchor = rnd(t, w), rnd(t, k) * 0.1, rnd(t, w) * 0.1
    p, vw = s.visual_tokens + s.text_tokens, s.vlm_width
    vgu, vdown = _weights(vw, s.vlm_mlp, s.block, dtype, device, g)
    x_p, ref_out = rnd(p, vw), rnd(p, vw) * 0.1
    chosen = torch.randperm(s.visual_tokens, generator=g)[:math.ceil(s.rho_p * s.visual_tokens)]
    rows = torch.cat([chosen, torch.arange(s.visual_tokens, p)]).to(device)
    res_v, delta_v, scale_v = rnd(p, vw), rnd(p, vw), vec(vw, 1.0)
    res_e, delta_e = rnd(t, w), rnd(t, w)
    gate, scale_e, shift = vec(w), vec(w, 1.0), vec(w)
    return {
        "masked_ffn": ({"T": t, "W": w, "H": h, "K": k},
                       lambda: kernels.masked_ffn(x_t, egu, edown, neurons, h_anchor=h_anchor, y_anchor=y_anchor)),
        "selected_row_ffn": ({"P": p, "W": vw, "H": s.vlm_mlp, "R": rows.numel()},
                             lambda: kernels.selected_row_ffn(x_p, rows, vgu, vdown, out=ref_out.clone())),
        "fused_add_rms_norm": ({"rows": p, "W": vw},
                               lambda: torch.cat(kernels.fused_add_rms_norm(res_v.clone(), delta_v, scale_v, 1e-6))),
        "fused_add_ada_rms_norm": ({"rows": t, "W": w},
                                   lambda: torch.cat(kernels.fused_add_ada_rms_norm(res_e.clone(), delta_e, gate,
                                                                                    scale_e, shift, 1e-6))),
    }


def _median_ms(fn: Case, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare(name: str, shape: dict, case: Case, dtype: str, device: str, dry_run: bool, repeats: int) -> dict:
    """One case: fallback vs kernel (GPU), or the fallback alone (dry run)."""
    with kernels.use_backend("torch"):
        want = case().float()
        ms_torch = _median_ms(case, device, repeats)
    row = {"kernel": name, "dtype": dtype, "shape": shape, "ms_torch": ms_torch,
           "fallback_finite": bool(torch.isfinite(want).all())}
    if dry_run:
        return row | {"ok": row["fallback_finite"], "compared": False}
    before = sum(launch.launches.values())
    with kernels.use_backend("cupy"):
        got = case().float()
        ms_cupy = _median_ms(case, device, repeats)
    if sum(launch.launches.values()) == before:  # the dispatch took the fallback: nothing was compared
        return row | {"compared": False, "ok": False, "why": "the CUDA kernel did not run (dispatch fell back)"}
    diff = float((got - want).abs().max())
    rel = diff / max(float(want.abs().max()), 1e-30)
    return row | {"compared": True, "ms_cupy": ms_cupy, "max_abs_diff": diff, "max_rel_diff": rel,
                  "tolerance": TOLERANCE[dtype], "ok": bool(torch.isfinite(got).all()) and rel <= TOLERANCE[dtype]}


def check_kernels(plan: Plan, report: Report) -> dict:
    sizes, device = (TINY, "cpu") if plan.dry_run else (FULL, "cuda")
    dtypes = ["float32"] if plan.dry_run else list(DTYPES)
    with kernels.use_backend("auto"):
        backend = kernels.kernel_backend()
    if not plan.dry_run and backend.name != "cupy":
        return {"failed": f"kernels cannot run: {backend.reason}"}
    rows = []
    for dtype in dtypes:
        for name, (shape, case) in kernel_cases(sizes, DTYPES[dtype], device).items():
            rows.append(compare(name, shape, case, dtype, device, plan.dry_run, 1 if plan.dry_run else 20))
    bad = [f"{r['kernel']} {r['dtype']}" for r in rows if not r["ok"]]
    out: dict[str, Any] = {"sizes": sizes.__dict__, "cases": rows}
    if bad:
        out["failed"] = "outside tolerance or not finite: " + ", ".join(bad)
    return out


# ----------------------------------------------------------------------------- CUDA IPC ring buffer

def check_ipc(plan: Plan, report: Report) -> dict:
    from vla_runtime.ipc.stress import StressSpec, prefix_layout, run_stress, small_layout

    if plan.dry_run:
        layout = small_layout(1024).to_json()
        host = run_stress(StressSpec(layout, slots=2, readers=1, handoffs_per_reader=plan.ipc_handoffs,
                                     writer_period_s=0.001), timeout_s=120)
        return {"layout": "small", "host_latency": host, "cuda": "needs a GPU and CuPy",
                "torn_accepted": host["torn_accepted"]}
    layout = prefix_layout(plan.preset).to_json()
    common = dict(layout_json=layout, threads=1)
    runs = {
        "cuda_latency": StressSpec(**common, slots=4, readers=1, handoffs_per_reader=plan.ipc_handoffs,
                                   writer_period_s=0.002, backend="cuda"),
        "cuda_stress": StressSpec(**common, slots=3, readers=2, handoffs_per_reader=plan.ipc_handoffs,
                                  backend="cuda"),
        "host_latency": StressSpec(**common, slots=4, readers=1, handoffs_per_reader=max(plan.ipc_handoffs // 5, 1),
                                   writer_period_s=0.02),
    }
    out: dict[str, Any] = {"layout": plan.preset, "slot_mb": prefix_layout(plan.preset).nbytes / 2 ** 20}
    errors = []
    for label, spec in runs.items():
        if report.elapsed() > plan.budget_s:
            out[label] = "skipped: time budget"
            errors.append(f"{label}: not run, time budget used up")
            continue
        try:
            out[label] = run_stress(spec, timeout_s=180)
        except Exception as e:  # keep the other runs' figures
            out[label] = f"error: {type(e).__name__}: {e}"
            errors.append(f"{label}: {type(e).__name__}: {e}")
    torn = sum(r["torn_accepted"] for r in out.values() if isinstance(r, dict))
    out["torn_accepted"] = torn
    if torn:
        errors.append(f"{torn} torn copies accepted")
    if errors:
        out["failed"] = "; ".join(errors)
    return out


# ----------------------------------------------------------------------------- pi0.5 latency, dense vs cached

def prepare_reference(model, inputs, rho_n: float, groups):
    """A prepared reference from ``inputs`` (what the cache manager would hold for a stored call):
    the VLM FFN states of one dense prefill and Action Cache masks of one dense denoising run."""
    from vla_runtime.cache.entry import reconstruct_entry
    from vla_runtime.cache.masks import profile_masks

    dev = next(model.parameters()).device
    images, mask = inputs.images.to(dev), inputs.image_mask.to(dev)
    tokens, tmask = inputs.tokens.to(dev), inputs.token_mask.to(dev)
    with torch.no_grad():
        entry = reconstruct_entry(model, ("gpu-check", 0), images[0], mask[0], tokens[0], tmask[0], None)
        image_tokens, _ = model.embed_images(images)
        prefix = model.build_prefix(image_tokens, mask, tokens, tmask)
        model.prefill(prefix)
        noise = torch.randn(1, model.cfg.chunk_size, model.cfg.action_dim,
                            generator=torch.Generator().manual_seed(1)).to(dev)
        entry.masks = profile_masks(model, prefix, noise, groups, rho_n)
    return entry


def nearby(inputs, seed: int, amount: float = 0.3):
    """The same scene, moved a little: the current observation a reference is retrieved for."""
    from vla_runtime.engine.dense import ModelInputs

    g = torch.Generator().manual_seed(seed)
    other = torch.rand(inputs.images.shape, generator=g) * 2 - 1
    images = (inputs.images + amount * (other - inputs.images)).clamp(-1, 1)
    return ModelInputs(images, inputs.image_mask, inputs.tokens, inputs.token_mask)


def time_engine(engine, inputs, noise, plan: Plan, select=None) -> dict:
    """Per-phase medians (ms) of ``repeats`` calls after ``warmup``, peak memory, the last actions."""
    device = plan.device
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for i in range(plan.warmup + plan.repeats):
        out = engine.infer(inputs, noise=noise, select=select)
        if i >= plan.warmup:
            runs.append(out.times.as_dict())
    from vla_runtime.commands.bench import peak_memory_mb

    return {"median_ms": {k: 1e3 * statistics.median(r[k] for r in runs) for k in runs[0]},
            "peak_memory_mb": peak_memory_mb(device), "actions": out.actions.float().cpu(),
            "referenced": out.reference is not None}


def time_captured(engine, inputs, noise, plan: Plan, row: dict, name: str, select=None) -> dict:
    """An engine with its captured phases (CUDA graphs of vision, prefill and the denoising loop,
    cached paths included); if capture fails (never run on a GPU before this script), the error
    is recorded and the engine runs eagerly from then on."""
    try:
        return time_engine(engine, inputs, noise, plan, select)
    except Exception as e:
        if not engine.cuda_graphs:
            raise
        row[f"{name}_cuda_graph_error"] = f"{type(e).__name__}: {e}"
        engine.disable_graphs()
        return time_engine(engine, inputs, noise, plan, select)


def time_eager(engine, inputs, noise, plan: Plan, select=None) -> dict:
    """The same engine with its graphs switched off for these calls (same model, same caches)."""
    graphs, engine.graphs = engine.graphs, None
    try:
        return time_engine(engine, inputs, noise, plan, select)
    finally:
        engine.graphs = graphs


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _speedup(dense: dict, other: dict) -> dict:
    return {k: dense["median_ms"][k] / v for k, v in other["median_ms"].items() if k in dense["median_ms"] and v > 0}


def latency_for_cameras(model, dense, cached, cams: int, plan: Plan, kernel_ok: bool) -> dict:
    from vla_runtime.engine.cached import CacheConfig
    from vla_runtime.commands.bench import synthetic_inputs
    from vla_runtime.models.flops import denoise_flops, prefill_flops, vision_flops

    cfg = model.cfg
    ref = synthetic_inputs(cfg, cams, 64, seed=100 + cams)
    cur = nearby(ref, seed=200 + cams)
    entry = prepare_reference(model, ref, cached.cache.rho_n, cached.cache.groups)
    noise = dense.make_noise(1, torch.Generator().manual_seed(cams))
    select = lambda features, inputs: entry  # noqa: E731
    row: dict[str, Any] = {"cameras": cams, "prefix_tokens": cams * cfg.num_image_tokens + min(64, cfg.max_token_len)}
    row["dense"] = time_captured(dense, cur, noise, plan, row, "dense")
    row["dense_eager"] = time_eager(dense, cur, noise, plan)
    with kernels.use_backend("torch"):
        row["cached_torch"] = time_captured(cached, cur, noise, plan, row, "cached", select)
        row["cached_torch_eager"] = time_eager(cached, cur, noise, plan, select)
    if kernel_ok:
        with kernels.use_backend("cupy"):
            row["cached_cupy"] = time_captured(cached, cur, noise, plan, row, "cached_cupy", select)
    p = row["prefix_tokens"]
    row["useful_gflop_dense"] = {"vision": vision_flops(cfg, cams) / 1e9, "prefill": prefill_flops(cfg, p) / 1e9,
                                 "denoise": denoise_flops(cfg, p) / 1e9}
    kinds = ("dense", "dense_eager", "cached_torch", "cached_torch_eager", "cached_cupy")
    actions = {k: row[k].pop("actions") for k in kinds if k in row}
    row["deviation"] = {f"{k}_vs_dense_relative_l2": _relative(v, actions["dense"])
                        for k, v in actions.items() if k != "dense"}
    row["deviation"]["cached_graph_vs_eager_relative_l2"] = _relative(actions["cached_torch"],
                                                                      actions["cached_torch_eager"])
    if "cached_cupy" in actions:
        row["deviation"]["cupy_vs_torch_cached_relative_l2"] = _relative(actions["cached_cupy"],
                                                                         actions["cached_torch"])
    row["speedup_vs_dense"] = {k: _speedup(row["dense"], row[k]) for k in ("cached_torch", "cached_cupy") if k in row}
    row["speedup_graphs_vs_eager"] = {"dense": _speedup(row["dense_eager"], row["dense"]),
                                      "cached_torch": _speedup(row["cached_torch_eager"], row["cached_torch"])}
    return row


def build_engines(plan: Plan, checkpoint: Path | None = None, ratios: tuple[float, float] = (0.4, 0.5)):
    """The model (random weights of the plan's preset, or ``checkpoint``; the bench's builder) and
    both engines, built before any call: each engine (re)allocates the model's caches, and a
    captured CUDA graph must see the final ones."""
    from vla_runtime.engine.cached import CacheConfig, CachedEngine
    from vla_runtime.engine.dense import DenseEngine
    from vla_runtime.commands.bench import BenchSpec, build_model

    spec = BenchSpec(preset=plan.preset, dtype=plan.dtype, device=plan.device,
                     checkpoint=str(checkpoint) if checkpoint else None)
    model, _ = build_model(spec, log=lambda m: print(f"[gpu-checks] {m}", file=sys.stderr, flush=True))
    dense = DenseEngine(model)
    cached = CachedEngine(model, CacheConfig(rho_p=ratios[0], rho_n=ratios[1]))
    return model, dense, cached


def check_latency(plan: Plan, report: Report) -> dict:
    return _latency(plan, report, "latency", plan.cameras)


def check_trained(plan: Plan, report: Report) -> dict:
    if not (TRAINED / "config.json").is_file():
        return {"failed": f"no bundled checkpoint at {TRAINED}"}
    return _latency(plan, report, "trained", None, TRAINED, TRAINED_RATIOS)


def _latency(plan: Plan, report: Report, name: str, cameras: list[int] | None, checkpoint: Path | None = None,
             ratios: tuple[float, float] = (0.4, 0.5)) -> dict:
    """Dense vs cached per camera count (``None``: the model's own number of cameras)."""
    t0 = time.monotonic()
    model, dense, cached = build_engines(plan, checkpoint, ratios)
    with kernels.use_backend("auto"):
        kernel_ok = not plan.dry_run and kernels.kernel_backend().name == "cupy"
    out: dict[str, Any] = {"preset": str(checkpoint) if checkpoint else plan.preset, "dtype": plan.dtype,
                           "device": plan.device, "rho_p": ratios[0], "rho_n": ratios[1],
                           "model_build_s": time.monotonic() - t0, "cuda_graphs_requested": dense.cuda_graphs,
                           "kernels_compared": kernel_ok, "configs": [], "errors": []}
    for cams in cameras or [model.cfg.num_cameras]:
        if cams > model.cfg.num_cameras:
            out["errors"].append(f"{cams} cameras: the model takes at most {model.cfg.num_cameras}")
            continue
        if report.elapsed() > plan.budget_s:
            out["errors"].append(f"{cams} cameras: skipped, time budget used up")
            continue
        out["configs"].append(latency_for_cameras(model, dense, cached, cams, plan, kernel_ok))
        report.record(name, {"status": "running", "result": out})  # partial figures survive a timeout
    out["cuda_graphs_used"] = {"dense": dense.cuda_graphs, "cached": cached.cuda_graphs}
    if out["errors"]:
        out["failed"] = "; ".join(out["errors"])
    return out


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    report = Report(plan)
    torch.manual_seed(0)
    for name, fn in (("environment", check_environment), ("kernels", check_kernels), ("ipc", check_ipc),
                     ("latency", check_latency), ("trained", check_trained)):
        run_check(report, name, fn)
    report.write()
    print(f"[gpu-checks] {'OK' if report.data['ok'] else 'FAILED'}: {report.path} ({report.elapsed():.0f} s)",
          file=sys.stderr, flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
