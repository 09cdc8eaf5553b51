"""Memory of each process of the three-process pipeline, with and without per-role weights.

    python bench/process_memory.py --preset pi05-small --out out/process_memory_small.json
    flock /tmp/heavy.lock python bench/process_memory.py --preset pi05 --cache off --calls 1 \\
        --checkpoint-dtype bfloat16 --out out/process_memory_pi05.json

Starts ``ProcessPipeline`` (vision, policy and, with ``--cache on``, the cache manager as three OS
processes, as ``vla-runtime run --processes 3`` does) once per ``--weights-per-role`` mode, runs
``--calls`` calls (warm-up: every weight a stage runs is read), then reads each stage process's
RSS, USS and PSS (``psutil.Process.memory_full_info``), its peak RSS (``VmHWM``) and, with shared
weights, the resident part of its mapping of the weight file. USS is what the process alone costs
(freed if it exits); PSS splits shared pages between the processes that map them, so the PSS sum
is what the group costs. Next to the measurements: the weight bytes each stage reports holding
(``models.parts.weight_bytes`` of its model), and the same computed for the preset in float32 and
bfloat16 from a meta-device skeleton (nothing loaded) with the KV caches and denoising workspace
each role allocates: what each process would hold on a GPU, and whether the three fit a card.

``--cache on`` builds a demo robot of the preset (``make_demo``: random weights, synthetic
episodes) and a reference repository from it, and calls on a held-out episode; ``--cache off``
writes only a random checkpoint (``--checkpoint-dtype``: bfloat16 halves what writing full pi0.5
needs) and calls on synthetic frames (no cache manager process). JSON to stdout and ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from vla_runtime.models.config import Pi05Config, preset  # noqa: E402
from vla_runtime.models.gemma import Workspace  # noqa: E402
from vla_runtime.models.parts import ROLE_PARTS, ModelPart, weight_bytes  # noqa: E402
from vla_runtime.models.shared_weights import default_cache_dir, mapping_usage, runtime_skeleton  # noqa: E402
from vla_runtime.nodes.pipeline import PipelineSpec, ProcessPipeline  # noqa: E402
from vla_runtime.nodes.profile import CacheSpec, EngineSpec  # noqa: E402
from vla_runtime.nodes.stages import DTYPES, RingNames  # noqa: E402

CAMERAS = ("top", "wrist")
TASK = "pick up the red block and put it in the bowl"
GIB = 2 ** 30


# ---------------------------------------------------------------- what each role holds (computed)
def role_budget(cfg: Pi05Config, dtype: torch.dtype) -> dict[str, dict[str, int]]:
    """Weight bytes per role (and everything, one process) plus the runtime buffers each allocates:
    a batch-1 KV cache of every layer (all roles: the VLM writes it, the expert reads it) and the
    denoising workspace (roles with the expert)."""
    kv_rows = cfg.max_prefix_len + cfg.chunk_size
    kv = 2 * cfg.vlm.depth * cfg.vlm.num_kv_heads * kv_rows * cfg.vlm.head_dim * dtype.itemsize
    out = {}
    for role, parts in {"one_process": None, **ROLE_PARTS}.items():
        model = runtime_skeleton(cfg, dtype)
        if parts is not None:
            model.keep_only(parts)
        ws = 0
        if parts is None or ModelPart.EXPERT in parts:
            with torch.device("meta"):
                ws = Workspace.allocate(cfg.expert, 1, cfg.chunk_size, kv_rows, dtype).nbytes()
        out[role] = {"weights": weight_bytes(model), "kv_cache": kv, "workspace": ws}
    return out


def gpu_fit(budget: dict[str, dict[str, int]], card_gib: float, context_gib: float) -> dict:
    """Do the three role processes fit one card? Weights + KV cache + workspace per process, plus a
    CUDA context per process (``context_gib``: an allowance, not measured here: no GPU)."""
    def need(roles: list[str]) -> float:
        return sum(sum(budget[r].values()) / GIB + context_gib for r in roles)

    per_role, whole = need(["vision", "policy", "cache"]), need(["one_process"] * 3)
    return {"card_gib": card_gib, "cuda_context_allowance_gib_per_process": context_gib,
            "per_role_gib": round(per_role, 3), "per_role_fits": per_role <= card_gib,
            "full_model_in_each_gib": round(whole, 3), "full_model_in_each_fits": whole <= card_gib,
            "not_counted": "a call's activations, cuBLAS workspaces, CUDA graph pools, reference entries on the device"}


# ---------------------------------------------------------------- inputs
def prepare(args: argparse.Namespace) -> tuple[Path, str | None, list[tuple[dict, np.ndarray, str]], int]:
    """Checkpoint, repository (None without the cache), the frames to call on, the state dim."""
    work = Path(args.work)
    if args.cache == "on":
        from vla_runtime.cache.builder import BuildConfig, build_repository
        from vla_runtime.engine.policy import Pi05Policy
        from vla_runtime.io.bags import list_episode_bags, read_episode
        from vla_runtime.commands.demo import DemoSpec, demo_topics, make_demo

        demo = work / "demo"
        if not (demo / "demo.json").exists():
            make_demo(demo, DemoSpec(preset=args.preset, episodes=3, held_out=1, steps_per_episode=args.steps,
                                     cameras=CAMERAS), log=lambda m: None)
        info = json.loads((demo / "demo.json").read_text())
        repo = demo / "repo"
        if not repo.exists():
            policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=list(CAMERAS))
            build_repository(policy, policy.checkpoint_hash, list_episode_bags(info["references"]), repo,
                             demo_topics(CAMERAS), call_period=0.5, cfg=BuildConfig(rho_n=0.5), log=lambda m: None)
            del policy
        ep = read_episode(list_episode_bags(info["held_out"])[0], demo_topics(CAMERAS), call_period=0.5)
        frames = [(f.images, np.asarray(f.state), ep.task) for f in ep.frames]
        return Path(info["checkpoint"]), str(repo), frames, len(frames[0][1])
    from vla_runtime.commands.demo import write_random_checkpoint

    cfg = preset(args.preset)
    state_dim = min(14, cfg.max_state_dim, cfg.action_dim)   # two 7-joint arms where the model takes them
    ckpt = Path(args.checkpoint) if args.checkpoint else work / f"{args.preset}-{args.checkpoint_dtype}"
    rng = np.random.default_rng(0)
    if not (ckpt / "config.json").exists():
        states = rng.normal(size=(256, state_dim)).astype(np.float32)
        write_random_checkpoint(ckpt, cfg, [TASK], states, states, CAMERAS, dtype=DTYPES[args.checkpoint_dtype])
    s = cfg.vision.image_size
    frames = [({c: rng.integers(0, 256, (s, s, 3), dtype=np.uint8) for c in CAMERAS},
               rng.normal(size=state_dim).astype(np.float32), TASK) for _ in range(args.calls)]
    return ckpt, None, frames, state_dim


# ---------------------------------------------------------------- measuring
def _build_shared(ckpt: str, dtype: str) -> None:
    from vla_runtime.models.checkpoint import load_checkpoint

    load_checkpoint(ckpt, dtype=DTYPES[dtype], share_weights=True)


def build_shared_file(ckpt: Path, dtype: str) -> None:
    """Write the shared weight file in a process of its own first (the first loader builds it from
    a private copy of everything): the stage processes' peaks then show the steady state."""
    p = mp.get_context("spawn").Process(target=_build_shared, args=(str(ckpt), dtype))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"building the shared weight file failed (exit code {p.exitcode})")


def process_memory(pid: int, weight_file: Path | None) -> dict[str, int]:
    info = psutil.Process(pid).memory_full_info()
    out = {"rss": info.rss, "uss": info.uss, "pss": info.pss, "shared": info.shared}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            out["peak_rss"] = int(line.split()[1]) * 1024
    if weight_file is not None:
        usage = mapping_usage(weight_file, pid)
        out["weight_file_rss"], out["weight_file_pss"] = usage["Rss"], usage["Pss"]
    return out


def run_mode(args: argparse.Namespace, ckpt: Path, repo: str | None, frames, state_dim: int,
             per_role: bool) -> dict:
    engine = EngineSpec(dtype=args.dtype, threads=args.threads, share_weights=args.share_weights == "on",
                        weights_per_role=per_role)
    cache = CacheSpec(enabled=repo is not None, repository=repo)
    spec = PipelineSpec(ckpt, CAMERAS, cache, engine, rings=RingNames.tagged(f"pm{os.getpid()}"),
                        time_available_s=10.0, state_dim=state_dim)
    t0 = time.perf_counter()
    with ProcessPipeline(spec, start_timeout_s=3600.0) as pipeline:
        start_s = time.perf_counter() - t0
        seconds, cached, dense_why = [], 0, []
        pipeline.start_episode(frames[0][2])   # announced, as a robot resetting does: the window is loaded
        for images, state, task in frames[: args.calls]:
            t1 = time.perf_counter()
            res = pipeline.call(images, state, task, timeout_s=3600.0)
            seconds.append(time.perf_counter() - t1)
            cached += int(res.cached)
            if not res.cached and pipeline.last_choice is not None:
                dense_why.append(pipeline.last_choice.reason)
        weight_file = None
        if args.share_weights == "on":
            cache_dir = str(default_cache_dir().resolve())
            weight_file = next((Path(p.path) for p in psutil.Process(pipeline.processes["vision"].pid).memory_maps()
                                if p.path.startswith(cache_dir) and p.path.endswith(".safetensors")), None)
        stages = {name: {"pid": p.pid, "parts": list(pipeline.weights[name].parts),
                         "weight_bytes": pipeline.weights[name].nbytes, **process_memory(p.pid, weight_file)}
                  for name, p in pipeline.processes.items()}
    totals = {k: sum(s[k] for s in stages.values()) for k in ("rss", "uss", "pss", "weight_bytes")}
    return {"weights_per_role": per_role, "start_s": round(start_s, 2), "calls": len(seconds),
            "cached_calls": cached, "dense_reasons": dense_why, "call_s": [round(s, 3) for s in seconds],
            "weight_file": None if weight_file is None else str(weight_file), "stages": stages, "totals": totals}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pi05-small")
    ap.add_argument("--checkpoint", help="use this checkpoint (with --cache off) instead of writing one")
    ap.add_argument("--checkpoint-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the random checkpoint written (the runtime dtype is --dtype)")
    ap.add_argument("--work", default="/tmp/process_memory", help="checkpoint/demo directory (reused)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3, help="warm-up calls before measuring")
    ap.add_argument("--steps", type=int, default=60, help="steps per demo episode (--cache on; at least 20)")
    ap.add_argument("--cache", choices=["on", "off"], default="on")
    ap.add_argument("--share-weights", choices=["on", "off"], default="on")
    ap.add_argument("--weights-per-role", choices=["on", "off", "both"], default="both")
    ap.add_argument("--card-gib", type=float, default=22.0, help="usable memory of the card (a 24 GB card: ~22 GiB)")
    ap.add_argument("--cuda-context-gib", type=float, default=0.5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.share_weights == "on":
        os.environ.setdefault("VLA_RUNTIME_CACHE", str(Path(args.work) / "weights"))

    cfg = preset(args.preset)
    computed = {dt: role_budget(cfg, DTYPES[dt]) for dt in ("float32", "bfloat16")}
    report = {"preset": args.preset, "dtype": args.dtype, "threads": args.threads, "cache": args.cache,
              "share_weights": args.share_weights, "computed": computed,
              "gpu_fit": {dt: gpu_fit(b, args.card_gib, args.cuda_context_gib) for dt, b in computed.items()},
              "runs": []}
    ckpt, repo, frames, state_dim = prepare(args)
    report["checkpoint"] = str(ckpt)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.weights_per_role]
    if args.share_weights == "on":
        build_shared_file(ckpt, args.dtype)
    for per_role in modes:
        report["runs"].append(run_mode(args, ckpt, repo, frames, state_dim, per_role))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
