"""``vla-runtime``: the ROS-free command line (bench, inspect; more commands join as they land)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from .models.checkpoint import CheckpointError
from .models.config import PRESETS


def _bench(args: argparse.Namespace) -> int:
    from .tools.bench import BenchSpec, run_bench, write_json

    spec = BenchSpec(**{f.name: getattr(args, f.name) for f in fields(BenchSpec)})
    write_json(run_bench(spec, log=lambda m: print(m, file=sys.stderr)), args.out)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .models.checkpoint import checkpoint_files, content_hash, infer_config, read_tensor_index, validate
    from pathlib import Path

    path = Path(args.checkpoint)
    files = checkpoint_files(path)
    index, layout = read_tensor_index(files)
    cfg = infer_config(path, index)
    validate(cfg, index, path)
    info = {"path": str(path), "layout": layout, "files": [str(f) for f in files], "tensors": len(index),
            "vision_depth": cfg.vision.depth, "vlm_depth": cfg.vlm.depth, "expert_depth": cfg.expert.depth,
            "cameras": cfg.num_cameras, "chunk": cfg.chunk_size, "action_dim": cfg.action_dim,
            "content_hash": content_hash(files) if args.hash else None}
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vla-runtime", description="Fast pi0.5 inference for robots.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="per-phase latency, peak memory and efficiency of the dense engine (JSON)")
    b.add_argument("--preset", default="pi05-small", choices=sorted(PRESETS), help="model size with random weights")
    b.add_argument("--checkpoint", default=None, help="load this checkpoint instead of a random preset")
    b.add_argument("--cameras", type=int, default=3, help="number of camera images per call")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    b.add_argument("--repeats", type=int, default=5, help="timed calls (median reported)")
    b.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    b.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=64, help="valid prompt tokens")
    b.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--gemm-size", dest="gemm_size", type=int, default=2048, help="square matmul size for the throughput ceiling")
    b.add_argument("--out", default=None, help="also write the JSON here")
    b.set_defaults(func=_bench)

    i = sub.add_parser("inspect", help="validate a checkpoint and print its architecture")
    i.add_argument("checkpoint")
    i.add_argument("--hash", action="store_true", help="also compute the content hash (reads every byte)")
    i.set_defaults(func=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"vla-runtime {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
