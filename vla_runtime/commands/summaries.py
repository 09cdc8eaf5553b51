"""Short human summaries of the benches' and build-cache's JSON results, for stdout.

A bench result is a page of JSON (every timed call, the machine, the spec); what a user reads
after a run is a handful of figures. Each function here picks those figures out of the result,
so the summary can never say something the JSON does not; ``emit`` prints it and writes the
JSON where ``--out`` says (``--out -``: the JSON on stdout instead, for a pipe).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

PHASES = ("vision", "prefill", "denoise", "total")


def emit(result: dict[str, Any], out: str | None, summary: Callable[[dict[str, Any]], str]) -> None:
    """The summary on stdout and the JSON in ``out``; ``out == "-"``: the JSON on stdout alone."""
    text = json.dumps(result, indent=2, default=str)
    if out == "-":
        print(text)
        return
    lines = summary(result).rstrip("\n")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        lines += f"\nJSON (every call, the machine, the spec): {out}"
    else:
        lines += "\n(--out FILE writes the whole result as JSON)"
    print(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f} ms"


def bench(r: dict[str, Any]) -> str:
    """``vla-runtime bench``: the median of each phase, its share of the GEMM ceiling, peak memory."""
    spec, med = r["spec"], r["median_s"]
    rows = [f"{r['model']}: {spec['cameras']} camera(s), {spec['dtype']} on {spec['device']}, "
            f"median of {spec['repeats']} call(s)"]
    for p in PHASES:
        if p in med:
            rows.append(f"  {p:<8} {_ms(med[p]):>10}   {r['useful_gflop'][p]:8.2f} GFLOP   "
                        f"{r['fraction_of_gemm'][p]:6.1%} of this machine's GEMM rate")
    rows.append(f"peak memory {r['peak_memory_mb']:.0f} MB; GEMM ceiling {r['gemm_gflops']:.1f} GFLOP/s")
    return "\n".join(rows)


def stream(r: dict[str, Any]) -> str:
    """``bench --stream``: stall rate, reaction latency and jerk of each mode against sync."""
    rows = [f"{'mode':<22} {'stalls':>7} {'reaction':>10} {'vs sync':>8} {'jerk@boundary':>14} {'late':>5}"]
    for mode, s in r["summary"].items():
        react = "-" if s["reaction_median_ms"] is None else f"{s['reaction_median_ms']:.0f} ms"
        cut = "-" if s["reaction_reduction_vs_sync"] is None else f"{0.0 - s['reaction_reduction_vs_sync']:+.0%}"
        rows.append(f"{mode:<22} {s['stall_rate']:>7.1%} {react:>10} {cut:>8} {s['boundary_rms_jerk']:>14.2f} "
                    f"{s['late_chunks']:>5}")
    latency = r["latency"] if isinstance(r["latency"], str) else f"{r['latency']['injected_ms']:g} ms injected"
    rows.append(f"latency {latency}, {r['control_hz']:g} Hz control, {r['duration_s']:g} s simulated")
    return "\n".join(rows)


def history(r: dict[str, Any]) -> str:
    """``bench --history``: incremental against full recompute, and that they agree."""
    m = r["median_s"]
    return (f"{r['preset']}, {r['frames']}-frame window: incremental {_ms(m['incremental'])}, full recompute "
            f"{_ms(m['full_recompute'])} ({r['speedup']:.2f}x); max action difference {r['max_abs_diff_vs_full']:.2e}")


def cache_bench(r: dict[str, Any]) -> str:
    """``bench --cache``: how many calls the cache served, its speed-up per phase, the deviation."""
    dev, dense, cached = r["deviation"], r["median_s"]["dense"], r["median_s"]["cached"]
    rows = [f"{r['cached_calls']}/{r['calls']} calls served by the cache ({r['hit_rate']:.0%})"
            + (f"; dense because: {', '.join(f'{k} x{v}' for k, v in r['dense_reasons'].items())}"
               if r["dense_reasons"] else "")]
    for p in PHASES:
        if p in r["speedup"]:
            rows.append(f"  {p:<8} dense {_ms(dense[p]):>10}  cached {_ms(cached[p]):>10}  {r['speedup'][p]:.2f}x")
    if dev["mean_relative_l2"] is not None:
        rows.append(f"action deviation of cached chunks (relative L2): mean {dev['mean_relative_l2']:.2e}, "
                    f"worst {dev['worst_relative_l2']:.2e}")
    return "\n".join(rows)


def build(s: dict[str, Any]) -> str:
    """``build-cache``: what the repository holds, the profiled ratios and the halves' timing."""
    rows = [f"repository {s['repository']}: {s['episodes']} episode(s), {s['calls']} calls, "
            f"{s['bytes_per_call'].get('total', 0) / 1e6:.2f} MB per call, rho_n {s['rho_n']:g}, "
            f"built in {s['seconds']:.0f} s" + (f"; {len(s['skipped'])} failed episode(s) skipped" if s["skipped"] else "")]
    if s["profile"]:
        rows.append("profile, held-out calls dense vs cached:")
        rows.append("  rho_p  rho_n  hits  mean_dev  worst_dev  flops  speedup (prefill, denoise)")
        rows += [f"  {p['rho_p']:5.2f}  {p['rho_n']:5.2f}  {p['hits']:4d}  {p['mean_deviation']:8.4f}  "
                 f"{p['worst_deviation']:9.4f}  {p['flops_fraction']:5.2f}  {p['median_speedup']:7.2f} "
                 f"({p['median_prefill_speedup']:.2f}, {p['median_denoise_speedup']:.2f})" for p in s["profile"]]
        rows.append("suggested rho_p " + (f"{s['rho_p']:g}" if s["rho_p"] is not None else
                                          "none (no point within the tolerance)"))
    if s["half_timing"]:
        t = s["half_timing"]
        rows.append("each half against dense: " + ", ".join(
            f"{h.replace('_', ' ')} {1e3 * t[h]['dense_s']:.2f} -> {1e3 * t[h]['cached_s']:.2f} ms "
            f"({t[h]['speedup']:.2f}x)" for h in ("context_cache", "action_cache")))
    return "\n".join(rows)
