"""The most the muscle-memory cache could save a call of this model on this machine, before any of
its own costs, next to what it does save (JSON out).

Not part of CI. The cache skips feed-forward work only: the Context Cache the FFN rows of the
visual tokens it reuses in the prefill's FFN layers (all but the last VLM layer, whose FFN output
nothing reads), the Action Cache the neurons outside its mask in the denoising steps that are not
a group's anchor. This bench runs the repository's calls dense, in one process on one thread, and
times every FFN call of those two phases as it happens; beside each one it times the same MLP
over only the rows (Context Cache, ``ceil(rho_p * Pv)`` visual rows plus every text row) or the
neurons (Action Cache, ``ceil(rho_n * mlp_dim)`` of them, compact weights gathered beforehand
in the cache's own layout) that the half would compute. The difference, summed
over a call, is each half's ceiling: what it would save if choosing the rows, gathering and
scattering, anchors and the reference's states cost nothing. Then it times the halves as ``auto``
does (``time_halves``: the same calls dense and cached back to back) for what they save with
their costs, and, given what choosing a reference costs a call in the pipeline (``--select-ms``,
from ``eval.json``'s ``select`` phase), the best per-call ratio the cache could reach:
dense / (dense - both ceilings + selection).

    python bench/cache_ceiling.py --checkpoint checkpoints/pi05-mw-metaworld \\
        --repository out/eval50_s42_auto/repository --select-ms 0.35 --out out/cache_ceiling_mw.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baseline import write_report  # noqa: E402
from vla_runtime.cache.half_profile import cases_from_repository, time_halves  # noqa: E402
from vla_runtime.cache.halves import choose_rho_p  # noqa: E402
from vla_runtime.cache.masks import resolve_groups  # noqa: E402
from vla_runtime.cache.repository import ReferenceRepository  # noqa: E402
from vla_runtime.engine.dense import DenseEngine  # noqa: E402
from vla_runtime.engine.policy import Pi05Policy  # noqa: E402
from vla_runtime.kernels.fallback import blocked_mlp, gelu_tanh_  # noqa: E402


class FFNClock:
    """Per call: seconds in the FFN calls of each phase, and in the reduced MLPs timed beside them."""

    def __init__(self) -> None:
        self.dense = {"prefill": 0.0, "denoise": 0.0}
        self.reduced = {"prefill": 0.0, "denoise": 0.0}

    def add(self, phase: str, dense_s: float, reduced_s: float) -> None:
        self.dense[phase] += dense_s
        self.reduced[phase] += reduced_s


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


class CeilingEngine(DenseEngine):
    """The dense engine, its FFN calls timed, each beside the reduced MLP a half would run instead."""

    def __init__(self, model, rho_p: float, rho_n: float, anchors: set[int]):
        super().__init__(model)
        self.rho_p, self.anchors, self.clock = rho_p, anchors, FFNClock()
        e = model.cfg.expert
        k = min(e.mlp_dim, math.ceil(rho_n * e.mlp_dim))
        self.k = k
        # compact weights of the first k neurons of every expert layer (which neurons does not
        # change the time), laid out as the model's own: gate/up rows [2K, W], read transposed, and
        # down rows [K, W], so that the ceiling is what the mask saves, not what a layout would
        self.compact = []
        for layer in model.expert_layers:
            mlp = layer.mlp
            b = mlp.block
            gate = torch.cat([mlp.gate_up[c, :b] for c in range(mlp.gate_up.shape[0])])[:k]
            up = torch.cat([mlp.gate_up[c, b:] for c in range(mlp.gate_up.shape[0])])[:k]
            self.compact.append((torch.cat([gate, up]).contiguous(), mlp.down_t[:k].contiguous()))
        self.scratch = torch.empty(model.cfg.chunk_size, 2 * k)
        self.visual_tokens = 0

    def infer(self, inputs, noise=None, generator=None, select=None):
        self.visual_tokens = int(inputs.image_mask[0].sum()) * self.cfg.num_image_tokens
        return super().infer(inputs, noise, generator, select)

    def _prefill_ffn(self, reference, inputs):
        def ffn(layer, mlp, x):
            y, dense_s = timed(mlp, x)
            pv = self.visual_tokens
            rows = math.ceil(self.rho_p * pv) + (x.shape[1] - pv)
            sub = x[0, :rows].contiguous()
            _, reduced_s = timed(blocked_mlp, sub, mlp.gate_up, mlp.down_t)
            self.clock.add("prefill", dense_s, reduced_s)
            return y
        return ffn

    def _denoise_ffn(self, reference):
        def ffn(layer, step, mlp, x, ws):
            y, dense_s = timed(mlp, x, ws)
            if step in self.anchors:
                reduced_s = dense_s
            else:
                gate_up, down = self.compact[layer]
                t0 = time.perf_counter()
                torch.mm(x[0], gate_up.t(), out=self.scratch)
                h = gelu_tanh_(self.scratch[:, :self.k]).mul_(self.scratch[:, self.k:])
                torch.mm(h, down)
                reduced_s = time.perf_counter() - t0
            self.clock.add("denoise", dense_s, reduced_s)
            return y
        return ffn


def median_ms(values) -> float:
    return statistics.median(values) * 1e3


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    policy = Pi05Policy.from_checkpoint(args.checkpoint, camera_names=args.cameras)
    model = policy.engine.model
    repo = ReferenceRepository.open(args.repository, verify=False)
    rho_n = repo.meta.rho_n
    args.rho_p, _ = choose_rho_p(args.rho_p, repo.meta.half_timing)   # as the runtime takes it
    groups = resolve_groups(tuple(tuple(g) for g in repo.meta.mask_groups) or None, model.cfg.num_steps)
    cases = cases_from_repository(model, repo, calls_per_task=args.calls_per_task)
    plain = DenseEngine(model)
    ceiling = CeilingEngine(model, args.rho_p, rho_n, {a for a, _ in groups})
    plain.infer(cases[0].inputs, noise=cases[0].noise)          # warm-up
    ceiling.infer(cases[0].inputs, noise=cases[0].noise)
    calls = {"total": [], "vision": [], "prefill": [], "denoise": []}
    ffn = {f"{p}_{k}": [] for p in ("prefill", "denoise") for k in ("ffn", "ceiling")}
    for _ in range(args.repeats):
        for case in cases:
            times = plain.infer(case.inputs, noise=case.noise).times.seconds   # untouched dense phases
            for p in ("vision", "prefill", "denoise"):
                calls[p].append(times[p])
            calls["total"].append(sum(times.values()))
            ceiling.clock = FFNClock()
            ceiling.infer(case.inputs, noise=case.noise)
            for p in ("prefill", "denoise"):
                ffn[f"{p}_ffn"].append(ceiling.clock.dense[p])
                ffn[f"{p}_ceiling"].append(ceiling.clock.dense[p] - ceiling.clock.reduced[p])
    halves = time_halves(model, cases, args.rho_p, rho_n, groups, repeats=args.repeats).as_dict()
    saved = {h: (halves[h]["dense_s"] - halves[h]["cached_s"]) * 1e3 for h in ("context_cache", "action_cache")}
    report = {
        "checkpoint": args.checkpoint, "repository": args.repository, "rho_p": args.rho_p, "rho_n": rho_n,
        "groups": [list(g) for g in groups], "calls": len(cases), "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "dense_ms": {p: median_ms(v) for p, v in calls.items()},
        "ffn_ms": {p: median_ms(ffn[f"{p}_ffn"]) for p in ("prefill", "denoise")},
        "ceiling_ms": {"context_cache": median_ms(ffn["prefill_ceiling"]),
                       "action_cache": median_ms(ffn["denoise_ceiling"])},
        "measured_saving_ms": saved, "halves": halves,
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
    }
    total = report["dense_ms"]["total"]
    best = total - sum(report["ceiling_ms"].values())
    report["best_ratio_without_selection"] = total / best
    if args.select_ms is not None:
        report["select_ms"] = args.select_ms
        report["best_ratio"] = total / (best + args.select_ms)
        report["best_ratio_context_cache_alone"] = total / (total - report["ceiling_ms"]["context_cache"]
                                                             + args.select_ms)
    return report


def main() -> int:
    from vla_runtime.sim.metaworld_env import DEFAULT_CAMERAS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--repository", required=True, help="references (their calls are the calls timed)")
    ap.add_argument("--cameras", nargs="+", default=list(DEFAULT_CAMERAS), help="the policy's camera names")
    ap.add_argument("--rho-p", dest="rho_p", type=float, default=None,
                    help="the Context Cache's fraction recomputed (default: the repository's profiled one, as "
                         "the runtime takes it)")
    ap.add_argument("--select-ms", dest="select_ms", type=float, default=None,
                    help="what choosing a reference costs a call in the pipeline (eval.json's select phase)")
    ap.add_argument("--calls-per-task", dest="calls_per_task", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="the report (JSON)")
    args = ap.parse_args()
    if (args.rho_p is not None and not 0 < args.rho_p <= 1) or args.calls_per_task < 1 or args.repeats < 1:
        ap.error("--rho-p must be in (0, 1], --calls-per-task and --repeats at least 1")
    report = run(args)
    write_report(args.out, report)
    d, f, c, s = report["dense_ms"], report["ffn_ms"], report["ceiling_ms"], report["measured_saving_ms"]
    print(f"dense call {d['total']:.2f} ms: vision {d['vision']:.2f}, prefill {d['prefill']:.2f} "
          f"(FFN {f['prefill']:.2f}), denoise {d['denoise']:.2f} (FFN {f['denoise']:.2f})")
    print(f"context cache at rho_p {report['rho_p']:g}: could save {c['context_cache']:.2f} ms, saves "
          f"{s['context_cache']:.2f} ms")
    print(f"action cache at rho_n {report['rho_n']:g}: could save {c['action_cache']:.2f} ms, saves "
          f"{s['action_cache']:.2f} ms")
    line = f"best ratio per call with no cost of its own: {report['best_ratio_without_selection']:.3f}x"
    if "best_ratio" in report:
        line += (f"; paying {report['select_ms']:g} ms to choose: {report['best_ratio']:.3f}x "
                 f"(Context Cache alone {report['best_ratio_context_cache_alone']:.3f}x)")
    print(line)
    print(f"load average {report['load_average_start'][0]:.2f} -> {report['load_average_end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
